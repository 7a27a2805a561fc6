"""The ``rocshmem`` transport: the heap is one ``rocshmem_malloc`` of ROCSHMEM (AMD GPUs),
bootstrapped by the C++ backend through the group's store with a unique id, as the ``nvshmem``
transport is; P2P peers (xGMI) are mapped with ``rocshmem_ptr``, and kernels reach other nodes
with the ROCSHMEM calls behind ``torch_tdist.shmem_device``.

ROCSHMEM is C++ with no stable C ABI to load at run time, so its bootstrap is compiled into the
extension, and only when ``setup.py`` found ROCSHMEM (``TDIST_ROCSHMEM_HOME``, see :data:`BUILD`);
the device bitcode the kernels link (``librocshmem_device.bc``) is taken from the same install.
The host page and the stream calls are the HIP runtime's, served by the ``hip`` transport.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from .base import Segment, Transport, TransportUnavailable

BUILD = ('rebuild torch-tdist against a ROCm build of torch with ROCSHMEM: '
         'TDIST_ROCSHMEM_HOME=/opt/rocm pip install --no-build-isolation -e ".[rocm]" '
         '(the directory holding include/rocshmem/rocshmem.hpp and lib/librocshmem_host.so)')


def _extension():
    """The built extension when it has the ROCSHMEM bootstrap, else None."""
    from .. import _C

    return _C if hasattr(_C, "rocshmem_bootstrap") else None


def missing() -> str | None:
    """What this process lacks for ROCSHMEM (None: nothing)."""
    if torch.version.hip is None:
        return "torch here is not a ROCm build (ROCSHMEM serves AMD GPUs)"
    if _extension() is None:
        return "torch-tdist's C++ extension was built without ROCSHMEM"
    return None


class RocshmemSegment(Segment):
    """A heap from ``rocshmem_malloc`` (own, zeroed) or its mapping on a P2P peer
    (``rocshmem_ptr``)."""

    def __init__(self, address: int, nbytes: int, device: torch.device, owned: bool):
        from .cuda_device import CudaArray  # (a ROCm torch reads the same array interface)

        self._address, self._owned, self.device = address, owned, device
        self.bytes = torch.as_tensor(CudaArray(address, nbytes, device), device=device)

    @classmethod
    def allocate(cls, store, key: str, rank: int, world_size: int, nbytes: int,
                 device: torch.device, timeout: timedelta) -> list:
        """Every rank of a group that spans the whole job calls it, in the same order."""
        ext = _extension()
        torch.cuda.set_device(device)  # ROCSHMEM binds to the current device
        _, my_pe, n_pes = ext.rocshmem_bootstrap(store, f"{key}/rocshmem", rank, world_size)
        if (my_pe, n_pes) != (rank, world_size):
            span = f"ROCSHMEM has {n_pes} PEs, this is PE {my_pe}; this group has {world_size} ranks"
            raise ValueError(f"tdist: the rocshmem transport serves groups that span every process of "
                             f"the job in rank order ({span} and this is rank {rank}). Use "
                             f"TDIST_TRANSPORT=hip for subgroups")
        address = ext.rocshmem_malloc(nbytes)  # (zeroed, and synchronised, before it returns)
        if not address:
            raise MemoryError(
                f"tdist: rocshmem_malloc({nbytes}) failed: the heap does not fit in ROCSHMEM's "
                f"symmetric heap; lower TDIST_HEAP_SIZE or raise ROCSHMEM_HEAP_SIZE (before "
                f"ROCSHMEM starts)")
        store.set(f"{key}/zeroed/{rank}", "1")  # no peer writes here before the zeros land
        store.wait([f"{key}/zeroed/{peer}" for peer in range(world_size)], timeout)
        mapped = [address if peer == rank else ext.rocshmem_ptr(address, peer) for peer in range(world_size)]
        if not all(mapped):
            raise RuntimeError(
                f"tdist: rocshmem transport: rank {mapped.index(0)} is not reachable by P2P (xGMI) "
                f"from rank {rank} (another node); tdist's collectives need P2P peers for now, and "
                f"kernels reach other nodes through torch_tdist.shmem_device")
        return [cls(at, nbytes, device, owned=peer == rank) for peer, at in enumerate(mapped)]

    def close(self):
        if self.bytes is None:
            return
        self.bytes = None
        torch.cuda.synchronize(self.device)
        if self._owned:
            _extension().rocshmem_free(self._address)  # collective, like the malloc


def device_library() -> str:
    """Path of ROCSHMEM's device bitcode, from the install the extension was built against."""
    directory = getattr(_extension(), "rocshmem_library_dir", "")
    found = os.path.join(directory, "librocshmem_device.bc") if directory else ""
    if not found or not os.path.exists(found):
        raise RuntimeError(
            f"tdist: kernels with ROCSHMEM calls need librocshmem_device.bc "
            f"({found or 'no ROCSHMEM in this build'}); build ROCSHMEM with its device bitcode "
            f"and {BUILD}")
    return found


class RocshmemTransport(Transport):
    """ROCSHMEM's symmetric heap: one node or several (the C++ backend bootstraps ROCSHMEM)."""

    name = "rocshmem"
    device_types = ("cuda",)  # (a ROCm torch names its GPUs cuda)
    collective = True  # rocshmem_malloc and rocshmem_free are collective over the job's PEs

    def check_available(self, device_type: str, heap_bytes: int | None = None):
        super().check_available(device_type, heap_bytes)
        lacking = missing()
        if lacking is not None:
            raise TransportUnavailable(
                f"tdist: transport 'rocshmem' cannot start: {lacking}; {BUILD}. On NVIDIA GPUs "
                f"use TDIST_TRANSPORT=nvshmem")
        self._hip().check_available(device_type, heap_bytes)

    @staticmethod
    def _hip() -> Transport:
        from . import get

        return get("hip")

    def allocate_symmetric(self, store, key: str, rank: int, world_size: int, nbytes: int,
                           device: torch.device, timeout: timedelta) -> list:
        return RocshmemSegment.allocate(store, key, rank, world_size, nbytes, device, timeout)

    def map_host_page(self, address: int, nbytes: int, device: torch.device) -> int:
        return self._hip().map_host_page(address, nbytes, device)

    def unmap_host_page(self, address: int, device: torch.device):
        self._hip().unmap_host_page(address, device)

    def stream_ops(self):
        return self._hip().stream_ops()
