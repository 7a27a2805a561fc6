// ProcessGroupTDist's machinery, apart from its entry points
// (collective_ops.cpp) and argument checks (validation.cpp): construction,
// abort and the watchdog's overrun handler, the group's stream order
// (startWork, finishWork, waitForLastCall, becomeLastCall), routing between
// tdist and the fallback backend, execution through the Python executor and
// launch-plan replay, and stats.
#include "process_group_tdist.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <set>
#include <thread>
#include <tuple>

#include <c10/core/DeviceType.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <c10/util/StringUtil.h>

#include "execution.hpp"
#include "validation.hpp"

namespace tdist {

using c10d::ReduceOp;

namespace {

constexpr const char* kOpNames[kNumOps] = {
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "barrier",
    "scatter",
    "gather",
    "reduce",
    "send",
    "recv",
};

// The calls torch_tdist.ops queues from Python (ProcessGroupTDist::watchQueued).
constexpr const char* kQueuedOps[] = {"all_gather_matmul", "matmul_reduce_scatter"};

// The profiler keeps the title pointer, so these must be static strings.
constexpr const char* kProfilingTitles[kNumOps] = {
    "tdist:all_gather_into_tensor",
    "tdist:all_gather",
    "tdist:reduce_scatter_tensor",
    "tdist:reduce_scatter",
    "tdist:all_reduce",
    "tdist:all_to_all_single",
    "tdist:all_to_all",
    "tdist:broadcast",
    "tdist:barrier",
    "tdist:scatter",
    "tdist:gather",
    "tdist:reduce",
    "tdist:send",
    "tdist:recv",
};

bool isMovableDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kHalf:
    case at::kBFloat16:
    case at::kDouble:
    case at::kInt:
    case at::kLong:
    case at::kChar:
    case at::kByte:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

bool isReducibleDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kHalf:
    case at::kBFloat16:
    case at::kDouble:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

const char* reduceOpName(ReduceOp::RedOpType op) {
  switch (op) {
    case ReduceOp::SUM:
      return "ReduceOp.SUM";
    case ReduceOp::AVG:
      return "ReduceOp.AVG";
    case ReduceOp::PRODUCT:
      return "ReduceOp.PRODUCT";
    case ReduceOp::MIN:
      return "ReduceOp.MIN";
    case ReduceOp::MAX:
      return "ReduceOp.MAX";
    case ReduceOp::BAND:
      return "ReduceOp.BAND";
    case ReduceOp::BOR:
      return "ReduceOp.BOR";
    case ReduceOp::BXOR:
      return "ReduceOp.BXOR";
    case ReduceOp::PREMUL_SUM:
      return "ReduceOp.PREMUL_SUM";
    default:
      return "ReduceOp.UNUSED";
  }
}

bool pythonIsFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

} // namespace

const char* executorOpName(ReduceOp::RedOpType op) {
  switch (op) {
    case ReduceOp::SUM:
      return "sum";
    case ReduceOp::AVG:
      return "avg";
    case ReduceOp::MAX:
      return "max";
    case ReduceOp::MIN:
      return "min";
    case ReduceOp::PRODUCT:
      return "product";
    default:
      TORCH_INTERNAL_ASSERT(false, "tdist: reduce op not served");
  }
}

[[noreturn]] void throwPythonError(Op op, py::error_already_set& e) {
  std::string msg = py::str(e.value());
  std::string pre = prefix(op);
  if (msg.rfind(pre, 0) != 0) {
    msg = pre + msg;
  }
  if (e.matches(PyExc_ValueError)) {
    C10_THROW_ERROR(ValueError, msg);
  }
  if (e.matches(PyExc_TypeError)) {
    C10_THROW_ERROR(TypeError, msg);
  }
  if (e.matches(PyExc_NotImplementedError)) {
    C10_THROW_ERROR(NotImplementedError, msg);
  }
  if (e.matches(PyExc_TimeoutError)) {
    // torch's backends' words ("Timed out"), which the message already says: elastic agents
    // and users' retry code match DistBackendError and them
    C10_THROW_ERROR(DistBackendError, msg);
  }
  std::string typeName = py::str(e.type().attr("__name__"));
  std::string trace;
  try {
    py::object lines = py::module_::import("traceback")
                           .attr("format_exception")(
                               e.type(), e.value(), e.trace());
    trace = py::str("").attr("join")(lines).cast<std::string>();
  } catch (py::error_already_set&) {
    trace = "(no traceback)";
  }
  C10_THROW_ERROR(
      DistBackendError,
      c10::str(
          pre,
          "the executor raised ",
          typeName,
          ": ",
          py::str(e.value()).cast<std::string>(),
          "\nexecutor traceback:\n",
          trace));
}

const char* opName(Op op) {
  return kOpNames[static_cast<int>(op)];
}

// ------------------------------------------------------------ GilSafeObject

GilSafeObject::~GilSafeObject() {
  // At interpreter exit the object is leaked: taking the GIL then can hang.
  if (obj_ == nullptr || !Py_IsInitialized() || pythonIsFinalizing()) {
    return;
  }
  py::gil_scoped_acquire gil;
  Py_DECREF(obj_);
}

// -------------------------------------------------------- ProcessGroupTDist

ProcessGroupTDist::ProcessGroupTDist(
    c10::intrusive_ptr<c10d::Store> store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    py::object executor,
    std::unordered_map<std::string, c10::intrusive_ptr<c10d::Backend>>
        fallbacks,
    const std::vector<std::string>& servedDevices,
    const std::vector<std::string>& devices)
    : Backend(rank, size),
      store_(std::move(store)),
      timeout_(timeout),
      executor_(std::move(executor)) {
  gpuMaxBytes_.fill(-1);
  gpuServedFrom_.fill(-1);
  for (const auto& name : devices) {
    devices_.push_back(c10::Device(name).type());
  }
  for (const auto& name : servedDevices) {
    auto type = c10::Device(name).type();
    TORCH_CHECK_VALUE(
        std::find(devices_.begin(), devices_.end(), type) != devices_.end(),
        "tdist: served device ",
        name,
        " is not one of the group's devices");
    served_.insert(type);
  }
  for (auto& [name, backend] : fallbacks) {
    TORCH_CHECK_VALUE(backend, "tdist: fallback for ", name, " is None");
    fallbacks_[c10::Device(name).type()] = backend;
  }
  // The abort word lives in the executor (which this backend keeps alive), where its waits
  // read it; an executor without one (a test's) gets one of ours.
  py::object ex = executor_.get();
  if (py::hasattr(ex, "abort_word_address")) {
    abortWord_ = reinterpret_cast<int64_t*>(
        ex.attr("abort_word_address").cast<uintptr_t>());
  } else {
    ownAbortWord_ = std::make_unique<int64_t>(0);
    abortWord_ = ownAbortWord_.get();
  }
  if (py::hasattr(ex, "tear_down_on_timeout")) {
    tearDownOnTimeout_ = ex.attr("tear_down_on_timeout").cast<bool>();
  }
  if (py::hasattr(ex, "abort_page_layout")) {
    auto [regions, maxRegions, stuck, records] =
        ex.attr("abort_page_layout").cast<std::tuple<int, int, int, int>>();
    abortPage_ = {regions, maxRegions, stuck, records};
  }
  init();
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupTDist::
    getBackendOptions() {
  return c10::make_intrusive<Options>(getBackendName(), timeout_);
}

ProcessGroupTDist::~ProcessGroupTDist() {
  if (watchdog_ && Py_IsInitialized() && !pythonIsFinalizing() && PyGILState_Check()) {
    py::gil_scoped_release noGil;
    watchdog_.reset();
  }
}

void ProcessGroupTDist::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  for (auto& entry : fallbacks_) {
    entry.second->setTimeout(timeout);
  }
}

void ProcessGroupTDist::abort() {
  const std::string reason = "abort() was called";
  bool failedHere = watchdog().failAll([&] {
    abortWith(reason);
    return c10::str("tdist: group '", getGroupUid(), "' was aborted (", reason, ") before this call finished");
  });
  if (!failedHere) { // the watchdog was aborting the group already
    abortWith(reason);
  }
  for (auto& entry : fallbacks_) {
    entry.second->abort();
  }
}

void ProcessGroupTDist::abortWith(const std::string& reason, bool final) {
  {
    std::lock_guard<std::mutex> lock(abortMutex_);
    if (!aborted_.load()) {
      abortReason_ = reason;
      abortReasonFinal_ = final;
      aborted_.store(true, std::memory_order_release);
    }
  }
  // kernels and host-side waits poll this word
  __atomic_store_n(abortWord_, int64_t{1}, __ATOMIC_RELEASE);
}

void ProcessGroupTDist::setGroupUid(const std::string& name) {
  c10d::Backend::setGroupUid(name);
  py::gil_scoped_acquire gil;
  executor_.get().attr("group_name") = name;
}

std::string ProcessGroupTDist::abortOverrun(
    const char* op,
    std::chrono::milliseconds timeout) {
  std::string head = c10::str(
      "tdist ", op, ": Timed out after ", timeout.count() / 1000.0, " s (rank ", rank_, " of ",
      size_, ", group '", getGroupUid(), "'): the call did not finish within the group's timeout");
  if (tearDownOnTimeout_) {
    // NCCL's default too. The call returned before its kernels ran, and the caller's later work
    // waits for them on the stream; aborting the group would let its kernels give up and that
    // work use outputs that are not valid (the late peers' names cost that: they are known only
    // once the kernels give up), so the process ends while they still wait.
    LOG(ERROR) << head << ": a peer died, made another call or is late; taking this process down "
               << "before its later GPU work can use this call's outputs (TDIST_ASYNC_ERROR_HANDLING=0 "
               << "keeps it: the group is aborted and its calls raise, naming the late ranks)";
    std::cerr.flush();
    std::abort();
  }
  abortWith(head, /*final=*/false);
  std::vector<int> late = latePeers();
  std::string reason = head;
  if (late.empty()) {
    reason += ": a peer died or made another call; the group was aborted";
  } else {
    reason += ": rank(s) " + c10::Join(", ", late) +
        " did not arrive (died, or made another call); the group was aborted";
  }
  {
    std::lock_guard<std::mutex> lock(abortMutex_);
    if (abortReasonFinal_) { // abort() came first: its reason stands
      return abortReason_;
    }
    abortReason_ = reason;
    abortReasonFinal_ = true;
  }
  abortReasonFinished_.notify_all();
  // Said at once, as NCCL's watchdog does: the calls that had not finished stopped waiting and
  // ended with what they had; a caller hears of it only from their Work objects, or from this
  // group's next call, which raises.
  LOG(ERROR) << reason << "; the outputs of the calls that had not finished are not valid";
  for (auto& entry : fallbacks_) { // (the overrun call may be theirs: handOver)
    entry.second->abort();
  }
  return reason;
}

std::vector<int> ProcessGroupTDist::latePeers() const {
  if (abortPage_.records == 0) {
    return {};
  }
  // Waits read the abort word every ABORT_POLLS polls, so a stuck program
  // records within microseconds; a moment more lets the others record.
  const int64_t* page = abortWord_;
  std::set<int64_t> slots;
  for (int step = 0, seenAt = -1; step < 100 && (seenAt < 0 || step <= seenAt + 1); ++step) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    for (int i = 0; i < abortPage_.records; ++i) {
      int64_t slot = __atomic_load_n(page + abortPage_.stuck + i, __ATOMIC_ACQUIRE);
      if (slot != 0) {
        slots.insert(slot);
        seenAt = seenAt < 0 ? step : seenAt;
      }
    }
  }
  std::set<int> late; // the owners of the slots waited on
  for (int64_t slot : slots) {
    for (int r = 0; r < abortPage_.maxRegions; ++r) {
      const int64_t* region = page + abortPage_.regions + 3 * r;
      int64_t first = region[0], stride = region[1], peers = region[2];
      if (first == 0) {
        break;
      }
      if (slot >= first && (slot - first) % 8 == 0 && (slot - first) / 8 < stride * peers) {
        late.insert(static_cast<int>((slot - first) / 8 / stride));
        break;
      }
    }
  }
  return {late.begin(), late.end()};
}

void ProcessGroupTDist::checkNotAborted(const char* op) const {
  if (!aborted_.load(std::memory_order_acquire)) {
    return;
  }
  std::unique_lock<std::mutex> lock(abortMutex_);
  // (a peer's late arrival being worked out: at most a second)
  abortReasonFinished_.wait(lock, [this] { return abortReasonFinal_; });
  C10_THROW_ERROR(
      DistBackendError,
      c10::str("tdist ", op, ": this group was aborted (", abortReason_,
               "); destroy it and create a new one"));
}

void ProcessGroupTDist::checkOpen(const std::string& op) const {
  checkNotAborted(op.c_str());
}

// ------------------ queued calls, the group's last call, watchdog, shutdown

void ProcessGroupTDist::watchQueued(const std::string& op, c10::DeviceIndex device) {
  const char* name = nullptr;
  for (const char* queued : kQueuedOps) {
    name = op == queued ? queued : name; // (the watchdog keeps the pointer)
  }
  TORCH_CHECK_VALUE(name, "tdist: watch_queued: no queued op named '", op, "'");
  auto stream = currentStream(c10::Device(c10::kCUDA, device));
  auto work = c10::make_intrusive<TDistWork>(
      rank_,
      OpType::UNKNOWN,
      nullptr,
      std::vector<at::Tensor>{},
      std::vector<at::Tensor>{},
      /*asyncOp=*/false);
  work->startOnStream(stream, events_, false, captureId(stream));
  try {
    work->markDone(); // (its end recorded on `stream`)
  } catch (const std::exception&) {
    if (work->capture() == 0) {
      throw;
    }
    return; // an invalidated capture (the op's own error, which Python is raising): nothing to order
  }
  becomeLastCall(*work);
  if (work->watchable()) {
    watch(work, name);
  }
}

void ProcessGroupTDist::orderQueued(c10::DeviceIndex device) {
  auto stream = currentStream(c10::Device(c10::kCUDA, device));
  waitForLastCall(stream, captureId(stream));
}

void ProcessGroupTDist::waitForLastCall(c10::Stream stream, uint64_t capture) {
  auto& last = capture != 0 ? lastCaptured_ : lastEager_;
  if (!last.stream || last.capture != capture || *last.stream == stream) {
    return;
  }
  if (!last.end) { // (a synchronous fallback call in a capture: its end, and what followed it there)
    last.end = events_->record(*last.stream);
  }
  last.end->block(stream);
}

void ProcessGroupTDist::becomeLastCall(c10::Stream stream, uint64_t capture) {
  if (capture != 0) {
    lastCaptured_ = {stream, nullptr, capture};
  } else {
    lastEager_ = {stream, events_->record(stream), 0};
  }
}

void ProcessGroupTDist::becomeLastCall(const TDistWork& work) {
  if (work.end() && work.capture() != 0) {
    lastCaptured_ = {work.stream(), work.end(), work.capture()};
  }
  if (work.watchable()) {
    lastEager_ = {work.stream(), work.end(), 0};
  }
}

Watchdog& ProcessGroupTDist::watchdog() {
  std::call_once(watchdogStarted_, [this] {
    watchdog_ = std::make_unique<Watchdog>(
        [this](const char* name, std::chrono::milliseconds timeout) {
          return abortOverrun(name, timeout);
        });
  });
  return *watchdog_;
}

void ProcessGroupTDist::watch(const c10::intrusive_ptr<TDistWork>& work, const char* op) {
  watchdog().watch(work, timeout_, op);
}

void ProcessGroupTDist::shutdown() {
  if (shutDown_.exchange(true)) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(plansMutex_);
    plans_.clear(); // they point into the heap the executor frees
  }
  if (Py_IsInitialized() && !pythonIsFinalizing()) {
    py::gil_scoped_acquire gil;
    fusedPlans_.clear(); // (their programs point into the heap too; their objects need the GIL)
    py::object ex = executor_.get();
    try {
      if (py::hasattr(ex, "close")) {
        ex.attr("close")();
      }
    } catch (py::error_already_set& e) {
      C10_THROW_ERROR(
          DistBackendError,
          std::string("tdist shutdown: ") + py::str(e.value()).cast<std::string>());
    }
  }
  for (auto& entry : fallbacks_) {
    entry.second->shutdown();
  }
}

// ------------------------------------------------------------------ routing

ProcessGroupTDist::Route ProcessGroupTDist::routeMovement(
    const at::Tensor& t) const {
  bool served = served_.count(t.device().type()) > 0 &&
      t.layout() == at::kStrided && isMovableDtype(t.scalar_type());
  return served ? Route::Tdist : Route::Fallback;
}

ProcessGroupTDist::Route ProcessGroupTDist::routeReduction(
    Op op,
    const at::Tensor& t,
    const ReduceOp& rop) const {
  auto dtype = t.scalar_type();
  switch (rop.op_) {
    case ReduceOp::PREMUL_SUM:
      TORCH_CHECK_VALUE(
          false, prefix(op), "ReduceOp.PREMUL_SUM is not supported");
    case ReduceOp::BAND:
    case ReduceOp::BOR:
    case ReduceOp::BXOR:
      TORCH_CHECK_VALUE(
          !at::isFloatingType(dtype) && !at::isComplexType(dtype),
          prefix(op),
          reduceOpName(rop.op_),
          " needs an integer or bool tensor, got ",
          dtypeName(dtype));
      return Route::Fallback;
    case ReduceOp::AVG:
      TORCH_CHECK_VALUE(
          !at::isIntegralType(dtype, /*includeBool=*/true),
          prefix(op),
          "ReduceOp.AVG needs a floating-point tensor, got ",
          dtypeName(dtype));
      break;
    case ReduceOp::SUM:
    case ReduceOp::MAX:
    case ReduceOp::MIN:
    case ReduceOp::PRODUCT:
      break;
    default:
      TORCH_CHECK_VALUE(
          false, prefix(op), "unknown reduce op ", static_cast<int>(rop.op_));
  }
  bool served = served_.count(t.device().type()) > 0 &&
      t.layout() == at::kStrided && isReducibleDtype(dtype);
  return served ? Route::Tdist : Route::Fallback;
}

ProcessGroupTDist::Route ProcessGroupTDist::limitBySize(
    Op op,
    Route route,
    const at::Tensor& t,
    bool sameSizeOnEveryRank) const {
  if (route == Route::Fallback || t.is_cpu()) {
    return route;
  }
  int64_t bytes = static_cast<int64_t>(t.nbytes());
  if (!sameSizeOnEveryRank) { // no size test agrees across ranks
    return gpuUnevenAllToAll_ ? route : Route::Fallback;
  }
  int64_t limit = gpuMaxBytes_[static_cast<int>(op)];
  int64_t servedFrom = gpuServedFrom_[static_cast<int>(op)];
  bool between = limit >= 0 && bytes > limit &&
      (servedFrom < 0 || bytes < servedFrom);
  return between ? Route::Fallback : route;
}

bool ProcessGroupTDist::strided(const std::vector<at::Tensor>& ts) {
  return std::all_of(
      ts.begin(), ts.end(), [](const at::Tensor& t) { return strided(t); });
}

void ProcessGroupTDist::rejectCall(
    Op op,
    const at::Tensor& call,
    int64_t root,
    const char* reason) {
  if (!communicate_) {
    return; // (the peers' calls return at once: nobody waits for a stand-in)
  }
  if (!call.defined() || call.layout() != at::kStrided ||
      (call.is_cuda() && call.device().index() != gpuIndex_) ||
      routeMovement(call) == Route::Fallback) {
    return; // (a tensor on another GPU was what was rejected; or the peers' call is the fallback's)
  }
  py::gil_scoped_acquire gil;
  try {
    executor_.get().attr("reject")(opName(op), call, root, std::string(reason));
  } catch (py::error_already_set& e) {
    // (the group stopped, say): this rank raises its own error all the same
    LOG(WARNING) << prefix(op) << "the peers were not told of this rank's rejected call: "
                 << e.what();
  }
}

void ProcessGroupTDist::setGpuSizeLimit(
    const std::string& name,
    int64_t maxBytes,
    int64_t servedFrom) {
  for (int i = 0; i < kNumOps; ++i) {
    if (name == kOpNames[i]) {
      gpuMaxBytes_[i] = maxBytes;
      gpuServedFrom_[i] = servedFrom;
      return;
    }
  }
  TORCH_CHECK_VALUE(false, "tdist: no collective named ", name);
}

void ProcessGroupTDist::setGpuUnevenAllToAll(bool served) {
  gpuUnevenAllToAll_ = served;
}

c10d::Backend& ProcessGroupTDist::fallbackFor(Op op, c10::DeviceType type)
    const {
  checkNotAborted(opName(op));
  auto it = fallbacks_.find(type);
  TORCH_CHECK(
      it != fallbacks_.end(),
      prefix(op),
      "tdist does not serve this call and the group has no fallback backend "
      "for ",
      deviceTypeName(type),
      " tensors");
  return *it->second;
}

c10d::Backend& ProcessGroupTDist::fallbackForBarrier(
    const c10d::BarrierOptions& opts) const {
  if (opts.device.has_value()) {
    return fallbackFor(Op::Barrier, opts.device->type());
  }
  if (fallbacks_.count(c10::kCPU) > 0) {
    return fallbackFor(Op::Barrier, c10::kCPU);
  }
  TORCH_CHECK(!fallbacks_.empty(), "tdist barrier: no backend can serve it");
  return *fallbacks_.begin()->second;
}

void ProcessGroupTDist::count(Op op, Route route, size_t n) {
  auto& counters = route == Route::Tdist ? tdistCount_ : fallbackCount_;
  counters[static_cast<int>(op)].fetch_add(n, std::memory_order_relaxed);
}

// ---------------------------------------------------------------- execution

void ProcessGroupTDist::executeUneven(
    const at::Tensor& input,
    const at::Tensor& output,
    const std::vector<int64_t>& inSplits,
    const std::vector<int64_t>& outSplits) {
  constexpr Op op = Op::AllToAllSingle;
  if (!communicate_) {
    return;
  }
  // send offsets | send counts | recv offsets | recv counts, as the executor's _exchange
  std::vector<int64_t> table(4 * size_);
  int64_t rowIn = rowNumel(input), rowOut = rowNumel(output), most = 0;
  for (int part = 0; part < 2; ++part) {
    const auto& splits = part == 0 ? inSplits : outSplits;
    int64_t row = part == 0 ? rowIn : rowOut, offset = 0;
    for (int r = 0; r < size_; ++r) {
      table[(2 * part) * size_ + r] = offset;
      table[(2 * part + 1) * size_ + r] = splits[r] * row;
      offset += splits[r] * row;
      most = std::max(most, splits[r] * row);
    }
  }
  // the kernel's accesses are 16 bytes wide where every offset and count allows (Python: ALIGN)
  int64_t vector = std::max<int64_t>(1, 16 / input.element_size());
  bool aligned = std::all_of(
      table.begin(), table.end(), [&](int64_t v) { return v % vector == 0; });
  PlanKey key{
      static_cast<int>(op),
      static_cast<int>(input.scalar_type()),
      -1,
      -1,
      aligned ? 1 : 0,
      -2, // split sizes given
      static_cast<int>(input.device().index())};
  bool gpu = !input.is_cpu();
  if (gpu && LaunchPlan::fits(input) && LaunchPlan::fits(output)) {
    c10::impl::VirtualGuardImpl impl(input.device().type());
    c10::Stream stream = impl.getStream(input.device());
    std::lock_guard<std::mutex> lock(plansMutex_);
    auto it = plans_.find(key);
    // (a capture may not copy from pageable memory, and a share too large for the mailboxes
    // gets the executor's error)
    if (it != plans_.end() && captureId(stream) == 0 &&
        most <= unevenShareLimit_) {
      if (!unevenTable_.defined() || unevenTable_.device() != input.device()) {
        unevenTable_ = at::empty(
            {4 * size_}, at::TensorOptions().dtype(at::kLong).device(input.device()));
      }
      void* native = stream.native_handle();
      copyHostToDevice(
          unevenTable_.data_ptr(), table.data(), table.size() * sizeof(int64_t), native);
      it->second.launch(
          {reinterpret_cast<uintptr_t>(input.data_ptr()),
           reinterpret_cast<uintptr_t>(output.data_ptr()),
           reinterpret_cast<uintptr_t>(unevenTable_.data_ptr())},
          native);
      return;
    }
  }
  auto plan = execute(op, "all_to_all_single", output, input, outSplits, inSplits);
  if (plan && gpu) {
    int64_t limit = 0;
    {
      py::gil_scoped_acquire gil;
      limit = executor_.get().attr("uneven_share_limit")(input).cast<int64_t>();
    }
    std::lock_guard<std::mutex> lock(plansMutex_);
    unevenShareLimit_ = limit;
    plans_.emplace(key, std::move(*plan));
  }
}

PlanKey ProcessGroupTDist::planKey(
    Op op,
    const at::Tensor& input,
    const at::Tensor& output,
    int reduceOp,
    int64_t root) const {
  return PlanKey{
      static_cast<int>(op),
      static_cast<int>(input.scalar_type()),
      input.numel(),
      output.numel(),
      reduceOp,
      root,
      static_cast<int>(input.device().index())};
}

// ---------------------------------------------------- stream order and Work

c10::Stream ProcessGroupTDist::commStream(const c10::Device& device) {
  if (!commStream_ || commStream_->device() != device) {
    commStream_ = newCommStream(device);
  }
  return *commStream_;
}

c10::intrusive_ptr<TDistWork> ProcessGroupTDist::startWork(
    Op op,
    OpType type,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    bool asyncOp,
    std::optional<c10::Device> device) {
  checkNotAborted(opName(op));
  auto work = c10::make_intrusive<TDistWork>(
      rank_,
      type,
      kProfilingTitles[static_cast<int>(op)],
      inputs,
      outputs,
      asyncOp);
  if (!device) {
    for (const auto* list : {&outputs, &inputs}) {
      if (!list->empty()) {
        device = list->front().device();
        break;
      }
    }
  }
  if (device && device->type() != c10::kCPU) {
    // NCCL's choice: a call the caller waits for at once runs on the caller's
    // stream (no event hand-over between streams, and in a CUDA graph one
    // kernel node after the other, which programmatic dependent launch
    // needs), an async one on the group's.
    auto caller = currentStream(*device);
    uint64_t capture = captureId(caller);
    auto comm = commStream(*device);
    auto stream = asyncOp ? comm : caller;
    // (an async call after one on the caller's stream already waits for it)
    if (!(stream == comm && lastCall(capture).stream == caller)) {
      waitForLastCall(stream, capture);
    }
    work->startOnStream(stream, events_, op == Op::Barrier, capture);
  }
  return work;
}

WorkPtr ProcessGroupTDist::finishWork(
    c10::intrusive_ptr<TDistWork> work,
    Op op,
    size_t n,
    Route route) {
  count(op, route, n);
  work->setSequenceNumber(++seq_);
  work->markDone();
  becomeLastCall(*work);
  if (work->watchable()) { // (also what an async call keeps alive: see TDistWork)
    watch(work, opName(op));
  }
  // As NCCL's since torch 2.8: a call the caller waits for at once returns no
  // Work, and torch.distributed skips its wait() (a call from Python that
  // would only check the stream: the call ran on the caller's). A barrier's
  // wait() holds the host, so it keeps its Work.
  if (!work->asyncOp() && op != Op::Barrier) {
    return nullptr;
  }
  return work;
}

// --------------------------------------------------------------- inspection

py::dict ProcessGroupTDist::stats() const {
  py::dict out;
  for (int i = 0; i < kNumOps; ++i) {
    py::dict entry;
    entry["tdist"] = tdistCount_[i].load();
    entry["fallback"] = fallbackCount_[i].load();
    out[kOpNames[i]] = entry;
  }
  return out;
}

void ProcessGroupTDist::resetStats() {
  for (int i = 0; i < kNumOps; ++i) {
    tdistCount_[i].store(0);
    fallbackCount_[i].store(0);
  }
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupTDist::fallbackBackend(
    const std::string& device) const {
  auto it = fallbacks_.find(c10::Device(device).type());
  return it == fallbacks_.end() ? nullptr : it->second;
}

std::vector<std::string> ProcessGroupTDist::servedDevices() const {
  std::vector<std::string> out;
  for (auto d : devices_) {
    if (served_.count(d) > 0) {
      out.push_back(deviceTypeName(d));
    }
  }
  return out;
}

std::vector<std::string> ProcessGroupTDist::devices() const {
  std::vector<std::string> out;
  for (auto d : devices_) {
    out.push_back(deviceTypeName(d));
  }
  return out;
}

} // namespace tdist
