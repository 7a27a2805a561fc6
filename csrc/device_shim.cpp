// The driver functions of device_shim.hpp. On NVIDIA (the default) they are CUDA
// driver calls, each taken from libcuda.so.1 by name the first time it is
// needed. On a ROCm build of torch (BuildExtension defines USE_ROCM for every
// source, also a CppExtension's, and hipifies none of them) they are the HIP
// runtime's, called directly: setup.py adds HIP's headers and libamdhip64 there.
#include "device_shim.hpp"

#include <dlfcn.h>

#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#ifdef USE_ROCM
#include <hip/hip_runtime_api.h>

namespace tdist {

namespace {

void check(hipError_t rc, const char* call) {
  TORCH_CHECK(rc == hipSuccess, "tdist: ", call, " failed with HIP error ", static_cast<int>(rc),
              " (", hipGetErrorString(rc), ")");
}

hipStream_t asStream(void* stream) {
  return static_cast<hipStream_t>(stream);
}

hipEvent_t asEvent(void* event) {
  return static_cast<hipEvent_t>(event);
}

} // namespace

void* driverSymbol(const char* name) {
  // (the extension links libamdhip64, the runtime torch loaded)
  void* sym = dlsym(RTLD_DEFAULT, name);
  TORCH_CHECK(sym != nullptr, "tdist: the HIP runtime has no ", name);
  return sym;
}

void copyHostToDevice(void* dst, const void* src, size_t bytes, void* stream) {
  // (hipMemcpyHtoDAsync stages pageable host memory before it returns, as CUDA's does)
  check(hipMemcpyHtoDAsync(dst, const_cast<void*>(src), bytes, asStream(stream)),
        "hipMemcpyHtoDAsync");
}

uint64_t captureId(const c10::Stream& stream) {
  if (stream.device_type() != c10::DeviceType::CUDA) { // (a ROCm torch names its GPUs cuda)
    return 0;
  }
  hipStreamCaptureStatus status = hipStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (hipStreamGetCaptureInfo(asStream(stream.native_handle()), &status, &id) != hipSuccess) {
    return UINT64_MAX; // the legacy stream while another stream captures: as a capture
  }
  return status == hipStreamCaptureStatusNone ? 0 : (id != 0 ? id : UINT64_MAX);
}

void relaxThreadCaptureMode() {
  hipStreamCaptureMode mode = hipStreamCaptureModeRelaxed;
  (void)hipThreadExchangeStreamCaptureMode(&mode);
}

namespace driver {

// (AMD GPUs have no programmatic dependent launch: the flag changes nothing)
void launchKernel(void* function, const std::array<unsigned, 3>& grid, unsigned threads,
                  unsigned sharedBytes, void* stream, void** params, bool) {
  check(
      hipModuleLaunchKernel(
          static_cast<hipFunction_t>(function),
          grid[0],
          grid[1],
          grid[2],
          threads,
          1,
          1,
          sharedBytes,
          asStream(stream),
          params,
          nullptr),
      "hipModuleLaunchKernel");
}

bool recordIfLoaded(void* event, void* stream) {
  check(hipEventRecord(asEvent(event), asStream(stream)), "hipEventRecord");
  return true;
}

void* eventCreate() {
  hipEvent_t event = nullptr;
  check(hipEventCreateWithFlags(&event, hipEventDisableTiming), "hipEventCreateWithFlags");
  return event;
}

void eventDestroy(void* event) {
  (void)hipEventDestroy(asEvent(event));
}

void eventRecord(void* event, void* stream) {
  check(hipEventRecord(asEvent(event), asStream(stream)), "hipEventRecord");
}

void streamWaitEvent(void* stream, void* event) {
  check(hipStreamWaitEvent(asStream(stream), asEvent(event), 0), "hipStreamWaitEvent");
}

void memcpyAsync(uintptr_t dst, uintptr_t src, size_t bytes, void* stream) {
  check(
      hipMemcpyAsync(
          reinterpret_cast<void*>(dst),
          reinterpret_cast<const void*>(src),
          bytes,
          hipMemcpyDefault,
          asStream(stream)),
      "hipMemcpyAsync");
}

void memsetD32Async(uintptr_t dst, unsigned value, size_t count, void* stream) {
  check(
      hipMemsetD32Async(
          reinterpret_cast<hipDeviceptr_t>(dst), static_cast<int>(value), count, asStream(stream)),
      "hipMemsetD32Async");
}

void streamWriteValue64(void* stream, uintptr_t address, uint64_t value) {
  check(
      hipStreamWriteValue64(asStream(stream), reinterpret_cast<void*>(address), value, 0),
      "hipStreamWriteValue64");
}

void graphLaunch(void* graphExec, void* stream) {
  check(hipGraphLaunch(static_cast<hipGraphExec_t>(graphExec), asStream(stream)), "hipGraphLaunch");
}

} // namespace driver

} // namespace tdist

#else // CUDA

namespace tdist {

namespace {

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

using Ptr = unsigned long long; // CUdeviceptr
using MemcpyAsync = int (*)(Ptr dst, Ptr src, size_t bytes, void* stream);
using MemsetD32Async = int (*)(Ptr dst, unsigned value, size_t count, void* stream);
using WriteValue64 = int (*)(void* stream, Ptr address, uint64_t value, unsigned flags);
using EventRecord = int (*)(void* event, void* stream);
using WaitEvent = int (*)(void* stream, void* event, unsigned flags);
using EventCreate = int (*)(void** event, unsigned flags);
using EventDestroy = int (*)(void* event);
using GraphLaunch = int (*)(void* graphExec, void* stream);

// What a stream program calls.
struct StreamDriver {
  MemcpyAsync memcpyAsync;
  MemsetD32Async memsetD32Async;
  WriteValue64 writeValue64;
  EventRecord eventRecord;
  WaitEvent waitEvent;
  EventCreate eventCreate;
  EventDestroy eventDestroy;
  GraphLaunch graphLaunch;
};

const StreamDriver& streamDriver() {
  static const StreamDriver d = [] {
    StreamDriver d{};
    d.memcpyAsync = reinterpret_cast<MemcpyAsync>(driverSymbol("cuMemcpyAsync"));
    d.memsetD32Async = reinterpret_cast<MemsetD32Async>(driverSymbol("cuMemsetD32Async"));
    // (what cuda.h's cuStreamWriteValue64 names since CUDA 11.7)
    d.writeValue64 = reinterpret_cast<WriteValue64>(driverSymbol("cuStreamWriteValue64_v2"));
    d.eventRecord = reinterpret_cast<EventRecord>(driverSymbol("cuEventRecord"));
    d.waitEvent = reinterpret_cast<WaitEvent>(driverSymbol("cuStreamWaitEvent"));
    d.eventCreate = reinterpret_cast<EventCreate>(driverSymbol("cuEventCreate"));
    d.eventDestroy = reinterpret_cast<EventDestroy>(driverSymbol("cuEventDestroy_v2"));
    d.graphLaunch = reinterpret_cast<GraphLaunch>(driverSymbol("cuGraphLaunch"));
    return d;
  }();
  return d;
}

void check(int rc, const char* call) {
  TORCH_CHECK(rc == 0, "tdist: ", call, " failed with CUDA error ", rc);
}

constexpr unsigned kEventDisableTiming = 2; // CU_EVENT_DISABLE_TIMING

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

namespace driver {

void launchKernel(
    void* function,
    const std::array<unsigned, 3>& grid,
    unsigned threads,
    unsigned sharedBytes,
    void* stream,
    void** params,
    bool dependentLaunch) {
  if (dependentLaunch) {
    LaunchAttribute attr{};
    attr.id = kAttributeProgrammaticStreamSerialization;
    attr.value.programmaticStreamSerializationAllowed = 1;
    LaunchConfig config{grid[0], grid[1], grid[2], threads, 1, 1, sharedBytes, stream, &attr, 1};
    int rc = driverLaunchEx()(&config, function, params, nullptr);
    TORCH_CHECK(rc == 0, "tdist: cuLaunchKernelEx failed with CUDA error ", rc);
    return;
  }
  int rc = driverLaunch()(
      function,
      grid[0],
      grid[1],
      grid[2],
      threads,
      1,
      1,
      sharedBytes,
      stream,
      params,
      nullptr);
  TORCH_CHECK(rc == 0, "tdist: cuLaunchKernel failed with CUDA error ", rc);
}

bool recordIfLoaded(void* event, void* stream) {
  static EventRecord driverRecord = []() -> EventRecord {
    try {
      return reinterpret_cast<EventRecord>(driverSymbol("cuEventRecord"));
    } catch (const c10::Error&) {
      return nullptr; // no CUDA driver (a ROCm build of torch)
    }
  }();
  if (driverRecord == nullptr) {
    return false;
  }
  int rc = driverRecord(event, stream);
  TORCH_CHECK(rc == 0, "tdist: cuEventRecord failed with CUDA error ", rc);
  return true;
}

void* eventCreate() {
  void* event = nullptr;
  check(streamDriver().eventCreate(&event, kEventDisableTiming), "cuEventCreate");
  return event;
}

void eventDestroy(void* event) {
  streamDriver().eventDestroy(event);
}

void eventRecord(void* event, void* stream) {
  check(streamDriver().eventRecord(event, stream), "cuEventRecord");
}

void streamWaitEvent(void* stream, void* event) {
  check(streamDriver().waitEvent(stream, event, 0), "cuStreamWaitEvent");
}

void memcpyAsync(uintptr_t dst, uintptr_t src, size_t bytes, void* stream) {
  check(streamDriver().memcpyAsync(dst, src, bytes, stream), "cuMemcpyAsync");
}

void memsetD32Async(uintptr_t dst, unsigned value, size_t count, void* stream) {
  check(streamDriver().memsetD32Async(dst, value, count, stream), "cuMemsetD32Async");
}

void streamWriteValue64(void* stream, uintptr_t address, uint64_t value) {
  check(streamDriver().writeValue64(stream, address, value, 0), "cuStreamWriteValue64");
}

void graphLaunch(void* graphExec, void* stream) {
  check(streamDriver().graphLaunch(graphExec, stream), "cuGraphLaunch");
}

} // namespace driver

} // namespace tdist

#endif // USE_ROCM
