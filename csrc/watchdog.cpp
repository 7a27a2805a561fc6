#include "watchdog.hpp"

#include <vector>

#include "device_path.hpp"
#include "process_group_tdist.hpp"

namespace tdist {

namespace {
constexpr auto kPoll = std::chrono::milliseconds(100);
} // namespace

Watchdog::Watchdog(OnOverrun onOverrun)
    : onOverrun_(std::move(onOverrun)), thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::watch(
    c10::intrusive_ptr<TDistWork> work,
    std::chrono::milliseconds timeout,
    const char* op) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (overran_) {
    return;
  }
  watched_.push_back(
      {std::move(work),
       std::chrono::steady_clock::now() + timeout,
       timeout,
       op});
}

void Watchdog::run() {
  // Event queries from this thread must not break another thread's CUDA graph
  // capture (a "global" capture forbids them in every thread otherwise).
  relaxThreadCaptureMode();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, kPoll);
    auto now = std::chrono::steady_clock::now();
    const Watched* overrun = nullptr;
    for (auto it = watched_.begin(); it != watched_.end();) {
      if (it->work->finishedOnDevice()) {
        it = watched_.erase(it);
      } else if (now > it->deadline) {
        overrun = &*it;
        break;
      } else {
        ++it;
      }
    }
    if (!overrun) {
      continue;
    }
    const char* op = overrun->op;
    auto timeout = overrun->timeout;
    overran_ = true;
    std::vector<c10::intrusive_ptr<TDistWork>> failed;
    for (auto& w : watched_) {
      if (!w.work->finishedOnDevice()) { // (those that did finish succeeded)
        failed.push_back(std::move(w.work));
      }
    }
    watched_.clear();
    lock.unlock();
    for (auto& work : failed) {
      work->failing(); // before the abort lets the device finish them
    }
    std::string reason = onOverrun_(op, timeout);
    for (auto& work : failed) {
      work->fail(reason);
    }
    failed.clear(); // (tensors freed here, without the lock)
    lock.lock();
  }
}

} // namespace tdist
