#include "watchdog.hpp"

#include <vector>

#include "device_path.hpp"
#include "work.hpp"

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
  std::unique_lock<std::mutex> lock(mutex_);
  if (failed_) {
    std::string failure = failure_;
    if (failure.empty()) {
      work->failing();
      late_.push_back(std::move(work));
      return;
    }
    lock.unlock();
    work->fail(failure);
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
  std::vector<c10::intrusive_ptr<TDistWork>> finished;
  while (!stop_) {
    wake_.wait_for(lock, kPoll);
    // The queries go without the lock: watch(), on every call's path, must
    // not wait for a scan of thousands of works (in long loops that added
    // microseconds to every call).
    std::list<Watched> scanned;
    scanned.swap(watched_);
    scanning_ = true;
    lock.unlock();
    auto now = std::chrono::steady_clock::now();
    const char* overran = nullptr; // the op of a work past its deadline
    std::chrono::milliseconds timeout{};
    for (auto it = scanned.begin(); it != scanned.end();) {
      if (it->work->finishedOnDevice()) {
        finished.push_back(std::move(it->work));
        it = scanned.erase(it);
      } else if (now > it->deadline) {
        overran = it->op;
        timeout = it->timeout;
        break;
      } else {
        ++it;
      }
    }
    lock.lock();
    watched_.splice(watched_.begin(), scanned); // (older than those watched since)
    scanning_ = false;
    scanned_.notify_all();
    if (!finished.empty()) {
      // Their tensors may be the last references to Python tensors, whose
      // freeing takes the GIL: never while holding the lock, which a thread
      // holding the GIL may be waiting for in watch() or failAll().
      lock.unlock();
      finished.clear();
      lock.lock();
    }
    if (!overran) {
      continue;
    }
    lock.unlock();
    failAll([&] { return onOverrun_(overran, timeout); });
    lock.lock();
  }
}

bool Watchdog::failAll(const std::function<std::string()>& abortGroup) {
  std::list<Watched> watched;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    scanned_.wait(lock, [this] { return !scanning_; }); // (the works a scan holds)
    if (failed_) {
      return false;
    }
    failed_ = true;
    watched.swap(watched_);
  }
  std::vector<c10::intrusive_ptr<TDistWork>> failed;
  for (auto& w : watched) {
    if (!w.work->finishedOnDevice()) { // (those that did finish succeeded)
      failed.push_back(w.work);
    }
  }
  for (auto& work : failed) {
    work->failing(); // before the abort lets the device finish them
  }
  std::string reason;
  try {
    reason = abortGroup();
  } catch (const std::exception& e) {
    reason = std::string("tdist: the group was aborted (and aborting it raised: ") + e.what() + ")";
  }
  if (reason.empty()) { // (an empty failure_ would mean "not known yet" to watch())
    reason = "tdist: the group was aborted";
  }
  std::vector<c10::intrusive_ptr<TDistWork>> late;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = reason;
    late.swap(late_);
  }
  for (const auto* works : {&failed, &late}) {
    for (const auto& work : *works) {
      work->fail(reason);
    }
  }
  return true; // (the works are freed here, without the lock: see run())
}

} // namespace tdist
