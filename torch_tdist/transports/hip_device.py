"""HIP through hip-python (``from hip import hip``): the one module that imports it.

The ``hip`` transport (``hip_ipc``) takes its runtime calls from here, and
``torch_tdist.stream_ops`` its stream calls on a ROCm build of PyTorch (:class:`HipStreamOps`).
hip-python's calls return tuples whose first item is the ``hipError_t`` (:func:`check`).
Imports happen inside functions, so the package imports on machines without hip-python;
:func:`require` says what to install. No AMD GPU has run these calls yet: the CPU tests cover
the transport's host logic only (``tests/test_transports.py``).
"""

from __future__ import annotations

import ctypes

import torch

from .base import StreamOps, TransportUnavailable

INSTALL = 'pip install -e ".[rocm]" (or pip install hip-python, the version of your ROCm)'
TORCH_INSTALL = ("a ROCm build of PyTorch (pytorch.org's ROCm wheels: pip install torch "
                 "--index-url https://download.pytorch.org/whl/rocmX.Y, your ROCm's X.Y)")
RUNTIME_LIBRARY = "libamdhip64.so"  # (the name hip-python opens)
_U64 = (1 << 64) - 1


def rocm_build_missing(transport: str) -> TransportUnavailable:
    """The error of a ROCm transport asked for on a torch that is not a ROCm build."""
    build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
    return TransportUnavailable(
        f"tdist: transport {transport!r} cannot start: it needs a ROCm build of PyTorch "
        f"(torch.version.hip), and this torch {torch.__version__} is {build}; install "
        f"{TORCH_INSTALL}, then {INSTALL}")


def require(transport: str):
    """Raise :class:`TransportUnavailable` naming ``transport`` and the fix when hip-python
    cannot be imported, or HIP's runtime library (which hip-python opens by name) not loaded."""
    try:
        from hip import hip  # noqa: F401
    except ImportError as err:
        raise TransportUnavailable(
            f"tdist: transport {transport!r} cannot start: it needs hip-python, which cannot be "
            f"imported here ({err}); {INSTALL}") from err
    try:
        ctypes.CDLL(RUNTIME_LIBRARY)
    except OSError as err:
        raise TransportUnavailable(
            f"tdist: transport {transport!r} cannot start: hip-python opens HIP's runtime "
            f"library as {RUNTIME_LIBRARY}, which cannot be loaded ({err}); install ROCm and "
            f"put its lib directory (/opt/rocm/lib) on LD_LIBRARY_PATH") from err


def runtime(device: torch.device):
    """hip-python's ``hip`` module, with ``device`` made current."""
    try:
        from hip import hip
    except ImportError as err:
        raise RuntimeError(f"tdist: the hip transport needs hip-python ({INSTALL})") from err
    check(hip.hipSetDevice(device.index), "hipSetDevice")
    return hip


def check(result, call: str):
    """The value of a call's result tuple ``(err, value...)``; raises naming ``call`` when
    it failed."""
    from hip import hip

    err, *value = result if isinstance(result, tuple) else (result,)
    if err != hip.hipError_t.hipSuccess:
        raise RuntimeError(f"tdist: {call} failed: {hip.hipGetErrorString(err)[1].decode()}")
    return value[0] if value else None


def malloc(nbytes: int, device: torch.device) -> int:
    """``nbytes`` of zeroed device memory (``hipMalloc``); its address."""
    hip = runtime(device)
    address = int(check(hip.hipMalloc(nbytes), "hipMalloc"))
    check(hip.hipMemset(address, 0, nbytes), "hipMemset")
    return address


def free(address: int, device: torch.device):
    runtime(device).hipFree(address)


def ipc_handle(address: int, device: torch.device) -> bytes:
    """The IPC handle of the allocation at ``address`` (``hipIpcGetMemHandle``), as bytes."""
    handle = check(runtime(device).hipIpcGetMemHandle(address), "hipIpcGetMemHandle")
    return ctypes.string_at(int(handle), handle.c_sizeof())


def open_ipc_handle(handle: bytes, device: torch.device) -> int:
    """Map a peer's allocation from its IPC handle bytes; the address it sits at here."""
    hip = runtime(device)
    address = check(hip.hipIpcOpenMemHandle(bytearray(handle), hip.hipIpcMemLazyEnablePeerAccess),
                    "hipIpcOpenMemHandle (are the GPUs peer-to-peer capable, on one node?)")
    return int(address)


def close_ipc_handle(address: int, device: torch.device):
    runtime(device).hipIpcCloseMemHandle(address)


def map_host_page(address: int, nbytes: int, device: torch.device) -> int:
    """Pin host memory at ``address`` and map it for ``device``; returns its device address."""
    hip = runtime(device)
    check(hip.hipHostRegister(address, nbytes, hip.hipHostRegisterMapped), "hipHostRegister")
    return int(check(hip.hipHostGetDevicePointer(address, 0), "hipHostGetDevicePointer"))


def unmap_host_page(address: int, device: torch.device):
    runtime(device).hipHostUnregister(address)


def free_memory(device_index: int | None = None) -> int:
    """Bytes of memory free now on a GPU (default: the current one)."""
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.mem_get_info(index)[0]


def gpu_arch(device_index: int | None = None) -> str:
    """A GPU's architecture as torch reports it (``gcnArchName``, e.g. gfx942:sramecc+:xnack-)."""
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).gcnArchName


class HipStreamOps(StreamOps):
    """The HIP calls (``hipStreamWriteValue64``, written once the stream's earlier commands
    completed; ``hipMemcpyAsync``; ``hipMemsetD32Async``; events). A ROCm torch's streams are
    HIP streams, so ``torch_stream.cuda_stream`` is the ``hipStream_t``."""

    def __init__(self):
        self._hip = None  # hip-python's hip module, imported on the first call (once, not per call)

    def _runtime(self):
        if self._hip is None:
            try:
                from hip import hip
            except ImportError as err:
                raise RuntimeError(f"tdist: HIP stream calls need hip-python ({INSTALL})") from err
            self._hip = hip
        return self._hip

    def stream(self, torch_stream):
        return self._runtime().ihipStream_t.fromObj(torch_stream.cuda_stream)

    def event(self):
        hip = self._runtime()
        return check(hip.hipEventCreateWithFlags(hip.hipEventDisableTiming), "hipEventCreateWithFlags")

    def wait_after(self, waiter, waited, event):
        hip = self._runtime()
        check(hip.hipEventRecord(event, waited), "hipEventRecord")
        check(hip.hipStreamWaitEvent(waiter, event, 0), "hipStreamWaitEvent")

    def copy(self, stream, dst: int, src: int, nbytes: int):
        hip = self._runtime()
        check(hip.hipMemcpyAsync(dst, src, nbytes, hip.hipMemcpyKind.hipMemcpyDefault, stream),
              "hipMemcpyAsync")

    def zero32(self, stream, address: int, words: int):
        check(self._runtime().hipMemsetD32Async(address, 0, words, stream), "hipMemsetD32Async")

    def write_value(self, stream, address: int, value: int):
        # (the binding takes the value unsigned: the same 64 bits)
        check(self._runtime().hipStreamWriteValue64(stream, address, value & _U64, 0),
              "hipStreamWriteValue64")


STREAM_OPS = HipStreamOps()
