// ProcessGroupTDist: the c10d backend registered as "tdist".
//
// C++ validates every call, decides whether tdist serves it or the inner
// fallback backend (Gloo on CPU, NCCL on CUDA) does, and hands served calls
// to a Python executor object (torch_tdist.collectives) that launches the
// Triton kernels, or replays a launch plan the executor recorded. CPU calls
// complete before they return; GPU calls run on the group's stream (async_op)
// or the caller's, and their Work's wait() orders the caller's stream after
// them (device_path.hpp).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/pybind.h>

#include "device_path.hpp"
#include "watchdog.hpp"
#include "work.hpp"

namespace tdist {

namespace py = pybind11;

// Ops as torch.distributed names them; also the keys of stats().
enum class Op : int {
  AllGatherIntoTensor,
  AllGather,
  ReduceScatterTensor,
  ReduceScatter,
  AllReduce,
  AllToAllSingle,
  AllToAll,
  Broadcast,
  Barrier,
  Scatter,
  Gather,
  Reduce,
  Send,
  Recv,
  kCount,
};

constexpr int kNumOps = static_cast<int>(Op::kCount);

const char* opName(Op op);
// A served reduce op as the executor names it ("sum", "avg", ...).
const char* executorOpName(c10d::ReduceOp::RedOpType op);


// Owns one Python reference and drops it under the GIL; the backend can be
// destroyed from C++ code that does not hold the GIL.
class GilSafeObject {
 public:
  GilSafeObject() = default;
  explicit GilSafeObject(py::object obj) : obj_(obj.release().ptr()) {}
  GilSafeObject(const GilSafeObject&) = delete;
  GilSafeObject& operator=(const GilSafeObject&) = delete;
  ~GilSafeObject();

  // Only while holding the GIL.
  py::object get() const {
    return py::reinterpret_borrow<py::object>(obj_);
  }

 private:
  PyObject* obj_ = nullptr;
};

// The calls of torch_tdist.ops issued from C++ (ProcessGroupTDist::fusedAllGatherMatmul...),
// by op (0 all_gather_matmul, 1 matmul_reduce_scatter) and way: the sequential one, a
// recorded stream program replayed step by step or by Python, or its CUDA graph launched here.
struct FusedCounts {
  std::array<uint64_t, 2> sequential{}, program{}, graph{};
};

class ProcessGroupTDist : public c10d::Backend {
 public:
  ProcessGroupTDist(
      c10::intrusive_ptr<c10d::Store> store,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      py::object executor,
      std::unordered_map<std::string, c10::intrusive_ptr<c10d::Backend>>
          fallbacks,
      const std::vector<std::string>& servedDevices,
      const std::vector<std::string>& devices);

  // Stops the watchdog without the GIL: its thread may be freeing works
  // whose Python tensors need it.
  ~ProcessGroupTDist() override;

  const std::string getBackendName() const override {
    return "tdist";
  }
  bool supportsSplitting() const override {
    return false;
  }
  bool supportsCoalescing() const override {
    return false;
  }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override {}
  // Also tells the executor, whose errors name the group.
  void setGroupUid(const std::string& name) override;
  uint64_t getSequenceNumberForGroup() override {
    return seq_.load();
  }
  // Both forward to the fallbacks; shutdown() first calls executor.close()
  // when the executor has one. abort() also fails the works the watchdog
  // watches (their wait() raises).
  void abort() override;
  // Sets the abort word (waits give up) and makes every later call raise
  // with `reason`; one not `final` yet holds them until the watchdog
  // completes it (abortOverrun).
  void abortWith(const std::string& reason, bool final = true);
  // The watchdog's handler for a call of `op` that overran `timeout`: aborts
  // the group, names the peers that GPU waits giving up still lacked, and
  // returns the error.
  std::string abortOverrun(const char* op, std::chrono::milliseconds timeout);
  // For the calls torch_tdist.ops queues from Python (kQueuedOps): raises
  // the error later calls get once the group was aborted, and watches the
  // work queued on `device`'s current stream until now, as the group's own
  // calls are, and makes it the group's last call (not counted in stats();
  // nothing is watched in a CUDA graph capture).
  void checkOpen(const std::string& op) const;
  // Before such a call: `device`'s current stream waits for the group's last
  // call where that ran on another stream (an async collective not yet
  // waited for), so the group's work runs in one order, as NCCL's does.
  void orderQueued(c10::DeviceIndex device);
  void watchQueued(const std::string& op, c10::DeviceIndex device);
  uintptr_t abortWordAddress() const {
    return reinterpret_cast<uintptr_t>(abortWord_);
  }
  void shutdown() override;

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dstRank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int srcRank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override;

  // {op name: {"tdist": n, "fallback": m}}; needs the GIL.
  py::dict stats() const;

  // torch_tdist.ops' calls issued from C++ (fused_calls.cpp). After the first
  // call of a signature (the tensors' dtype, device, shapes, strides and
  // alignment, the op's dimension and flag) ran in Python, Python remembers
  // how it ran: the sequential way (the group's collective, then at::matmul),
  // or a recorded stream program of the pipelined way. A later call of the
  // same signature runs that way here, without Python frames; any other call
  // returns None and takes the Python path. All under the GIL.
  // `belowAutograd`: called from the custom op's kernel (inputs may require
  // grad there); otherwise such a call returns None.
  py::object fusedAllGatherMatmul(
      const at::Tensor& a,
      const std::vector<at::Tensor>& bs,
      int64_t dim,
      bool returnA,
      bool belowAutograd);
  py::object fusedMatmulReduceScatter(
      const at::Tensor& a,
      const at::Tensor& b,
      int64_t dim,
      const std::string& reduceOp,
      bool belowAutograd);
  // `program`: None for the sequential way, else the StreamProgram of the
  // pipelined way, `staging` its scratch role (matmul_reduce_scatter) and
  // `state` the group's OverlapState, whose replay_program serves a call
  // without a CUDA graph at its addresses yet. `counts`: where the calls
  // issued here are counted.
  void rememberFused(
      const std::string& op,
      const at::Tensor& a,
      const std::vector<at::Tensor>& bs,
      int64_t dim,
      int64_t flag,
      py::object program,
      std::optional<at::Tensor> staging,
      int64_t operands,
      py::object state,
      std::shared_ptr<FusedCounts> counts);

  // GPU calls of `opName` whose message is larger than `maxBytes` (-1: no
  // limit) and smaller than `servedFrom` (-1: any larger one) go to the
  // fallback (NCCL), as do all-to-alls whose ranks may send different sizes
  // unless `uneven` (the choice must agree across ranks).
  void setGpuSizeLimit(
      const std::string& opName,
      int64_t maxBytes,
      int64_t servedFrom);
  void setGpuUnevenAllToAll(bool served);
  // false: every call of the group returns at once, its work ordered and counted but nothing
  // moved (outputs untouched): the step time with free communication, for measurements only
  // (the backend option "communication").
  void setCommunication(bool on) {
    communicate_ = on;
  }
  void resetStats();

  py::object executor() const {
    return executor_.get();
  }
  // The inner backend for a device type, or None.
  c10::intrusive_ptr<c10d::Backend> fallbackBackend(
      const std::string& device) const;
  std::vector<std::string> servedDevices() const;
  std::vector<std::string> devices() const;

 private:
  enum class Route { Tdist, Fallback };

  // Validation; every failure names the op.
  void checkDevice(Op op, const at::Tensor& t, const char* what) const;
  void checkGpu(Op op, const at::Tensor& t, const char* what) const;
  void checkRoot(Op op, int64_t root, const char* what) const;
  std::vector<at::Tensor> rootList(
      Op op,
      const std::vector<std::vector<at::Tensor>>& lists,
      int64_t root,
      const char* rootName,
      const char* listName,
      const at::Tensor& ref,
      const char* refName) const;
  void checkGroupSize(
      Op op,
      size_t got,
      const char* what,
      const char* whose = nullptr) const;

  // Served-or-fallback decisions (they may also reject the call).
  Route routeMovement(const at::Tensor& t) const;
  Route routeReduction(Op op, const at::Tensor& t, const c10d::ReduceOp& rop)
      const;
  // `route`, or the fallback for a GPU call of `t`'s size that NCCL serves faster (its size is
  // read only here, after routing: a tensor that is not strided has none).
  Route limitBySize(
      Op op,
      Route route,
      const at::Tensor& t,
      bool sameSizeOnEveryRank = true) const;
  // Whether every tensor is strided. Other layouts (sparse, ...) go to the fallback before
  // any of tdist's checks, which read sizes and strides.
  static bool strided(const at::Tensor& t) {
    return t.layout() == at::kStrided;
  }
  static bool strided(const std::vector<at::Tensor>& ts);

  // Runs `checks`. Where they reject this rank's arguments of a call that tdist would serve,
  // the peers are told first (rejectCall), then the error is raised. `call`: this rank's
  // tensor that sizes the call as its peers see it, which the checks do not question (the
  // tensor every rank of a scatter or gather has: the root's list is what they check);
  // `root`: the call's root rank.
  template <typename Checks>
  void checkOrReject(Op op, const at::Tensor& call, int64_t root, const Checks& checks);
  // The executor stands in for the rejected call (Executor.reject): peers waiting for it raise
  // at once, naming this rank and `reason`, and the group serves later calls.
  void rejectCall(Op op, const at::Tensor& call, int64_t root, const char* reason);
  c10d::Backend& fallbackFor(Op op, c10::DeviceType type) const;
  c10d::Backend& fallbackForBarrier(const c10d::BarrierOptions& opts) const;

  void count(Op op, Route route, size_t n = 1);

  // Calls executor.<method>(args...) under the GIL and returns the launch
  // plan it may return; Python exceptions come back as c10 errors that keep
  // their message.
  template <typename... Args>
  std::optional<CallPlan> execute(Op op, const char* method, Args&&... args);

  // Replays the plan for `key` when there is one and the tensors fit it;
  // otherwise calls the executor, which may return a plan for next time.
  template <typename... Args>
  void executePlanned(
      const PlanKey& key,
      const at::Tensor& input,
      const at::Tensor& output,
      Op op,
      const char* method,
      Args&&... args);
  // all_to_all_single with split sizes: its kernel reads the ranks' offsets
  // and counts (elements) from a table on the device, so one plan per dtype
  // and alignment serves every split; a replay first copies the call's table
  // into unevenTable_ (stream order keeps it until the kernel has read it).
  void executeUneven(
      const at::Tensor& input,
      const at::Tensor& output,
      const std::vector<int64_t>& inSplits,
      const std::vector<int64_t>& outSplits);
  PlanKey planKey(
      Op op,
      const at::Tensor& input,
      const at::Tensor& output,
      int reduceOp = -1,
      int64_t root = -1) const;

  // `device`: where the call runs when it has no tensors (a barrier).
  c10::intrusive_ptr<TDistWork> startWork(
      Op op,
      c10d::OpType type,
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      bool asyncOp,
      std::optional<c10::Device> device = std::nullopt);
  c10::Stream commStream(const c10::Device& device);
  c10::intrusive_ptr<c10d::Work> finishWork(
      c10::intrusive_ptr<TDistWork> work,
      Op op,
      size_t n = 1,
      Route route = Route::Tdist);
  // A call that the fallback backend serves: `call(backend, opts)`. On GPUs it
  // takes its place in the group's order as the group's own calls do: a
  // synchronous one runs on the caller's stream, an async one (made
  // synchronous) on the group's stream and returns the group's Work (inputs
  // and outputs kept as for a tdist call); each after the group's last call,
  // and becomes it.
  template <typename CallOptions, typename Call>
  c10::intrusive_ptr<c10d::Work> handOver(
      Op op,
      c10d::OpType type,
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      const CallOptions& opts,
      size_t n,
      Call call);

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  GilSafeObject executor_;
  std::unordered_map<c10::DeviceType, c10::intrusive_ptr<c10d::Backend>>
      fallbacks_;
  std::unordered_set<c10::DeviceType> served_;
  std::vector<c10::DeviceType> devices_;

  std::array<int64_t, kNumOps> gpuMaxBytes_;
  std::array<int64_t, kNumOps> gpuServedFrom_;
  mutable c10::DeviceIndex gpuIndex_ = -1;  // the group's GPU; see checkGpu
  bool gpuUnevenAllToAll_ = true;
  bool communicate_ = true; // setCommunication
  bool tearDownOnTimeout_ = true; // the executor's tear_down_on_timeout, if it has one (TDIST_ASYNC_ERROR_HANDLING)
  std::optional<c10::Stream> commStream_; // the group's stream on its GPU
  // The group's last GPU call, where it ran and its end: a call on another
  // stream first waits for it. One for calls outside CUDA graph captures, one
  // for calls inside (an event recorded in a capture can be waited on only in
  // the same capture). A synchronous call handed to the fallback backend
  // inside a capture records no end (in CUDA graphs its node between two NCCL
  // kernels cost about 2 us a call): `end` stays null until a call from
  // another stream needs it, which records it on `stream` then (after the
  // call and whatever followed it there).
  struct LastCall {
    std::optional<c10::Stream> stream;
    std::shared_ptr<c10::Event> end;
    uint64_t capture = 0;
  };
  LastCall lastEager_;
  LastCall lastCaptured_;
  // The group's last GPU call in `capture` (0: outside CUDA graph captures).
  const LastCall& lastCall(uint64_t capture) const {
    return capture != 0 ? lastCaptured_ : lastEager_;
  }
  // `stream` waits for the group's last call where that ran on another stream
  // (in the same capture).
  void waitForLastCall(c10::Stream stream, uint64_t capture);
  // Makes `work` (done, see TDistWork::markDone) the group's last call.
  void becomeLastCall(const TDistWork& work);
  // Makes the synchronous fallback call just queued on `stream` the last call.
  void becomeLastCall(c10::Stream stream, uint64_t capture);
  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();
  std::unordered_map<PlanKey, CallPlan, PlanKeyHash> plans_;
  std::mutex plansMutex_;
  at::Tensor unevenTable_; // the replayed uneven all-to-all's table
  int64_t unevenShareLimit_ = 0; // the most elements it may send a rank (known with a plan)

  // fused_calls.cpp
  struct FusedPlan {
    std::shared_ptr<GilSafeObject> program, state; // program null: the sequential way
    at::Tensor staging;
    // the B matrices the program multiplies by: all_gather_matmul's Bs one by one (their
    // number) or side by side (1) (custom_ops.PER_B_MIN_COLUMNS)
    int64_t operands = 1;
    std::shared_ptr<FusedCounts> counts;
  };
  std::vector<int64_t> fusedKey(
      int op,
      const at::Tensor& a,
      const std::vector<at::Tensor>& bs,
      int64_t dim,
      int64_t flag) const;
  std::optional<FusedPlan> fusedPlan(
      int op,
      const at::Tensor& a,
      const std::vector<at::Tensor>& bs,
      int64_t dim,
      int64_t flag,
      bool belowAutograd) const;
  // Starts a fused call on `a`: raises where it may not run (the group aborted, or stopped:
  // Executor._begin's check), then orders it after the group's last call (custom_ops._ordered).
  void startFused(const char* op, const at::Tensor& a);
  // Runs `plan`'s stream program on `roles`: its CUDA graph where one was
  // captured at their addresses, else ProgramReplay.run_program.
  void runProgram(int op, const FusedPlan& plan, const std::vector<at::Tensor>& roles);
  std::map<std::vector<int64_t>, FusedPlan> fusedPlans_;

  std::array<std::atomic<uint64_t>, kNumOps> tdistCount_{};
  std::array<std::atomic<uint64_t>, kNumOps> fallbackCount_{};
  std::atomic<uint64_t> seq_{0};
  std::atomic<bool> shutDown_{false};
  int64_t* abortWord_ = nullptr; // the executor's (alive while executor_ is) or ownAbortWord_
  std::unique_ptr<int64_t> ownAbortWord_;
  // Where in the abort word's page (in words) the executor lists its signal
  // regions and GPU waits stuck at the abort leave the slots they waited on
  // (language.PAGE_REGIONS); no records when the executor has no such page.
  struct AbortPage {
    int regions = 0, maxRegions = 0, stuck = 0, records = 0;
  } abortPage_;
  // The peers whose slots GPU waits stuck at the abort waited on.
  std::vector<int> latePeers() const;
  std::atomic<bool> aborted_{false};
  std::string abortReason_; // set before aborted_ (the watchdog adds to it)
  bool abortReasonFinal_ = false;
  mutable std::mutex abortMutex_;
  mutable std::condition_variable abortReasonFinished_;
  void checkNotAborted(const char* op) const;
  // Started by the first call that needs it.
  Watchdog& watchdog();
  void watch(const c10::intrusive_ptr<TDistWork>& work, const char* op);
  // last: destroyed (its thread stopped) before what its handler touches
  std::once_flag watchdogStarted_;
  std::unique_ptr<Watchdog> watchdog_;
};

} // namespace tdist
