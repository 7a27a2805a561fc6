"""The ``nvshmem`` transport: the heap is one ``nvshmem_malloc`` of NVSHMEM, bootstrapped by the
C++ backend through the group's store; P2P peers are mapped with ``nvshmem_ptr``, and kernels
reach other nodes with the NVSHMEM calls of ``torch_tdist.shmem_device``.

NVSHMEM's host library and device bitcode come from the ``nvidia-nvshmem-cu13`` (or ``-cu12``)
wheel, the one torch's own symmetric memory loads; this module is the one that looks for it.
"""

from __future__ import annotations

import ctypes
import glob
import os
from datetime import timedelta

import torch

from . import cuda_device
from .base import TransportUnavailable, wait_for_peers
from .cuda_ipc import CudaIpcTransport, CudaSegment

INSTALL = ('pip install "torch-tdist[cuda]" (or pip install nvidia-nvshmem-cu13; with CUDA 12: '
           'pip install "torch-tdist[cuda12]" or nvidia-nvshmem-cu12)')


class NvshmemSegment(CudaSegment):
    """A heap from ``nvshmem_malloc`` (own) or its mapping on a P2P peer (``nvshmem_ptr``)."""

    @classmethod
    def allocate(cls, store, key: str, rank: int, world_size: int, nbytes: int,
                 device: torch.device, timeout: timedelta) -> list:
        """Every rank of a group that spans the whole job calls it, in the same order."""
        from .. import _C

        cuda_device.runtime(device)  # NVSHMEM binds to the current device
        _, my_pe, n_pes = _C.nvshmem_bootstrap(store, f"{key}/nvshmem", rank, world_size,
                                               host_library())
        if (my_pe, n_pes) != (rank, world_size):
            raise ValueError(
                f"tdist: the nvshmem transport serves groups that span every process of the "
                f"job in rank order (NVSHMEM has {n_pes} PEs, this is PE {my_pe}); this group "
                f"has {world_size} ranks and this is rank {rank}. Use TDIST_TRANSPORT=cuda "
                f"for subgroups")
        address = _C.nvshmem_malloc(nbytes)
        if not address:
            raise MemoryError(
                f"tdist: nvshmem_malloc({nbytes}) failed: the heap does not fit in NVSHMEM's "
                f"symmetric memory; lower TDIST_HEAP_SIZE or raise NVSHMEM_SYMMETRIC_SIZE "
                f"(before NVSHMEM starts)")
        cuda_device.check(cuda_device.runtime(device).cudaMemset(address, 0, nbytes), "cudaMemset")
        cuda_device.check(cuda_device.runtime(device).cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        store.set(f"{key}/zeroed/{rank}", "1")  # no peer writes here before the zeros land
        wait_for_peers(store, f"{key}/zeroed", world_size, timeout, "zero its NVSHMEM heap")
        segments = []
        for peer in range(world_size):
            mapped = address if peer == rank else _C.nvshmem_ptr(address, peer)
            if not mapped:
                raise RuntimeError(
                    f"tdist: nvshmem transport: rank {peer} is not reachable by P2P from rank "
                    f"{rank} (another node); tdist's collectives need P2P peers for now, and "
                    f"kernels reach other nodes through torch_tdist.shmem_device")
            segments.append(cls(mapped, nbytes, device, owned=peer == rank))
        return segments

    def _release(self):
        if self._owned:
            from .. import _C

            _C.nvshmem_free(self._address)  # collective, like the malloc


def host_library() -> str:
    """Path of NVSHMEM's host library: the nvidia-nvshmem wheel's, else the loader's search."""
    try:
        import nvidia.nvshmem as wheel

        for root in wheel.__path__:
            found = sorted(glob.glob(os.path.join(root, "lib", "libnvshmem_host.so*")))
            if found:
                return found[0]
    except ImportError:
        pass
    return "libnvshmem_host.so.3"


def device_library(arch: int = 90) -> str:
    """Path of NVSHMEM's device bitcode (the nvidia-nvshmem wheel's): the one built for
    ``arch`` (compute capability as 90) where the wheel ships one per architecture."""
    try:
        import nvidia.nvshmem as wheel

        for root in wheel.__path__:
            for name in (f"libnvshmem_device_sm_{arch}.bc", "libnvshmem_device.bc"):
                found = os.path.join(root, "lib", name)
                if os.path.exists(found):
                    return found
    except ImportError:
        pass
    raise RuntimeError(
        "tdist: kernels with NVSHMEM calls need libnvshmem_device.bc from the "
        "nvidia-nvshmem-cu12/cu13 wheel (pip install nvidia-nvshmem-cu13)")


class NvshmemTransport(CudaIpcTransport):
    """NVSHMEM's symmetric heap: one node or several (the C++ backend bootstraps NVSHMEM)."""

    name = "nvshmem"
    collective = True  # nvshmem_malloc and nvshmem_free are collective over the job's PEs
    segment_type = None  # (no create/open: allocate_symmetric)

    def check_available(self, device_type: str, heap_bytes: int | None = None):
        super().check_available(device_type, heap_bytes)
        path = host_library()
        try:
            # what the C++ bootstrap does later (the same flags: one copy of the library per process)
            ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        except OSError as err:
            raise TransportUnavailable(
                f"tdist: transport 'nvshmem' cannot start: NVSHMEM's host library ({path}) "
                f"cannot be loaded ({err}); {INSTALL}, or use TDIST_TRANSPORT=cuda within a "
                f"node") from err

    def allocate_symmetric(self, store, key: str, rank: int, world_size: int, nbytes: int,
                           device: torch.device, timeout: timedelta) -> list:
        return NvshmemSegment.allocate(store, key, rank, world_size, nbytes, device, timeout)
