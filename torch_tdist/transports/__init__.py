"""Symmetric-heap transports behind one interface (``base.Transport``), found by name.

``TDIST_TRANSPORT`` (or the backend option ``transport``) names one of :func:`names`, or
``auto``: ``shm`` for CPU tensors; for CUDA tensors ``cuda``, or ``nvshmem`` when the group's
ranks are on several hosts. A new transport is a module here and one line in ``_REGISTRY``.
"""

from __future__ import annotations

import importlib

import torch

from .base import PeersMissing, Segment, StreamOps, Transport, TransportUnavailable, wait_for_peers

__all__ = ["PeersMissing", "Segment", "StreamOps", "Transport", "TransportUnavailable", "wait_for_peers",
           "names", "get", "resolve",
           "check_available", "stream_ops"]

# name -> "module:class"; modules are imported when their transport is first asked for
_REGISTRY = {
    "shm": "shm:ShmTransport",
    "cuda": "cuda_ipc:CudaIpcTransport",
    "nvshmem": "nvshmem:NvshmemTransport",
}
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


def _serving(device_type: str) -> list[str]:
    return [name for name in _REGISTRY if device_type in get(name).device_types]


def resolve(name: str, device_type: str, spans_nodes: bool = False) -> str:
    """The transport that serves tensors of ``device_type`` (``name`` as the user chose it;
    ``auto`` picks NVSHMEM for a CUDA group whose ranks are on several hosts)."""
    wanted = _serving(device_type)
    if not wanted:
        raise ValueError(f"tdist: no symmetric-heap transport for {device_type} tensors")
    if name == "auto":
        return "nvshmem" if device_type == "cuda" and spans_nodes else wanted[0]
    if name not in wanted:
        raise _cannot_serve(name, device_type, wanted)
    return name


def _cannot_serve(name: str, device_type: str, wanted: list[str], why: str = "") -> ValueError:
    return ValueError(f"tdist: transport {name!r} cannot serve {device_type} tensors{why}; "
                      f"use {' or '.join(wanted)} (TDIST_TRANSPORT)")


def check_available(name: str, device_type: str, heap_bytes: int | None = None):
    """Raise now if transport ``name`` (or ``auto``) cannot start for ``device_type`` tensors
    with a heap of ``heap_bytes`` per rank (None: the default): ValueError for a transport that
    does not serve the device, :class:`TransportUnavailable` for a missing package, device or
    room, each naming the transport, the reason and the fix. Allocates nothing.
    (``auto`` is checked as the transport it picks on one host; one that spans hosts and so
    picks ``nvshmem`` learns that at the heap's creation.)"""
    wanted = _serving(device_type)
    if name != "auto" and get(name).name not in wanted and device_type == "cpu" \
            and not torch.cuda.is_available():
        raise _cannot_serve(name, device_type, wanted,
                            " (torch sees no CUDA device here, so tdist's groups serve CPU tensors)")
    get(resolve(name, device_type)).check_available(device_type, heap_bytes)


def stream_ops(device_type: str) -> StreamOps | None:
    """The stream calls of ``device_type`` (None on the CPU)."""
    return get(resolve("auto", device_type)).stream_ops()
