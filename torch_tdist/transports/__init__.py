"""Symmetric-heap transports behind one interface (``base.Transport``), found by name.

``TDIST_TRANSPORT`` (or the backend option ``transport``) names one of :func:`names`, or
``auto``: ``shm`` for CPU tensors; for GPU tensors ``cuda`` (CUDA IPC), or ``nvshmem`` when the
group's ranks are on several hosts; on a ROCm build of PyTorch (``torch.version.hip``), whose GPU
tensors are ``cuda`` tensors too, ``hip`` (HIP IPC). A GPU transport serves one build of PyTorch
(``_GPU_TRANSPORTS``) and refuses the other. A new transport is a module here and one line in
``_REGISTRY``.
"""

from __future__ import annotations

import importlib

import torch

from .base import PeersMissing, Segment, StreamOps, Transport, TransportUnavailable, wait_for_peers

__all__ = ["PeersMissing", "Segment", "StreamOps", "Transport", "TransportUnavailable", "wait_for_peers",
           "names", "get", "resolve", "check_available", "stream_ops", "gpu_build"]

# name -> "module:class"; modules are imported when their transport is first asked for
_REGISTRY = {
    "shm": "shm:ShmTransport",
    "cuda": "cuda_ipc:CudaIpcTransport",
    "nvshmem": "nvshmem:NvshmemTransport",
    "hip": "hip_ipc:HipIpcTransport",
    "rocshmem": "rocshmem:RocshmemTransport",
}
# The GPU transports of each build of PyTorch: (within one host, across hosts). A transport
# named here serves that build's GPUs only; one named nowhere serves any build.
_GPU_TRANSPORTS = {"cuda": ("cuda", "nvshmem"), "rocm": ("hip", "rocshmem")}
_LOADED: dict[str, Transport] = {}


def names() -> tuple[str, ...]:
    """The registered transports' names, in registry order."""
    return tuple(_REGISTRY)


def get(name: str) -> Transport:
    """The transport registered as ``name``."""
    if name not in _LOADED:
        if name not in _REGISTRY:
            raise ValueError(f"tdist: unknown transport {name!r}; expected one of "
                             f"{', '.join(('auto',) + names())}")
        module, _, cls = _REGISTRY[name].partition(":")
        _LOADED[name] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return _LOADED[name]


def gpu_build() -> str:
    """The build of PyTorch here, as its GPU transports know it: ``rocm`` (``torch.version.hip``
    set) or ``cuda`` (CUDA and CPU-only builds)."""
    return "rocm" if torch.version.hip else "cuda"


def _build_of(name: str) -> str | None:
    return next((build for build, gpu in _GPU_TRANSPORTS.items() if name in gpu), None)


def _serving(device_type: str) -> list[str]:
    return [name for name in _REGISTRY if device_type in get(name).device_types
            and _build_of(name) in (None, gpu_build())]


def resolve(name: str, device_type: str, spans_nodes: bool = False) -> str:
    """The transport that serves tensors of ``device_type`` (``name`` as the user chose it;
    ``auto`` picks the build's across-hosts transport, NVSHMEM on CUDA, for a GPU group whose
    ranks are on several hosts)."""
    wanted = _serving(device_type)
    if not wanted:
        raise ValueError(f"tdist: no symmetric-heap transport for {device_type} tensors")
    if name == "auto":
        return _GPU_TRANSPORTS[gpu_build()][1] if device_type == "cuda" and spans_nodes else wanted[0]
    if name not in wanted:
        _refuse_other_build(name)
        raise _cannot_serve(name, device_type, wanted)
    return name


def _refuse_other_build(name: str):
    """Raise when ``name`` is a GPU transport of the other build of PyTorch: a ROCm one on a
    CUDA or CPU-only torch is unavailable (it names the build to install), a CUDA one on a ROCm
    torch cannot serve its GPUs."""
    build = _build_of(name)
    if build is None or build == gpu_build():
        return
    if build == "rocm":
        get(name).check_available("cuda")  # (it raises, saying what it needs)
    raise _cannot_serve(name, "cuda", _serving("cuda"), f" of a ROCm build of PyTorch (torch.version.hip "
                        f"{torch.version.hip})")


def _cannot_serve(name: str, device_type: str, wanted: list[str], why: str = "") -> ValueError:
    return ValueError(f"tdist: transport {name!r} cannot serve {device_type} tensors{why}; "
                      f"use {' or '.join(wanted)} (TDIST_TRANSPORT)")


def check_available(name: str, device_type: str, heap_bytes: int | None = None, spans_nodes: bool = False):
    """Raise now if transport ``name`` (or ``auto``) cannot start for ``device_type`` tensors
    with a heap of ``heap_bytes`` per rank (None: the default): ValueError for a transport that
    does not serve the device, :class:`TransportUnavailable` for a missing package, device or
    room, each naming the transport, the reason and the fix. Allocates nothing. ``auto`` is
    checked as the transport it picks for a group on several hosts (``spans_nodes``) or on one.
    A GPU transport of the other build of PyTorch than this one is refused, naming the build it
    needs."""
    wanted = _serving(device_type)
    if name != "auto" and get(name).name not in wanted:
        _refuse_other_build(name)
        if device_type == "cpu" and not torch.cuda.is_available():
            raise _cannot_serve(name, device_type, wanted,
                                " (torch sees no CUDA device here, so tdist's groups serve CPU tensors)")
    get(resolve(name, device_type, spans_nodes)).check_available(device_type, heap_bytes)


def stream_ops(device_type: str) -> StreamOps | None:
    """The stream calls of ``device_type`` (None on the CPU)."""
    return get(resolve("auto", device_type)).stream_ops()
