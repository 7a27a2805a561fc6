// TDistWork's definitions: how a call's end is recorded on its stream, how
// wait() orders the caller after it, and how the watchdog fails it.
#include "work.hpp"

#include <algorithm>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace tdist {

using c10d::Work;

TDistWork::TDistWork(
    int rank,
    c10d::OpType type,
    const char* profilingTitle,
    const std::vector<at::Tensor>& inputs,
    std::vector<at::Tensor> outputs,
    bool asyncOp)
    : Work(rank, type, profilingTitle, inputs),
      // A synchronous call's Work never reaches the caller (finishWork), and the call ran on the
      // caller's stream, so its tensors need no keeping. Kept until the watchdog lets the Work go
      // (its poll is 100 ms), they would stay out of the caching allocator: a loop that allocates
      // its outputs (the fused ops' sequential way) would get new memory on most calls, 100-360 us
      // of host time each.
      inputs_(asyncOp ? inputs : std::vector<at::Tensor>{}),
      outputs_(asyncOp ? std::move(outputs) : std::vector<at::Tensor>{}),
      asyncOp_(asyncOp) {}

void TDistWork::startOnStream(
    c10::Stream stream,
    std::shared_ptr<EventPool> events,
    bool blockHost,
    uint64_t capture) {
  stream_ = stream;
  scope_.emplace(stream, std::move(events));
  blockHost_ = blockHost;
  capture_ = capture;
}

void TDistWork::markDone() {
  bool onCaller = true;
  if (scope_) {
    end_ = scope_->recordEnd();
    onCaller = scope_->onCallerStream();
  }
  scope_.reset();
  if (onCaller) {
    inputs_.clear(); // the caller's stream already runs after the call
  }
  finish();
}

bool TDistWork::wait(std::chrono::milliseconds /*timeout*/) {
  raiseIfFailed();
  if (!end_) {
    return true;
  }
  if (blockHost_) {
    // (without the lock: the watchdog marks the work failing before the abort
    // that lets this return, and then the work has failed)
    end_->synchronize();
    raiseIfFailed();
  } else {
    auto caller = currentStream(end_->device());
    if (caller != *stream_) {
      end_->block(caller);
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  inputs_.clear(); // the caller's stream now runs after the call: its tensors may be freed
  return true;
}

void TDistWork::raiseIfFailed() {
  std::unique_lock<std::mutex> lock(mutex_);
  failed_.wait(lock, [this] { return !failing_; });
  if (!failure_.empty()) {
    C10_THROW_ERROR(DistBackendError, failure_);
  }
}

bool TDistWork::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return !end_ || end_->query();
}

void TDistWork::synchronize() {
  wait();
}

bool TDistWork::finishedOnDevice() const {
  return !end_ || end_->query();
}

void TDistWork::failing() {
  std::lock_guard<std::mutex> lock(mutex_);
  failing_ = true;
}

void TDistWork::fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = reason;
    failing_ = false;
  }
  failed_.notify_all();
}

bool TDistWork::watchable() const {
  return end_ != nullptr && capture_ == 0;
}

std::vector<at::Tensor> TDistWork::result() {
  return outputs_;
}

// Made on first use (most calls never ask): completed with the outputs,
// its events recorded on the group's stream, after the call's work.
c10::intrusive_ptr<c10::ivalue::Future> TDistWork::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (future_) {
    return future_;
  }
  std::vector<c10::Device> devices;
  for (const auto& t : outputs_) {
    if (!t.is_cpu() && std::find(devices.begin(), devices.end(), t.device()) ==
            devices.end()) {
      devices.push_back(t.device());
    }
  }
  future_ = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), devices);
  if (stream_) {
    c10::impl::VirtualGuardImpl impl(stream_->device_type());
    auto caller = impl.exchangeStream(*stream_);
    future_->markCompleted(c10::IValue(outputs_));
    impl.exchangeStream(caller);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  return future_;
}

c10::intrusive_ptr<c10::ivalue::Future> TDistWork::getFutureResult() {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
  fut->markCompleted(
      c10::IValue(static_cast<int64_t>(c10d::WorkResult::SUCCESS)));
  return fut;
}

uint64_t TDistWork::getSequencenumber() const {
  return seq_;
}

void TDistWork::setSequenceNumber(uint64_t seq) {
  seq_ = seq;
}

} // namespace tdist
