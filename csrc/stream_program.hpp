// A bulk-path call of the pipelined overlap ops (torch_tdist/bulk.py), as
// Python recorded it the first time: copies, flag writes and zeroing on the
// caller's stream and side streams, events ordering one stream after another,
// matmuls and Triton launches (on any of them). Replayed from C++ for later
// calls of the same shapes with the call's tensors ("roles": the matmul's
// operands and results, a staging buffer) in place of the recorded ones;
// everything else (the heap's slots and flags) is where it was. Host time per
// call: a few microseconds a step instead of tens in Python.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <torch/csrc/utils/pybind.h>

#include "device_path.hpp"

namespace tdist {

class StreamProgram {
 public:
  // `steps`: the recorded list (torch_tdist/overlap/replay.py,
  // ProgramReplay._stream_program); `sideStreams`: the side streams, each as
  // torch.cuda.Stream's (stream_id, device_index, device_type).
  StreamProgram(
      const py::list& steps,
      const std::vector<std::tuple<int64_t, int64_t, int64_t>>& sideStreams);
  ~StreamProgram();
  StreamProgram(const StreamProgram&) = delete;
  StreamProgram& operator=(const StreamProgram&) = delete;

  // Queues the call on the current stream of `roles[0]`'s device and the
  // side streams; `roles` as recorded (same shapes, strides and dtypes).
  void run(const std::vector<at::Tensor>& roles) const;

  // The CUDA graphs Python captured of this program (replay.py), by the
  // roles' addresses they were captured at: one launch instead of the steps.
  // `graph` is the torch.cuda.CUDAGraph, kept until dropGraph (or this
  // program) lets it go; `graphExec` its raw_cuda_graph_exec(). Under the GIL.
  void addGraph(const std::vector<uintptr_t>& addresses, uintptr_t graphExec, py::object graph);
  void dropGraph(const std::vector<uintptr_t>& addresses);
  // Launches the graph captured at `roles`' addresses on the current stream
  // of roles[0]'s device; false, queueing nothing, where there is none.
  bool runGraph(const std::vector<at::Tensor>& roles) const;

 private:
  enum Kind : int { Copy, Zero, Write, After, Matmul, Launch };
  // An address: roles[role]'s plus `value` bytes, or (role -1) `value` itself.
  struct Address {
    int role = -1;
    uint64_t value = 0;
  };
  // A matmul operand: a view of roles[role] (element `offset` from its
  // first, `sizes`, `strides`), or (role -1) the recorded tensor itself.
  struct View {
    int role = -1;
    at::Tensor fixed;
    int64_t offset = 0;
    std::vector<int64_t> sizes, strides;
  };
  struct Step {
    Kind kind;
    int stream = 0; // 0 the caller's, i > 0 side stream i
    Address dst, src;
    uint64_t count = 0; // bytes to copy, int64s to zero, the value to write
    View out, a, b;
    int launch = -1;
    int waited = 0; // After: the stream that `stream` waits for
  };

  static Address address(const py::handle& item);
  static View view(const py::handle& item);
  uintptr_t resolve(const Address& address, const std::vector<uintptr_t>& roles) const;
  at::Tensor resolve(const View& view, const std::vector<at::Tensor>& roles) const;

  std::vector<Step> steps_;
  std::vector<LaunchPlan> launches_;
  std::vector<c10::Stream> sides_;
  std::vector<void*> events_; // one per stream: the caller's, then the side streams'
  std::map<std::vector<uintptr_t>, std::pair<void*, py::object>> graphs_;
};

} // namespace tdist
