"""CUDA through cuda-python (``cuda.bindings``): the one module that imports it.

The CUDA transports (``cuda_ipc``, ``nvshmem``) take their runtime calls from here, and
``torch_tdist.stream_ops`` its driver calls (:class:`CudaStreamOps`). Imports happen inside
functions, so the package imports on machines without cuda-python; :func:`require` says what to
install.
"""

from __future__ import annotations

import torch

from .base import StreamOps, TransportUnavailable

INSTALL = 'pip install "torch-tdist[cuda]" ("torch-tdist[cuda12]" with CUDA 12), or pip install cuda-python'


def require(transport: str):
    """Raise :class:`TransportUnavailable` naming ``transport`` and the fix when cuda-python's
    bindings cannot be imported."""
    try:
        from cuda.bindings import driver, runtime  # noqa: F401
    except ImportError as err:
        raise TransportUnavailable(
            f"tdist: transport {transport!r} cannot start: it needs cuda-python, which cannot be "
            f"imported here ({err}); {INSTALL}") from err


def runtime(device: torch.device):
    """``cuda.bindings.runtime``, with ``device`` made current."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as err:
        raise RuntimeError(f"tdist: the cuda transport needs cuda-python ({INSTALL})") from err
    check(cudart.cudaSetDevice(device.index), "cudaSetDevice")
    return cudart


def check(result, call: str):
    """The value of a runtime call's result; raises naming ``call`` when it failed."""
    from cuda.bindings import runtime as cudart

    err, *value = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"tdist: {call} failed: {cudart.cudaGetErrorString(err)[1].decode()}")
    return value[0] if value else None


class CudaArray:
    """Lets torch wrap raw device memory without copying (``__cuda_array_interface__``)."""

    def __init__(self, address: int, nbytes: int, device: torch.device):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


def map_host_page(address: int, nbytes: int, device: torch.device) -> int:
    """Pin host memory at ``address`` and map it for ``device``; returns its device address."""
    cudart = runtime(device)
    check(cudart.cudaHostRegister(address, nbytes, cudart.cudaHostRegisterMapped), "cudaHostRegister")
    return int(check(cudart.cudaHostGetDevicePointer(address, 0), "cudaHostGetDevicePointer"))


def unmap_host_page(address: int, device: torch.device):
    runtime(device).cudaHostUnregister(address)


def total_memory(device_index: int | None = None) -> int:
    """Bytes of memory of a GPU (default: the current one)."""
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).total_memory


class CudaStreamOps(StreamOps):
    """The driver calls (``cuStreamWriteValue64`` with its memory barrier, ``cuMemcpyAsync``,
    events), a few microseconds of host time each; CUDA graphs capture them."""

    def __init__(self):
        self._cu = None  # cuda.bindings.driver, imported on the first call (once, not per call)

    def _driver(self):
        if self._cu is None:
            try:
                from cuda.bindings import driver
            except ImportError as err:
                raise RuntimeError(f"tdist: CUDA stream calls need cuda-python ({INSTALL})") from err
            self._cu = driver
        return self._cu

    def _check(self, result, call: str):
        cu = self._cu
        err, *value = result if isinstance(result, tuple) else (result,)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"tdist: {call} failed: {cu.cuGetErrorString(err)[1]}")
        return value[0] if value else None

    def stream(self, torch_stream):
        return self._driver().CUstream(torch_stream.cuda_stream)

    def event(self):
        cu = self._driver()
        return self._check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def wait_after(self, waiter, waited, event):
        cu = self._driver()
        self._check(cu.cuEventRecord(event, waited), "cuEventRecord")
        self._check(cu.cuStreamWaitEvent(waiter, event, 0), "cuStreamWaitEvent")

    def copy(self, stream, dst: int, src: int, nbytes: int):
        self._check(self._driver().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")

    def zero32(self, stream, address: int, words: int):
        self._check(self._driver().cuMemsetD32Async(address, 0, words, stream), "cuMemsetD32Async")

    def write_value(self, stream, address: int, value: int):
        self._check(self._driver().cuStreamWriteValue64(stream, address, value, 0), "cuStreamWriteValue64")


STREAM_OPS = CudaStreamOps()
