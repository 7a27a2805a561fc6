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

namespace tdist {

using c10d::OpType;
using c10d::ReduceOp;
using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

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

std::string dtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

std::string dtypeName(const at::Tensor& t) {
  return dtypeName(t.scalar_type());
}

std::string deviceTypeName(c10::DeviceType type) {
  return c10::DeviceTypeName(type, /*lower_case=*/true);
}

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

// The strings the executor receives.
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

std::string prefix(Op op) {
  return std::string("tdist ") + opName(op) + ": ";
}

bool pythonIsFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Called with the GIL held. ValueError/TypeError/NotImplementedError keep
// their Python type; anything else becomes a DistBackendError that carries
// the Python traceback.
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

void checkSingle(Op op, const std::vector<at::Tensor>& ts, const char* what) {
  TORCH_CHECK_VALUE(
      ts.size() == 1,
      prefix(op),
      "expected exactly one ",
      what,
      " tensor, got ",
      ts.size(),
      " (one tensor per process)");
}

// A tensor's name in messages ("scatter_list[3]"), formatted only when a check fails:
// validation runs on every call and must not build strings.
struct Name {
  Name(const char* base, int64_t i = -1, int64_t j = -1) : base(base), i(i), j(j) {}
  const char* base;
  int64_t i, j;
};

std::ostream& operator<<(std::ostream& os, const Name& name) {
  os << name.base;
  if (name.i >= 0) {
    os << "[" << name.i << "]";
  }
  if (name.j >= 0) {
    os << "[" << name.j << "]";
  }
  return os;
}

void checkSameDtype(
    Op op,
    const at::Tensor& ref,
    const char* refName,
    const at::Tensor& t,
    const Name& name) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == ref.scalar_type(),
      prefix(op),
      name,
      " has dtype ",
      dtypeName(t),
      " but ",
      refName,
      " has dtype ",
      dtypeName(ref),
      "; they must match");
}

void checkSameDevice(
    Op op,
    const at::Tensor& ref,
    const char* refName,
    const at::Tensor& t,
    const Name& name) {
  TORCH_CHECK_VALUE(
      t.device() == ref.device(),
      prefix(op),
      name,
      " is on ",
      t.device(),
      " but ",
      refName,
      " is on ",
      ref.device(),
      "; they must be on the same device");
}

void checkLike(
    Op op,
    const at::Tensor& ref,
    const char* refName,
    const at::Tensor& t,
    const Name& name) {
  checkSameDtype(op, ref, refName, t, name);
  checkSameDevice(op, ref, refName, t, name);
}

// Every tensor of a list has the dtype, device and element count of `ref`.
void checkListLike(
    Op op,
    const std::vector<at::Tensor>& list,
    const char* listName,
    const at::Tensor& ref,
    const char* refName) {
  for (size_t i = 0; i < list.size(); ++i) {
    Name name(listName, static_cast<int64_t>(i));
    checkLike(op, ref, refName, list[i], name);
    TORCH_CHECK_VALUE(
        list[i].numel() == ref.numel(),
        prefix(op),
        name,
        " has ",
        list[i].numel(),
        " elements, expected ",
        ref.numel(),
        " (as many as ",
        refName,
        ")");
  }
}

// Elements per row (dim 0) of a tensor with at least one dimension.
int64_t rowNumel(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) {
    n *= t.size(d);
  }
  return n;
}

// Validates explicit split sizes or computes even ones.
std::vector<int64_t> resolveSplits(
    Op op,
    const std::vector<int64_t>& splits,
    const at::Tensor& t,
    const char* tensorName,
    const char* splitsName,
    int worldSize) {
  int64_t rows = t.size(0);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(
        rows % worldSize == 0,
        prefix(op),
        "world size ",
        worldSize,
        " does not divide dim 0 of ",
        tensorName,
        " (",
        rows,
        ") and no ",
        splitsName,
        " were given");
    return std::vector<int64_t>(worldSize, rows / worldSize);
  }
  TORCH_CHECK_VALUE(
      splits.size() == static_cast<size_t>(worldSize),
      prefix(op),
      splitsName,
      " has ",
      splits.size(),
      " entries, expected ",
      worldSize,
      " (the world size)");
  int64_t sum = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    TORCH_CHECK_VALUE(
        splits[i] >= 0,
        prefix(op),
        splitsName,
        "[",
        i,
        "] is ",
        splits[i],
        "; split sizes must be non-negative");
    sum += splits[i];
  }
  TORCH_CHECK_VALUE(
      sum == rows,
      prefix(op),
      splitsName,
      " sum to ",
      sum,
      " but dim 0 of ",
      tensorName,
      " is ",
      rows);
  return splits;
}

std::vector<at::Tensor> column(
    const std::vector<std::vector<at::Tensor>>& lists,
    size_t j) {
  std::vector<at::Tensor> out;
  out.reserve(lists.size());
  for (const auto& list : lists) {
    out.push_back(list[j]);
  }
  return out;
}

std::vector<at::Tensor> flatten(
    const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& list : lists) {
    out.insert(out.end(), list.begin(), list.end());
  }
  return out;
}

} // namespace

const char* opName(Op op) {
  return kOpNames[static_cast<int>(op)];
}

// ---------------------------------------------------------------- TDistWork

TDistWork::TDistWork(
    int rank,
    c10d::OpType type,
    const char* profilingTitle,
    const std::vector<at::Tensor>& inputs,
    std::vector<at::Tensor> outputs,
    bool asyncOp)
    : Work(rank, type, profilingTitle, inputs),
      inputs_(inputs),
      outputs_(std::move(outputs)),
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
      "tdist ", op, ": (rank ", rank_, " of ", size_, ", group '", getGroupUid(),
      "') did not finish within the group's timeout (", timeout.count() / 1000.0, " s)");
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

// ------------------------------------------------------- validation helpers

void ProcessGroupTDist::checkDevice(
    Op op,
    const at::Tensor& t,
    const char* what) const {
  auto type = t.device().type();
  if (std::find(devices_.begin(), devices_.end(), type) != devices_.end()) {
    if (type == c10::kCUDA) {
      checkGpu(op, t, what);
    }
    return;
  }
  std::vector<std::string> names;
  for (auto d : devices_) {
    names.push_back(deviceTypeName(d));
  }
  TORCH_CHECK_VALUE(
      false,
      prefix(op),
      what,
      " is on ",
      deviceTypeName(type),
      ", but this group serves ",
      c10::Join(", ", names));
}

// One GPU per rank and group, as with NCCL: the first CUDA tensor picks it. Checked before any
// stream or event is touched, so a tensor on another GPU gets this error, not an event's.
void ProcessGroupTDist::checkGpu(Op op, const at::Tensor& t, const char* what)
    const {
  auto index = t.device().index();
  if (gpuIndex_ < 0) {
    gpuIndex_ = index;
  }
  TORCH_CHECK_VALUE(
      index == gpuIndex_,
      prefix(op),
      what,
      " is on cuda:",
      static_cast<int>(index),
      ", but this group runs on cuda:",
      static_cast<int>(gpuIndex_),
      " (one GPU per rank and group)");
}

void ProcessGroupTDist::checkRoot(Op op, int64_t root, const char* what)
    const {
  TORCH_CHECK_VALUE(
      root >= 0 && root < size_,
      prefix(op),
      what,
      " ",
      root,
      " is not a rank of this group of size ",
      size_);
}

void ProcessGroupTDist::checkGroupSize(
    Op op,
    size_t got,
    const char* what,
    const char* whose) const {
  TORCH_CHECK_VALUE(
      got == static_cast<size_t>(size_),
      prefix(op),
      what,
      whose ? whose : "",
      " has ",
      got,
      " tensors, expected ",
      size_,
      " (the world size)");
}

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
    int64_t bytes,
    bool sameSizeOnEveryRank) const {
  if (route == Route::Fallback || t.is_cpu()) {
    return route;
  }
  if (!sameSizeOnEveryRank) { // no size test agrees across ranks
    return gpuUnevenAllToAll_ ? route : Route::Fallback;
  }
  int64_t limit = gpuMaxBytes_[static_cast<int>(op)];
  int64_t servedFrom = gpuServedFrom_[static_cast<int>(op)];
  bool between = limit >= 0 && bytes > limit &&
      (servedFrom < 0 || bytes < servedFrom);
  return between ? Route::Fallback : route;
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

template <typename... Args>
std::optional<LaunchPlan> ProcessGroupTDist::execute(
    Op op,
    const char* method,
    Args&&... args) {
  py::gil_scoped_acquire gil;
  try {
    py::object plan =
        executor_.get().attr(method)(std::forward<Args>(args)...);
    if (plan.is_none()) {
      return std::nullopt;
    }
    return LaunchPlan::fromPython(plan);
  } catch (py::error_already_set& e) {
    throwPythonError(op, e);
  }
}

template <typename... Args>
void ProcessGroupTDist::executePlanned(
    const PlanKey& key,
    const at::Tensor& input,
    const at::Tensor& output,
    Op op,
    const char* method,
    Args&&... args) {
  if (!input.is_cpu() && LaunchPlan::fits(input) && LaunchPlan::fits(output)) {
    std::lock_guard<std::mutex> lock(plansMutex_);
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      c10::impl::VirtualGuardImpl impl(input.device().type());
      it->second.launch(
          input, output, impl.getStream(input.device()).native_handle());
      return;
    }
  }
  auto plan = execute(op, method, std::forward<Args>(args)...);
  if (plan) {
    std::lock_guard<std::mutex> lock(plansMutex_);
    plans_.emplace(key, std::move(*plan));
  }
}

void ProcessGroupTDist::executeUneven(
    const at::Tensor& input,
    const at::Tensor& output,
    const std::vector<int64_t>& inSplits,
    const std::vector<int64_t>& outSplits) {
  constexpr Op op = Op::AllToAllSingle;
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
  if (work->watchable()) { // (also what it keeps alive: see TDistWork)
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

template <typename CallOptions, typename Call>
WorkPtr ProcessGroupTDist::handOver(
    Op op,
    OpType type,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const CallOptions& opts,
    size_t n,
    Call call) {
  const auto& ref = inputs.empty() ? outputs.at(0) : inputs[0];
  auto& backend = fallbackFor(op, ref.device().type());
  if (!ref.is_cuda()) {
    count(op, Route::Fallback, n);
    return call(backend, opts);
  }
  if (!opts.asyncOp) {
    auto caller = currentStream(ref.device());
    uint64_t capture = captureId(caller);
    waitForLastCall(caller, capture);
    auto work = call(backend, opts);
    count(op, Route::Fallback, n);
    becomeLastCall(caller, capture);
    return work;
  }
  auto work = startWork(op, type, inputs, outputs, true);
  CallOptions onStream = opts;
  onStream.asyncOp = false; // (NCCL: on the current stream, startWork's)
  auto nested = call(backend, onStream);
  if (nested) {
    nested->wait(); // (a backend that still returns Work for a synchronous call)
  }
  return finishWork(work, op, n, Route::Fallback);
}

// ---------------------------------------------------------------- all-gather

namespace {

void checkAllGatherPair(
    Op op,
    const at::Tensor& output,
    const at::Tensor& input,
    int worldSize) {
  checkLike(op, input, "input", output, "output");
  TORCH_CHECK_VALUE(
      output.numel() == input.numel() * worldSize,
      prefix(op),
      "output has ",
      output.numel(),
      " elements, expected ",
      input.numel() * worldSize,
      " (input ",
      input.numel(),
      " elements x world size ",
      worldSize,
      ")");
}

void checkReduceScatterPair(
    Op op,
    const at::Tensor& output,
    const at::Tensor& input,
    int worldSize) {
  checkLike(op, input, "input", output, "output");
  TORCH_CHECK_VALUE(
      input.numel() % worldSize == 0,
      prefix(op),
      "world size ",
      worldSize,
      " does not divide input of ",
      input.numel(),
      " elements");
  TORCH_CHECK_VALUE(
      input.numel() == output.numel() * worldSize,
      prefix(op),
      "output has ",
      output.numel(),
      " elements, expected ",
      input.numel() / worldSize,
      " (input ",
      input.numel(),
      " elements / world size ",
      worldSize,
      ")");
}

void checkSameLength(
    Op op,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK_VALUE(
      outputs.size() == inputs.size(),
      prefix(op),
      "got ",
      outputs.size(),
      " outputs for ",
      inputs.size(),
      " inputs");
}

} // namespace

WorkPtr ProcessGroupTDist::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  constexpr Op op = Op::AllGatherIntoTensor;
  checkDevice(op, input, "input");
  checkAllGatherPair(op, output, input, size_);
  if (limitBySize(op, routeMovement(input), input, input.nbytes()) ==
      Route::Fallback) {
    return handOver(
        op, OpType::_ALLGATHER_BASE, {input}, {output}, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b._allgather_base(output, input, o);
        });
  }
  auto work = startWork(op, OpType::_ALLGATHER_BASE, {input}, {output}, opts.asyncOp);
  executePlanned(
      planKey(op, input, output),
      input,
      output,
      op,
      "all_gather_into_tensor",
      output,
      input);
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr Op op = Op::AllGatherIntoTensor;
  checkSameLength(op, outputs, inputs);
  Route route = Route::Tdist;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkDevice(op, inputs[i], "input");
    checkSameDevice(op, inputs[0], "input 0", inputs[i], "input");
    checkAllGatherPair(op, outputs[i], inputs[i], size_);
    if (limitBySize(op, routeMovement(inputs[i]), inputs[i], inputs[i].nbytes()) ==
        Route::Fallback) {
      route = Route::Fallback;
    }
  }
  if (route == Route::Fallback) {
    return handOver(
        op, OpType::COALESCED, inputs, outputs, opts, inputs.size(),
        [&](c10d::Backend& b, const auto& o) {
          return b.allgather_into_tensor_coalesced(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::COALESCED, inputs, outputs, opts.asyncOp);
  for (size_t i = 0; i < inputs.size(); ++i) {
    execute(op, "all_gather_into_tensor", outputs[i], inputs[i]);
  }
  return finishWork(work, op, inputs.size());
}

WorkPtr ProcessGroupTDist::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr Op op = Op::AllGather;
  checkSingle(op, inputs, "input");
  TORCH_CHECK_VALUE(
      outputs.size() == 1,
      prefix(op),
      "expected one output list, got ",
      outputs.size());
  const auto& input = inputs[0];
  checkDevice(op, input, "input");
  checkGroupSize(op, outputs[0].size(), "tensor_list");
  checkListLike(op, outputs[0], "tensor_list", input, "input");
  if (limitBySize(op, routeMovement(input), input, input.nbytes()) ==
      Route::Fallback) {
    return handOver(
        op, OpType::ALLGATHER, inputs, outputs[0], opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.allgather(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::ALLGATHER, inputs, outputs[0], opts.asyncOp);
  execute(op, "all_gather", outputs[0], input);
  return finishWork(work, op);
}

// outputLists[r][j] receives input j of rank r.
WorkPtr ProcessGroupTDist::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr Op op = Op::AllGather;
  checkGroupSize(op, outputLists.size(), "output_tensor_lists");
  Route route = Route::Tdist;
  for (size_t j = 0; j < inputs.size(); ++j) {
    checkDevice(op, inputs[j], "input");
    if (routeMovement(inputs[j]) == Route::Fallback) {
      route = Route::Fallback;
    }
  }
  for (size_t r = 0; r < outputLists.size(); ++r) {
    TORCH_CHECK_VALUE(
        outputLists[r].size() == inputs.size(),
        prefix(op),
        "output_tensor_lists[",
        r,
        "] has ",
        outputLists[r].size(),
        " tensors, expected ",
        inputs.size(),
        " (one per input)");
    for (size_t j = 0; j < inputs.size(); ++j) {
      const auto& out = outputLists[r][j];
      Name name("output_tensor_lists", static_cast<int64_t>(r), static_cast<int64_t>(j));
      checkLike(op, inputs[j], "its input", out, name);
      TORCH_CHECK_VALUE(
          out.numel() == inputs[j].numel(),
          prefix(op),
          name,
          " has ",
          out.numel(),
          " elements, expected ",
          inputs[j].numel(),
          " (as many as input ",
          j,
          ")");
    }
  }
  if (route == Route::Fallback) {
    return handOver(
        op, OpType::ALLGATHER_COALESCED, inputs, flatten(outputLists), opts, inputs.size(),
        [&](c10d::Backend& b, const auto& o) {
          return b.allgather_coalesced(outputLists, inputs, o);
        });
  }
  auto work = startWork(
      op, OpType::ALLGATHER_COALESCED, inputs, flatten(outputLists), opts.asyncOp);
  for (size_t j = 0; j < inputs.size(); ++j) {
    execute(op, "all_gather", column(outputLists, j), inputs[j]);
  }
  return finishWork(work, op, inputs.size());
}

// ----------------------------------------------------------- reduce-scatter

WorkPtr ProcessGroupTDist::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  constexpr Op op = Op::ReduceScatterTensor;
  checkDevice(op, input, "input");
  checkReduceScatterPair(op, output, input, size_);
  if (limitBySize(
          op,
          routeReduction(op, input, opts.reduceOp),
          input,
          input.nbytes()) == Route::Fallback) {
    return handOver(
        op, OpType::_REDUCE_SCATTER_BASE, {input}, {output}, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b._reduce_scatter_base(output, input, o);
        });
  }
  auto work = startWork(op, OpType::_REDUCE_SCATTER_BASE, {input}, {output}, opts.asyncOp);
  executePlanned(
      planKey(op, input, output, static_cast<int>(opts.reduceOp.op_)),
      input,
      output,
      op,
      "reduce_scatter_tensor",
      output,
      input,
      executorOpName(opts.reduceOp.op_));
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr Op op = Op::ReduceScatterTensor;
  checkSameLength(op, outputs, inputs);
  Route route = Route::Tdist;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkDevice(op, inputs[i], "input");
    checkSameDevice(op, inputs[0], "input 0", inputs[i], "input");
    checkReduceScatterPair(op, outputs[i], inputs[i], size_);
    if (routeReduction(op, inputs[i], opts.reduceOp) == Route::Fallback) {
      route = Route::Fallback;
    }
  }
  if (route == Route::Fallback) {
    return handOver(
        op, OpType::COALESCED, inputs, outputs, opts, inputs.size(),
        [&](c10d::Backend& b, const auto& o) {
          return b.reduce_scatter_tensor_coalesced(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::COALESCED, inputs, outputs, opts.asyncOp);
  for (size_t i = 0; i < inputs.size(); ++i) {
    execute(
        op,
        "reduce_scatter_tensor",
        outputs[i],
        inputs[i],
        executorOpName(opts.reduceOp.op_));
  }
  return finishWork(work, op, inputs.size());
}

WorkPtr ProcessGroupTDist::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr Op op = Op::ReduceScatter;
  checkSingle(op, outputs, "output");
  TORCH_CHECK_VALUE(
      inputs.size() == 1,
      prefix(op),
      "expected one input list, got ",
      inputs.size());
  const auto& output = outputs[0];
  checkDevice(op, output, "output");
  checkGroupSize(op, inputs[0].size(), "input_list");
  checkListLike(op, inputs[0], "input_list", output, "output");
  if (routeReduction(op, output, opts.reduceOp) == Route::Fallback) {
    return handOver(
        op, OpType::REDUCE_SCATTER, inputs[0], outputs, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.reduce_scatter(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::REDUCE_SCATTER, inputs[0], outputs, opts.asyncOp);
  execute(
      op,
      "reduce_scatter",
      output,
      inputs[0],
      executorOpName(opts.reduceOp.op_));
  return finishWork(work, op);
}

// --------------------------------------------------------------- all-reduce

WorkPtr ProcessGroupTDist::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  constexpr Op op = Op::AllReduce;
  checkSingle(op, tensors, "input");
  const auto& t = tensors[0];
  checkDevice(op, t, "tensor");
  if (limitBySize(op, routeReduction(op, t, opts.reduceOp), t, t.nbytes()) ==
      Route::Fallback) {
    return handOver(
        op, OpType::ALLREDUCE, tensors, tensors, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.allreduce(tensors, o);
        });
  }
  auto work = startWork(op, OpType::ALLREDUCE, tensors, tensors, opts.asyncOp);
  executePlanned(
      planKey(op, t, t, static_cast<int>(opts.reduceOp.op_)),
      t,
      t,
      op,
      "all_reduce",
      t,
      executorOpName(opts.reduceOp.op_));
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  constexpr Op op = Op::AllReduce;
  Route route = Route::Tdist;
  for (const auto& t : tensors) {
    checkDevice(op, t, "tensor");
    checkSameDevice(op, tensors[0], "tensor 0", t, "tensor");
    if (routeReduction(op, t, opts.reduceOp) == Route::Fallback) {
      route = Route::Fallback;
    }
  }
  if (route == Route::Fallback) {
    return handOver(
        op, OpType::ALLREDUCE_COALESCED, tensors, tensors, opts, tensors.size(),
        [&](c10d::Backend& b, const auto& o) {
          return b.allreduce_coalesced(tensors, o);
        });
  }
  auto work = startWork(op, OpType::ALLREDUCE_COALESCED, tensors, tensors, opts.asyncOp);
  for (const auto& t : tensors) {
    execute(op, "all_reduce", t, executorOpName(opts.reduceOp.op_));
  }
  return finishWork(work, op, tensors.size());
}

// --------------------------------------------------------------- all-to-all

WorkPtr ProcessGroupTDist::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  constexpr Op op = Op::AllToAllSingle;
  checkDevice(op, input, "input");
  checkLike(op, input, "input", output, "output");
  TORCH_CHECK_VALUE(
      input.dim() >= 1 && output.dim() >= 1,
      prefix(op),
      "input and output need at least one dimension");
  TORCH_CHECK_VALUE(
      rowNumel(input) == rowNumel(output),
      prefix(op),
      "input rows have ",
      rowNumel(input),
      " elements but output rows have ",
      rowNumel(output),
      "; they must match (input shape ",
      input.sizes(),
      ", output shape ",
      output.sizes(),
      ")");
  TORCH_CHECK_VALUE(
      !inputSplitSizes.empty() || !outputSplitSizes.empty() ||
          input.numel() == output.numel(),
      prefix(op),
      "without split sizes, input and output must hold the same number of elements (input shape ",
      input.sizes(),
      ", output shape ",
      output.sizes(),
      ")");
  auto inSplits = resolveSplits(
      op, inputSplitSizes, input, "input", "input_split_sizes", size_);
  auto outSplits = resolveSplits(
      op, outputSplitSizes, output, "output", "output_split_sizes", size_);
  if (limitBySize(
          op,
          routeMovement(input),
          input,
          input.nbytes(),
          inputSplitSizes.empty() && outputSplitSizes.empty()) ==
      Route::Fallback) {
    return handOver(
        op, OpType::ALLTOALL_BASE, {input}, {output}, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.alltoall_base(output, input, outputSplitSizes, inputSplitSizes, o);
        });
  }
  auto work = startWork(op, OpType::ALLTOALL_BASE, {input}, {output}, opts.asyncOp);
  if (inputSplitSizes.empty() && outputSplitSizes.empty()) {
    // even splits: the shapes alone determine the call, the same on every rank (passed on as
    // no split sizes, so the executor may choose its kernel and grid by size)
    executePlanned(
        planKey(op, input, output),
        input,
        output,
        op,
        "all_to_all_single",
        output,
        input,
        std::vector<int64_t>{},
        std::vector<int64_t>{});
  } else {
    try {
      executeUneven(input, output, inSplits, outSplits);
    } catch (...) {
      // a rank pair too large for a mailbox raises after the launch: later calls still wait
      // for that kernel, and the watchdog watches it
      finishWork(work, op);
      throw;
    }
  }
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  constexpr Op op = Op::AllToAll;
  checkGroupSize(op, inputs.size(), "input_tensor_list");
  checkGroupSize(op, outputs.size(), "output_tensor_list");
  const auto& ref = inputs[0];
  checkDevice(op, ref, "input");
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto index = static_cast<int64_t>(i);
    checkLike(op, ref, "input_tensor_list[0]", inputs[i], Name("input_tensor_list", index));
    checkLike(op, ref, "input_tensor_list[0]", outputs[i], Name("output_tensor_list", index));
  }
  if (limitBySize(op, routeMovement(ref), ref, ref.nbytes(), false) ==
      Route::Fallback) {
    return handOver(
        op, OpType::ALLTOALL, inputs, outputs, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.alltoall(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::ALLTOALL, inputs, outputs, opts.asyncOp);
  execute(op, "all_to_all", outputs, inputs);
  return finishWork(work, op);
}

// ----------------------------------------------------------- rooted and misc

WorkPtr ProcessGroupTDist::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  constexpr Op op = Op::Broadcast;
  checkSingle(op, tensors, "input");
  const auto& t = tensors[0];
  checkDevice(op, t, "tensor");
  checkRoot(op, opts.rootRank, "src");
  TORCH_CHECK_VALUE(
      opts.rootTensor == 0, prefix(op), "root tensor must be 0");
  if (limitBySize(op, routeMovement(t), t, t.nbytes()) == Route::Fallback) {
    return handOver(
        op, OpType::BROADCAST, tensors, tensors, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.broadcast(tensors, o);
        });
  }
  auto work = startWork(op, OpType::BROADCAST, tensors, tensors, opts.asyncOp);
  executePlanned(
      planKey(op, t, t, -1, opts.rootRank),
      t,
      t,
      op,
      "broadcast",
      t,
      opts.rootRank);
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::barrier(const c10d::BarrierOptions& opts) {
  constexpr Op op = Op::Barrier;
  if (served_.empty()) {
    count(op, Route::Fallback);
    return fallbackForBarrier(opts).barrier(opts);
  }
  std::optional<c10::Device> device;
  if (served_.count(c10::kCUDA) > 0) {
    device = opts.device.has_value()
        ? *opts.device
        : c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
  }
  auto work = startWork(op, OpType::BARRIER, {}, {}, opts.asyncOp, device);
  execute(op, "barrier");
  return finishWork(work, op);
}

// The root's tensor list of scatter/gather, checked against `ref`; other ranks pass none.
std::vector<at::Tensor> ProcessGroupTDist::rootList(
    Op op,
    const std::vector<std::vector<at::Tensor>>& lists,
    int64_t root,
    const char* rootName,
    const char* listName,
    const at::Tensor& ref,
    const char* refName) const {
  if (rank_ != root) {
    TORCH_CHECK_VALUE(
        lists.empty() || (lists.size() == 1 && lists[0].empty()),
        prefix(op),
        listName,
        " must be empty on ranks other than ",
        rootName);
    return {};
  }
  TORCH_CHECK_VALUE(
      lists.size() == 1,
      prefix(op),
      "the ",
      rootName,
      " rank needs one ",
      listName,
      ", got ",
      lists.size());
  checkGroupSize(op, lists[0].size(), listName, " on the root rank");
  checkListLike(op, lists[0], listName, ref, refName);
  return lists[0];
}

WorkPtr ProcessGroupTDist::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  constexpr Op op = Op::Scatter;
  checkSingle(op, outputs, "output");
  const auto& output = outputs[0];
  checkDevice(op, output, "output");
  checkRoot(op, opts.rootRank, "src");
  auto scatterList =
      rootList(op, inputs, opts.rootRank, "src", "scatter_list", output, "output");
  if (routeMovement(output) == Route::Fallback) {
    return handOver(
        op, OpType::SCATTER, scatterList, outputs, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.scatter(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::SCATTER, scatterList, outputs, opts.asyncOp);
  execute(op, "scatter", output, scatterList, opts.rootRank);
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  constexpr Op op = Op::Gather;
  checkSingle(op, inputs, "input");
  const auto& input = inputs[0];
  checkDevice(op, input, "input");
  checkRoot(op, opts.rootRank, "dst");
  auto gatherList =
      rootList(op, outputs, opts.rootRank, "dst", "gather_list", input, "input");
  if (routeMovement(input) == Route::Fallback) {
    return handOver(
        op, OpType::GATHER, inputs, gatherList, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.gather(outputs, inputs, o);
        });
  }
  auto work = startWork(op, OpType::GATHER, inputs, gatherList, opts.asyncOp);
  execute(op, "gather", gatherList, input, opts.rootRank);
  return finishWork(work, op);
}

WorkPtr ProcessGroupTDist::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  constexpr Op op = Op::Reduce;
  checkSingle(op, tensors, "input");
  const auto& t = tensors[0];
  checkDevice(op, t, "tensor");
  checkRoot(op, opts.rootRank, "dst");
  TORCH_CHECK_VALUE(
      opts.rootTensor == 0, prefix(op), "root tensor must be 0");
  if (routeReduction(op, t, opts.reduceOp) == Route::Fallback) {
    return handOver(
        op, OpType::REDUCE, tensors, tensors, opts, 1,
        [&](c10d::Backend& b, const auto& o) {
          return b.reduce(tensors, o);
        });
  }
  auto work = startWork(op, OpType::REDUCE, tensors, tensors, opts.asyncOp);
  execute(
      op, "reduce", t, opts.rootRank, executorOpName(opts.reduceOp.op_));
  return finishWork(work, op);
}

// --------------------------------------------- point-to-point (fallback only)

WorkPtr ProcessGroupTDist::send(
    std::vector<at::Tensor>& tensors,
    int dstRank,
    int tag) {
  constexpr Op op = Op::Send;
  checkSingle(op, tensors, "input");
  checkDevice(op, tensors[0], "tensor");
  checkRoot(op, dstRank, "dst");
  count(op, Route::Fallback);
  return fallbackFor(op, tensors[0].device().type())
      .send(tensors, dstRank, tag);
}

WorkPtr ProcessGroupTDist::recv(
    std::vector<at::Tensor>& tensors,
    int srcRank,
    int tag) {
  constexpr Op op = Op::Recv;
  checkSingle(op, tensors, "output");
  checkDevice(op, tensors[0], "tensor");
  checkRoot(op, srcRank, "src");
  count(op, Route::Fallback);
  return fallbackFor(op, tensors[0].device().type())
      .recv(tensors, srcRank, tag);
}

WorkPtr ProcessGroupTDist::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  constexpr Op op = Op::Recv;
  checkSingle(op, tensors, "output");
  checkDevice(op, tensors[0], "tensor");
  count(op, Route::Fallback);
  return fallbackFor(op, tensors[0].device().type())
      .recvAnysource(tensors, tag);
}

// -------------------------------------------------------------- inspection

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
