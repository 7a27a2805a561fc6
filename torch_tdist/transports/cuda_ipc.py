"""The ``cuda`` transport: device memory shared within a node through CUDA IPC (cuda-python);
a segment's handle is its IPC handle, passed through the group's store."""

from __future__ import annotations

import torch

from . import cuda_device
from .base import Segment, Transport, TransportUnavailable


class CudaSegment(Segment):
    """Device memory shared through CUDA IPC (cuda-python); its handle is the IPC handle."""

    def __init__(self, address: int, nbytes: int, device: torch.device, owned: bool):
        self._address, self._owned, self.device = address, owned, device
        self.bytes = torch.as_tensor(cuda_device.CudaArray(address, nbytes, device), device=device)

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> "CudaSegment":
        cudart = cuda_device.runtime(device)
        address = cuda_device.check(cudart.cudaMalloc(nbytes), "cudaMalloc")
        cuda_device.check(cudart.cudaMemset(address, 0, nbytes), "cudaMemset")
        segment = cls(address, nbytes, device, owned=True)
        segment.handle = bytes(cuda_device.check(cudart.cudaIpcGetMemHandle(address), "cudaIpcGetMemHandle").reserved)
        return segment

    @classmethod
    def open(cls, handle: bytes, nbytes: int, device: torch.device) -> "CudaSegment":
        cudart = cuda_device.runtime(device)
        ipc = cudart.cudaIpcMemHandle_t()
        ipc.reserved = handle
        address = cuda_device.check(cudart.cudaIpcOpenMemHandle(ipc, cudart.cudaIpcMemLazyEnablePeerAccess),
                                    "cudaIpcOpenMemHandle (are the GPUs peer-to-peer capable?)")
        return cls(address, nbytes, device, owned=False)

    def close(self):
        if self.bytes is None:
            return
        self.bytes = None
        torch.cuda.synchronize(self.device)
        self._release()

    def _release(self):
        cudart = cuda_device.runtime(self.device)
        if self._owned:
            cudart.cudaFree(self._address)
        else:
            cudart.cudaIpcCloseMemHandle(self._address)


class CudaIpcTransport(Transport):
    """CUDA IPC between the GPUs of one node (NVLink or PCIe P2P)."""

    name = "cuda"
    device_types = ("cuda",)
    segment_type = CudaSegment
    device = cuda_device  # the module of the vendor's calls (hip_ipc's transport names its own)

    def check_available(self, device_type: str, heap_bytes: int | None = None):
        super().check_available(device_type, heap_bytes)
        if not torch.cuda.is_available():
            raise TransportUnavailable(
                f"tdist: transport {self.name!r} cannot start: torch sees no CUDA device here; "
                f"use TDIST_TRANSPORT=shm with CPU tensors")
        cuda_device.require(self.name)
        if heap_bytes is not None and heap_bytes > cuda_device.total_memory():
            raise TransportUnavailable(
                f"tdist: transport {self.name!r} cannot start: a heap of {heap_bytes} bytes per "
                f"rank is larger than the GPU ({cuda_device.total_memory()} bytes); lower "
                f"TDIST_HEAP_SIZE (or the backend option 'heap_size')")

    def forget(self, handle: bytes):
        pass  # an IPC handle names nothing that outlives its process

    def map_host_page(self, address: int, nbytes: int, device: torch.device) -> int:
        return self.device.map_host_page(address, nbytes, device)

    def unmap_host_page(self, address: int, device: torch.device):
        self.device.unmap_host_page(address, device)

    def stream_ops(self):
        return self.device.STREAM_OPS
