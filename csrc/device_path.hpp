// The GPU side of a served call, written against c10's device-generic stream
// and event API (no CUDA headers, so the same sources build with CPU torch):
//
// - StreamScope: an async call's kernels run on the group's own stream,
//   after everything the caller's current stream had queued; a call the
//   caller waits for at once runs on the caller's stream (NCCL's semantics
//   both). ProcessGroupTDist makes a call on another stream than the group's
//   previous call wait for that call's end, so the group's collectives on a
//   rank run in one order, which the kernels' epoch signals rely on.
// - CallPlan: the kernel launches that served a call (LaunchPlan: one each;
//   several where the message took rounds), as Python's executor made them
//   the first time, replayed from C++ for later calls of the same shape with
//   only the input and output pointers changed: no Python, no Triton
//   launcher on the hot path.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/utils/pybind.h>

#include "device_shim.hpp" // (its driver calls are part of this API)

namespace tdist {

// Events to reuse: creating and destroying one costs about a microsecond
// each, a good part of a small collective's host time.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  // A free event of `device` (or one never recorded), else a new one.
  std::unique_ptr<c10::Event> take(const c10::Device& device);
  void give(std::unique_ptr<c10::Event> event);
  // An event recorded on `stream` now; back in the pool when its last holder
  // drops it (the pool must be owned by a shared_ptr).
  std::shared_ptr<c10::Event> record(const c10::Stream& stream);
  // Records `event` on `stream` now (what c10::Event::record does, cheaper).
  static void recordOn(c10::Event& event, const c10::Stream& stream);

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<c10::Event>> free_;
};

class StreamScope {
 public:
  // Orders `comm` after the caller's current stream and makes it current
  // (nothing to do when `comm` is the caller's stream).
  StreamScope(c10::Stream comm, std::shared_ptr<EventPool> events);
  ~StreamScope(); // makes the caller's stream current again
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

  // An event recorded on the call's stream after its work.
  std::shared_ptr<c10::Event> recordEnd() const;
  bool onCallerStream() const {
    return comm_ == caller_;
  }

 private:
  c10::Stream comm_;
  c10::Stream caller_;
  std::shared_ptr<EventPool> events_;
};

// A pool stream of the device for the group's work.
c10::Stream newCommStream(const c10::Device& device);

// The calling thread's current stream on `device`.
c10::Stream currentStream(const c10::Device& device);

// Identifies calls that one recorded launch serves.
struct PlanKey {
  int op;
  int dtype;
  int64_t numelIn;
  int64_t numelOut;
  int reduceOp;
  int64_t root;
  int device;
  bool operator==(const PlanKey& o) const;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const;
};

class LaunchPlan {
 public:
  // What one kernel parameter holds: a literal, or (kind RolePtr + r) the
  // address of the call's tensor r plus the parameter's value, in bytes (a
  // collective's tensors: 0 its input, 1 its output).
  enum Kind : int { Literal64 = 0, Literal32 = 1, RolePtr = 2 };

  // From the executor's tuple: (function, (gx, gy, gz), threads, shared
  // bytes, [(kind, value), ...], programmatic dependent launch).
  static LaunchPlan fromPython(const py::handle& plan);

  // Whether the tensors may take the place of the recorded ones: contiguous
  // and as aligned as the compiled kernel assumed.
  static bool fits(const at::Tensor& t);

  // Launches on `stream` (a native stream handle).
  void launch(const at::Tensor& input, const at::Tensor& output, void* stream)
      const;
  // The same with the call's tensors' addresses.
  void launch(const std::vector<uintptr_t>& roles, void* stream) const;

 private:
  static constexpr size_t kMaxParams = 40;
  void* function_ = nullptr;
  std::array<unsigned, 3> grid_{1, 1, 1};
  unsigned threads_ = 0;
  unsigned sharedBytes_ = 0;
  std::vector<std::pair<int, uint64_t>> params_;
  bool dependentLaunch_ = false;
};

// The launches that served one call, in order (one per round where a
// message was larger than a mailbox slot; each a plain kernel launch whose
// pointers into the call's tensors are offsets from their first bytes).
class CallPlan {
 public:
  // From the executor's list of LaunchPlan tuples.
  static CallPlan fromPython(const py::handle& plan);
  void launch(const at::Tensor& input, const at::Tensor& output, void* stream) const;
  void launch(const std::vector<uintptr_t>& roles, void* stream) const;

 private:
  std::vector<LaunchPlan> launches_;
};

} // namespace tdist
