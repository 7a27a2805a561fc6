// The device driver as the backend uses it: every driver call in csrc/ goes
// through these functions (the NVSHMEM host library has its own loader,
// nvshmem_bootstrap.cpp). On NVIDIA they are the CUDA driver's, from the
// library torch loaded, opened at run time, so the extension builds without a
// CUDA toolkit and with CPU torch. On a ROCm build of torch (USE_ROCM) they are
// the HIP runtime's (device_shim.cpp's HIP branch); handles are then HIP's.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include <c10/core/Stream.h>

namespace tdist {

// A symbol of the CUDA driver library torch loaded (taken at run time, so the
// extension builds without a CUDA toolkit); of the HIP runtime on ROCm.
void* driverSymbol(const char* name);

// Copies `bytes` of pageable host memory to device memory on `stream` (a native
// stream handle); the driver stages them before it returns, so `src` may go then.
void copyHostToDevice(void* dst, const void* src, size_t bytes, void* stream);

// The id of the CUDA graph capture `stream` is in, 0 when none.
uint64_t captureId(const c10::Stream& stream);

// Lets the calling thread query events while other threads capture graphs.
void relaxThreadCaptureMode();

// Driver calls on native handles (CUfunction, CUstream, CUevent; their HIP
// counterparts on ROCm) and device addresses; each raises "tdist: <call> failed
// with CUDA error <rc>" (HIP error on ROCm).
namespace driver {

// cuLaunchKernel with `threads` threads a block, or cuLaunchKernelEx with
// programmatic dependent launch allowed (hipModuleLaunchKernel on ROCm, where
// there is no dependent launch).
void launchKernel(
    void* function,
    const std::array<unsigned, 3>& grid,
    unsigned threads,
    unsigned sharedBytes,
    void* stream,
    void** params,
    bool dependentLaunch);

// cuEventRecord (hipEventRecord on ROCm) for an event c10 created; false, with
// nothing recorded, when no CUDA driver is loaded.
bool recordIfLoaded(void* event, void* stream);

// What a replayed stream program (stream_program.hpp) queues. Their symbols
// are taken together on first use.
void* eventCreate(); // without timing
void eventDestroy(void* event); // no error: at exit the context may be gone
void eventRecord(void* event, void* stream);
void streamWaitEvent(void* stream, void* event);
void memcpyAsync(uintptr_t dst, uintptr_t src, size_t bytes, void* stream);
void memsetD32Async(uintptr_t dst, unsigned value, size_t count, void* stream);
void streamWriteValue64(void* stream, uintptr_t address, uint64_t value);
// cuGraphLaunch (hipGraphLaunch on ROCm) of an instantiated graph torch captured
// (torch.cuda.CUDAGraph.raw_cuda_graph_exec()).
void graphLaunch(void* graphExec, void* stream);

} // namespace driver

} // namespace tdist
