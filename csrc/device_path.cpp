#include "device_path.hpp"

#include <dlfcn.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace tdist {

namespace {

c10::impl::VirtualGuardImpl guardFor(c10::DeviceType type) {
  return c10::impl::VirtualGuardImpl(type);
}

// cuLaunchKernel from the driver library torch already loaded; taken at run
// time so the extension needs no CUDA toolkit to build.
using DriverLaunch = int (*)(
    void* function,
    unsigned gridX,
    unsigned gridY,
    unsigned gridZ,
    unsigned blockX,
    unsigned blockY,
    unsigned blockZ,
    unsigned sharedBytes,
    void* stream,
    void** params,
    void** extra);

// cuLaunchKernelEx's configuration (cuda.h's CUlaunchConfig and CUlaunchAttribute), for
// launches with programmatic dependent launch allowed.
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    int programmaticStreamSerializationAllowed;
  } value;
};
struct LaunchConfig {
  unsigned gridX, gridY, gridZ, blockX, blockY, blockZ, sharedBytes;
  void* stream;
  LaunchAttribute* attrs;
  unsigned numAttrs;
};
constexpr int kAttributeProgrammaticStreamSerialization = 6;
using DriverLaunchEx = int (*)(const LaunchConfig* config, void* function, void** params, void** extra);

} // namespace

void* driverSymbol(const char* name) {
  static void* lib = []() {
    void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return handle != nullptr ? handle : dlopen("libcuda.so.1", RTLD_NOW);
  }();
  TORCH_CHECK(lib != nullptr, "tdist: cannot open libcuda.so.1: ", dlerror());
  void* sym = dlsym(lib, name);
  TORCH_CHECK(sym != nullptr, "tdist: libcuda.so.1 has no ", name);
  return sym;
}

namespace {

DriverLaunch driverLaunch() {
  static auto fn = reinterpret_cast<DriverLaunch>(driverSymbol("cuLaunchKernel"));
  return fn;
}

DriverLaunchEx driverLaunchEx() {
  static auto fn = reinterpret_cast<DriverLaunchEx>(driverSymbol("cuLaunchKernelEx"));
  return fn;
}

} // namespace

void copyHostToDevice(void* dst, const void* src, size_t bytes, void* stream) {
  using CopyAsync = int (*)(uint64_t dst, const void* src, size_t bytes, void* stream);
  static auto fn = reinterpret_cast<CopyAsync>(driverSymbol("cuMemcpyHtoDAsync_v2"));
  int rc = fn(reinterpret_cast<uint64_t>(dst), src, bytes, stream);
  TORCH_CHECK(rc == 0, "tdist: cuMemcpyHtoDAsync failed with CUDA error ", rc);
}

uint64_t captureId(const c10::Stream& stream) {
  if (stream.device_type() != c10::DeviceType::CUDA) {
    return 0;
  }
  using CaptureInfo = int (*)(
      void* stream, int* status, uint64_t* id, void** graph, const void** deps, size_t* numDeps);
  static auto fn = reinterpret_cast<CaptureInfo>(driverSymbol("cuStreamGetCaptureInfo_v2"));
  int status = 0; // CU_STREAM_CAPTURE_STATUS_NONE
  uint64_t id = 0;
  int rc = fn(stream.native_handle(), &status, &id, nullptr, nullptr, nullptr);
  if (rc != 0) { // the legacy stream while another stream captures: as a capture
    return UINT64_MAX;
  }
  return status == 0 ? 0 : (id != 0 ? id : UINT64_MAX); // (an invalidated one counts)
}

void relaxThreadCaptureMode() {
  using ExchangeMode = int (*)(int* mode);
  void* sym = nullptr;
  try {
    sym = driverSymbol("cuThreadExchangeStreamCaptureMode");
  } catch (const c10::Error&) {
    return; // no CUDA driver: nothing to capture
  }
  int mode = 2; // CU_STREAM_CAPTURE_MODE_RELAXED
  reinterpret_cast<ExchangeMode>(sym)(&mode);
}

std::unique_ptr<c10::Event> EventPool::take(c10::DeviceType type) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      auto event = std::move(free_.back());
      free_.pop_back();
      return event;
    }
  }
  return std::make_unique<c10::Event>(type);
}

void EventPool::give(std::unique_ptr<c10::Event> event) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(std::move(event));
}

void EventPool::recordOn(c10::Event& event, const c10::Stream& stream) {
  // An event c10 has created is recorded again through the driver, on the
  // current device's context as the kernels are launched: c10's record (the
  // runtime, the current device switched there and back) took about 0.6 us a
  // call more on the device's hosts (results/host_phases_NVIDIA_H200-x2.log).
  using EventRecord = int (*)(void* event, void* stream);
  if (stream.device_type() == c10::DeviceType::CUDA && event.eventId() != nullptr &&
      event.device_index() == stream.device_index()) {
    static EventRecord driverRecord = []() -> EventRecord {
      try {
        return reinterpret_cast<EventRecord>(driverSymbol("cuEventRecord"));
      } catch (const c10::Error&) {
        return nullptr; // no CUDA driver (a ROCm build of torch)
      }
    }();
    if (driverRecord != nullptr) {
      int rc = driverRecord(event.eventId(), stream.native_handle());
      TORCH_CHECK(rc == 0, "tdist: cuEventRecord failed with CUDA error ", rc);
      return;
    }
  }
  event.record(stream);
}

std::shared_ptr<c10::Event> EventPool::record(const c10::Stream& stream) {
  auto event = take(stream.device_type());
  recordOn(*event, stream);
  return std::shared_ptr<c10::Event>(
      event.release(), [pool = shared_from_this()](c10::Event* e) {
        pool->give(std::unique_ptr<c10::Event>(e));
      });
}

StreamScope::StreamScope(c10::Stream comm, std::shared_ptr<EventPool> events)
    : comm_(comm),
      caller_(guardFor(comm.device_type()).getStream(comm.device())),
      events_(std::move(events)) {
  if (onCallerStream()) {
    return;
  }
  auto ready = events_->take(comm.device_type());
  EventPool::recordOn(*ready, caller_);
  // (the wait is enqueued: the event may be recorded anew; while the caller
  // captures a CUDA graph, this wait brings comm_ into the capture)
  ready->block(comm_);
  events_->give(std::move(ready));
  guardFor(comm.device_type()).exchangeStream(comm_);
}

StreamScope::~StreamScope() {
  if (!onCallerStream()) {
    guardFor(comm_.device_type()).exchangeStream(caller_);
  }
}

std::shared_ptr<c10::Event> StreamScope::recordEnd() const {
  return events_->record(comm_);
}

c10::Stream currentStream(const c10::Device& device) {
  return guardFor(device.type()).getStream(device);
}

c10::Stream newCommStream(const c10::Device& device) {
  return guardFor(device.type())
      .getStreamFromGlobalPool(device, /*isHighPriority=*/true);
}

bool PlanKey::operator==(const PlanKey& o) const {
  return op == o.op && dtype == o.dtype && numelIn == o.numelIn &&
      numelOut == o.numelOut && reduceOp == o.reduceOp && root == o.root &&
      device == o.device;
}

size_t PlanKeyHash::operator()(const PlanKey& k) const {
  size_t h = std::hash<int64_t>()(k.numelIn);
  for (int64_t v :
       {static_cast<int64_t>(k.op),
        static_cast<int64_t>(k.dtype),
        k.numelOut,
        static_cast<int64_t>(k.reduceOp),
        k.root,
        static_cast<int64_t>(k.device)}) {
    h = h * 1000003u ^ std::hash<int64_t>()(v);
  }
  return h;
}

LaunchPlan LaunchPlan::fromPython(const py::handle& plan) {
  LaunchPlan p;
  auto tuple = plan.cast<py::tuple>();
  TORCH_CHECK(tuple.size() == 6, "tdist: a launch plan is a 6-tuple");
  p.function_ = reinterpret_cast<void*>(tuple[0].cast<uint64_t>());
  auto grid = tuple[1].cast<std::vector<unsigned>>();
  TORCH_CHECK(grid.size() == 3, "tdist: a launch plan's grid has 3 sizes");
  std::copy(grid.begin(), grid.end(), p.grid_.begin());
  p.threads_ = tuple[2].cast<unsigned>();
  p.sharedBytes_ = tuple[3].cast<unsigned>();
  p.params_ = tuple[4].cast<std::vector<std::pair<int, uint64_t>>>();
  p.dependentLaunch_ = tuple[5].cast<bool>();
  TORCH_CHECK(
      p.params_.size() <= kMaxParams, "tdist: a launch plan has too many parameters");
  return p;
}

bool LaunchPlan::fits(const at::Tensor& t) {
  return t.is_contiguous() &&
      reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

void LaunchPlan::launch(
    const at::Tensor& input,
    const at::Tensor& output,
    void* stream) const {
  launch(
      {reinterpret_cast<uintptr_t>(input.data_ptr()),
       reinterpret_cast<uintptr_t>(output.data_ptr())},
      stream);
}

void LaunchPlan::launch(const std::vector<uintptr_t>& roles, void* stream)
    const {
  std::array<uint64_t, kMaxParams> values{};
  std::array<void*, kMaxParams> args{};
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [kind, value] = params_[i];
    if (kind >= RolePtr) {
      size_t role = kind - RolePtr;
      TORCH_CHECK(role < roles.size(), "tdist: a launch plan names tensor ", role,
                  " of a call with ", roles.size());
      values[i] = roles[role] + value;
    } else { // a 32-bit literal sits in the low bytes (little-endian)
      values[i] = value;
    }
    args[i] = &values[i];
  }
  if (dependentLaunch_) {
    LaunchAttribute attr{};
    attr.id = kAttributeProgrammaticStreamSerialization;
    attr.value.programmaticStreamSerializationAllowed = 1;
    LaunchConfig config{grid_[0], grid_[1], grid_[2], threads_, 1, 1, sharedBytes_, stream, &attr, 1};
    int rc = driverLaunchEx()(&config, function_, args.data(), nullptr);
    TORCH_CHECK(rc == 0, "tdist: cuLaunchKernelEx failed with CUDA error ", rc);
    return;
  }
  int rc = driverLaunch()(
      function_,
      grid_[0],
      grid_[1],
      grid_[2],
      threads_,
      1,
      1,
      sharedBytes_,
      stream,
      args.data(),
      nullptr);
  TORCH_CHECK(rc == 0, "tdist: cuLaunchKernel failed with CUDA error ", rc);
}

} // namespace tdist
