"""The ``hip`` transport: device memory shared within a node through HIP IPC (hip-python), the
AMD counterpart of ``cuda``; a segment's handle carries HIP's IPC handle, passed through the
group's store.

A ROCm build of PyTorch names its GPUs ``cuda`` devices, so this transport serves ``cuda``
tensors, and the registry picks it (not ``cuda``) when ``torch.version.hip`` is set.

What a peer can check before it maps anything is plain Python here (:func:`pack_handle`,
:func:`unpack_handle`, :func:`check_arch`, the checks of :meth:`HipIpcTransport.check_available`),
run by the CPU tests; the HIP runtime calls are in ``hip_device``, and no AMD GPU has run them.
"""

from __future__ import annotations

import socket
import struct

import torch

from .. import language
from . import hip_device
from .base import Transport, TransportUnavailable
from .cuda_ipc import CudaIpcTransport, CudaSegment

TAG = b"tdisthip"
IPC_HANDLE_BYTES = 64  # (HIP_IPC_HANDLE_SIZE)
# A segment's handle: TAG, the segment's bytes, its owner's host name (UTF-8, NUL-padded), then
# HIP's IPC handle. The first three let a peer refuse a segment it cannot or must not map.
HANDLE = struct.Struct(f"<8sQ64s{IPC_HANDLE_BYTES}s")


def _host(host: str | None) -> bytes:
    return (socket.gethostname() if host is None else host).encode()[:64].ljust(64, b"\0")


def pack_handle(ipc_handle: bytes, nbytes: int, host: str | None = None) -> bytes:
    """The handle of a segment of ``nbytes`` whose HIP IPC handle is ``ipc_handle``, made on
    ``host`` (None: this one)."""
    if len(ipc_handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"tdist: a HIP IPC handle has {IPC_HANDLE_BYTES} bytes, not {len(ipc_handle)}")
    return HANDLE.pack(TAG, nbytes, _host(host), ipc_handle)


def unpack_handle(handle: bytes, nbytes: int, host: str | None = None) -> bytes:
    """The HIP IPC handle in a peer's segment ``handle``, once it is known to be a hip
    transport's segment of ``nbytes`` (this rank's heap size) made on ``host`` (None: this one)."""
    if len(handle) != HANDLE.size or not handle.startswith(TAG):
        raise ValueError(
            f"tdist: transport 'hip': a peer's segment handle is not one of the hip transport "
            f"({len(handle)} bytes, beginning {handle[:len(TAG)]!r}); every rank of a group must "
            f"use the same transport (TDIST_TRANSPORT) on a ROCm build of PyTorch")
    _, size, owner_host, ipc_handle = HANDLE.unpack(handle)
    if size != nbytes:
        raise ValueError(
            f"tdist: transport 'hip': a peer's segment has {size} bytes and this rank's heap "
            f"{nbytes}; every rank must use the same TDIST_HEAP_SIZE (or backend option 'heap_size')")
    if owner_host != _host(host):
        owner, here = (name.rstrip(b"\0").decode(errors="replace") for name in (owner_host, _host(host)))
        raise ValueError(
            f"tdist: transport 'hip': a peer's segment is on host {owner!r}, this rank on "
            f"{here!r}; HIP IPC maps the GPUs of one node: use TDIST_TRANSPORT=auto for groups "
            f"that span nodes")
    return ipc_handle


def check_arch(arch: str):
    """Raise ValueError when a GPU's architecture (``gcnArchName``, e.g. gfx942:sramecc+:xnack-)
    is not one the kernels are built for (``language.AMD_ARCHS``)."""
    language.check_amd_arch(arch.split(":")[0])


class HipSegment(CudaSegment):
    """Device memory from ``hipMalloc``, shared through HIP IPC; torch reads it through the
    CUDA array interface, as on CUDA."""

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> "HipSegment":
        address = hip_device.malloc(nbytes, device)
        try:
            segment = cls(address, nbytes, device, owned=True)
            segment.handle = pack_handle(hip_device.ipc_handle(address, device), nbytes)
        except BaseException:
            hip_device.free(address, device)
            raise
        return segment

    @classmethod
    def open(cls, handle: bytes, nbytes: int, device: torch.device) -> "HipSegment":
        address = hip_device.open_ipc_handle(unpack_handle(handle, nbytes), device)
        return cls(address, nbytes, device, owned=False)

    def _release(self):
        if self._owned:
            hip_device.free(self._address, self.device)
        else:
            hip_device.close_ipc_handle(self._address, self.device)


class HipIpcTransport(CudaIpcTransport):
    """HIP IPC between the AMD GPUs of one node (xGMI or PCIe P2P)."""

    name = "hip"
    segment_type = HipSegment
    device = hip_device

    def check_available(self, device_type: str, heap_bytes: int | None = None):
        if not torch.version.hip:
            raise hip_device.rocm_build_missing(self.name)
        Transport.check_available(self, device_type, heap_bytes)  # (not CUDA's checks)
        if not torch.cuda.is_available():
            raise TransportUnavailable(
                f"tdist: transport {self.name!r} cannot start: torch sees no AMD GPU here "
                f"(HIP_VISIBLE_DEVICES or ROCR_VISIBLE_DEVICES may hide them); use "
                f"TDIST_TRANSPORT=shm with CPU tensors")
        hip_device.require(self.name)
        index = torch.cuda.current_device()
        check_arch(hip_device.gpu_arch(index))
        if heap_bytes is not None and heap_bytes > (free := hip_device.free_memory(index)):
            raise TransportUnavailable(
                f"tdist: transport {self.name!r} cannot start: a heap of {heap_bytes} bytes per "
                f"rank is larger than the GPU's free memory ({free} bytes); lower "
                f"TDIST_HEAP_SIZE (or the backend option 'heap_size')")

