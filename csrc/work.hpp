// TDistWork: the c10d::Work of a call that tdist serves, or of an async call
// handed to the fallback backend in the group's stream order. It lives apart
// from the backend because the watchdog (watchdog.hpp) holds works too and
// needs only this class.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "device_path.hpp"

namespace tdist {

// Construct it before the executor runs (so a profiler range covers the
// call), then call markDone(). On a GPU, startOnStream() first puts the call
// on its stream; markDone() then records the end of its work there, keeps an
// async call's tensors alive until wait() (when that stream is not the
// caller's; a synchronous call keeps none), and returns to the caller's stream.
class TDistWork : public c10d::Work {
 public:
  TDistWork(
      int rank,
      c10d::OpType type,
      const char* profilingTitle,
      const std::vector<at::Tensor>& inputs,
      std::vector<at::Tensor> outputs,
      bool asyncOp);

  // `capture`: the id of the CUDA graph capture the caller's stream is in (0:
  // none).
  void startOnStream(
      c10::Stream stream,
      std::shared_ptr<EventPool> events,
      bool blockHost,
      uint64_t capture);
  void markDone();

  // GPU: the caller's current stream waits for the call (the host too for a
  // barrier); CPU: nothing left to wait for.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  bool isCompleted() override;
  void synchronize() override;

  // For the watchdog: whether the call's GPU work is done (no lock: end_ is
  // fixed once markDone() returned), and failing it (wait() then raises).
  bool finishedOnDevice() const;
  // failing(): a failure is coming (the watchdog is about to abort the group,
  // which lets the device finish the work); wait() holds until fail(reason).
  void failing();
  void fail(const std::string& reason);
  // Whether the call went onto a GPU stream outside a CUDA graph capture.
  bool watchable() const;
  // Whether the caller asked for the work (async_op=True) rather than waiting
  // at once.
  bool asyncOp() const {
    return asyncOp_;
  }
  uint64_t capture() const {
    return capture_;
  }
  // The stream the call ran on and the event after its work (GPU calls).
  const std::optional<c10::Stream>& stream() const {
    return stream_;
  }
  const std::shared_ptr<c10::Event>& end() const {
    return end_;
  }

  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override;
  uint64_t getSequencenumber() const override;
  void setSequenceNumber(uint64_t seq);

 private:
  // Holds while the work is failing, raises once it failed.
  void raiseIfFailed();

  std::vector<at::Tensor> inputs_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  uint64_t seq_ = 0;
  std::optional<StreamScope> scope_; // while the call is being issued
  std::optional<c10::Stream> stream_; // the stream the call ran on
  std::shared_ptr<c10::Event> end_;
  bool asyncOp_;
  bool blockHost_ = false;
  uint64_t capture_ = 0;
  std::string failure_; // set by the watchdog
  bool failing_ = false;
  std::mutex mutex_;
  std::condition_variable failed_;
};

} // namespace tdist
