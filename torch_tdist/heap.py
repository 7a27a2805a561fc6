"""The symmetric heap: one per process group, the same layout on every rank.

Every rank allocates the same sequence of buffers, so an offset names the same buffer on
every rank. Each rank maps every peer's heap; ``bases[p]`` is where peer ``p``'s heap sits in
this process, and kernels translate pointers through it (see ``torch_tdist.language``).

The memory comes from a transport (``torch_tdist.transports``): ``shm`` (CPU: POSIX shared
memory, one segment per rank), ``cuda`` or ``hip`` (device memory shared through CUDA or HIP IPC
within a node) or ``nvshmem`` (one ``nvshmem_malloc`` of NVSHMEM). This module lays the heap out
and, for transports that hand out handles, exchanges them through the group's store.
"""

import ctypes
import mmap
import socket
import weakref
from datetime import timedelta

import torch

from . import language, transports
from .transports import wait_for_peers
# (what callers of the heap have used from here: the segment names left in /dev/shm, the class)
from .transports.shm import ShmSegment as _ShmSegment, shm_segment_names  # noqa: F401

TRANSPORTS = ("auto", *transports.names())
DEFAULT_HEAP_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}  # per rank and group

def gpu_hosts(store, key: str, rank: int, world_size: int, timeout: timedelta) -> list[str]:
    """Every rank's host, once every rank is known to run the same build of PyTorch: the ranks
    publish theirs, and a group mixing ROCm (AMD) and CUDA (NVIDIA) GPUs, which no transport
    serves, raises naming the ranks of each."""
    store.set(f"{key}/host/{rank}", f"{transports.gpu_build()}:{socket.gethostname()}")
    wait_for_peers(store, f"{key}/host", world_size, timeout, "join the group's symmetric heap")
    builds, hosts = zip(*(store.get(f"{key}/host/{peer}").decode().split(":", 1)
                          for peer in range(world_size)))
    if len(set(builds)) > 1:
        ranks = {build: [peer for peer in range(world_size) if builds[peer] == build] for build in builds}
        raise ValueError("tdist: a group's GPUs must be all AMD or all NVIDIA, and "
                         + " and ".join(f"ranks {ranks[b]} run a {'ROCm' if b == 'rocm' else 'CUDA'} "
                                        f"build of PyTorch" for b in sorted(ranks))
                         + "; make one group of each")
    return list(hosts)


class SymmetricHeap:
    """This rank's view of a group's symmetric heap.

    ``bases``: int64 tensor on the heap's device, peer heap base addresses as mapped here.
    ``ctx``: the context tensor every tdist kernel takes first (layout in
    ``torch_tdist.language``). ``abort_address``: the host address of the group's abort word
    (0: none), on a page of its own; waits give up once it is set. GPU kernels read it through
    the page mapped for the device (``cudaHostRegister``).
    """

    def __init__(self, store, rank: int, world_size: int, nbytes: int,
                 timeout: timedelta = timedelta(minutes=10), device="cpu",
                 transport: str = "auto", key: str = "tdist_heap", abort_address: int = 0):
        """Collective over the group: every rank calls it with the same ``key``, which must
        be new in ``store`` (the group's store, already private to the group)."""
        self.rank, self.world_size, self.nbytes = rank, world_size, nbytes
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        hosts = gpu_hosts(store, key, rank, world_size, timeout) if self.device.type == "cuda" else []
        spans_nodes = transport == "auto" and len(set(hosts)) > 1
        self.transport = transports.resolve(transport, self.device.type, spans_nodes)
        self._transport = transports.get(self.transport)
        if self._transport.collective:
            self._segments = self._transport.allocate_symmetric(store, key, rank, world_size, nbytes,
                                                                self.device, timeout)
        else:
            self._segments = self._map_segments(self._transport, store, key, timeout)
        addresses = [s.bytes.data_ptr() for s in self._segments]
        self._addresses = addresses
        self.timeout_s = timeout.total_seconds()
        if any(a % language.HEAP_ALIGN for a in addresses):
            raise RuntimeError(f"tdist: a heap segment is not {language.HEAP_ALIGN}-byte aligned")
        ctx = [0] * language.CTX_BASES.value + addresses
        ctx[language.CTX_RANK.value] = rank
        ctx[language.CTX_WORLD.value] = world_size
        ctx[language.CTX_TIMEOUT_MS.value] = int(timeout.total_seconds() * 1000)
        self.abort_address = abort_address if self.device.type == "cpu" else 0
        self._abort_word = abort_address  # (host memory, on every device)
        self._mapped_abort_page = None
        if abort_address and self.device.type != "cpu":
            page = abort_address - abort_address % mmap.PAGESIZE
            device_page = self._transport.map_host_page(page, mmap.PAGESIZE, self.device)
            self._mapped_abort_page = page
            ctx[language.CTX_ABORT.value] = device_page + abort_address - page
        else:
            ctx[language.CTX_ABORT.value] = self.abort_address
        self.ctx = torch.tensor(ctx, dtype=torch.int64, device=self.device)
        self.bases = self.ctx[language.CTX_BASES.value:]
        self._top = language.HEAP_ALIGN  # the first bytes hold the segment's job token
        _LIVE_HEAPS.add(self)

    def contains(self, address: int) -> bool:
        """Whether ``address`` lies in this rank's part of the heap."""
        return bool(self._segments) and 0 <= address - self._addresses[self.rank] < self.nbytes

    def base_address(self, peer: int) -> int:
        """Where ``peer``'s heap sits in this process's address space."""
        if not 0 <= peer < self.world_size:
            raise ValueError(f"tdist: peer {peer} is not a rank of this heap's group of {self.world_size}")
        return self._addresses[peer]

    def peer_delta(self, peer: int) -> int:
        """How far ``peer``'s heap sits from this rank's, in this process's address space."""
        return self.base_address(peer) - self._addresses[self.rank]

    def _map_segments(self, transport, store, key: str, timeout: timedelta) -> list:
        own = transport.create(self.nbytes, self.device)
        try:
            store.set(f"{key}/handle/{self.rank}", own.handle)
            wait_for_peers(store, f"{key}/handle", self.world_size, timeout, "create a heap segment")
            handles = [store.get(f"{key}/handle/{peer}") for peer in range(self.world_size)]
            segments = [own if peer == self.rank else transport.open(handle, self.nbytes, self.device)
                        for peer, handle in enumerate(handles)]
            store.set(f"{key}/mapped/{self.rank}", "1")
            wait_for_peers(store, f"{key}/mapped", self.world_size, timeout, "map the peers' heap segments")
            for handle in handles:  # every peer mapped them: the first rank here removes the names
                transport.forget(handle)
        except BaseException:
            # A peer that died between creating its segment and every peer mapping it never
            # removed its segment's name: the ranks still here remove every name they know.
            for peer in range(self.world_size):
                try:
                    handle_key = f"{key}/handle/{peer}"
                    if store.check([handle_key]):
                        transport.forget(store.get(handle_key))
                except Exception:  # noqa: BLE001  (the store may have died with the peer)
                    pass
            raise
        finally:
            own.all_peers_mapped()  # (or we are failing)
        return segments

    def alloc(self, nbytes: int, align: int = 256) -> int:
        """Reserve ``nbytes`` and return their offset; every rank must make the same calls."""
        offset = -(-self._top // align) * align
        if offset + nbytes > self.nbytes:
            raise MemoryError(
                f"tdist: symmetric heap exhausted: {nbytes} bytes asked, {self.nbytes - offset} "
                f"of {self.nbytes} left; raise TDIST_HEAP_SIZE (or the backend option 'heap_size')")
        self._top = offset + nbytes
        return offset

    def view(self, offset: int, shape, dtype: torch.dtype, peer: int | None = None) -> torch.Tensor:
        """A tensor over heap bytes at ``offset`` (of ``peer``'s heap, default this rank's)."""
        seg = self._segments[self.rank if peer is None else peer]
        count = 1
        for d in shape:
            count *= d
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return seg.bytes[offset:offset + nbytes].view(dtype).view(shape)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new symmetric tensor: the same offset on every rank (contents undefined)."""
        if isinstance(shape, int):
            shape = (shape,)
        count = 1
        for d in shape:
            count *= d
        offset = self.alloc(count * torch.empty((), dtype=dtype).element_size())
        return self.view(offset, tuple(shape), dtype)

    def close(self):
        _LIVE_HEAPS.discard(self)
        aborted = bool(self._abort_word) and ctypes.c_int64.from_address(self._abort_word).value != 0
        for seg in self._segments:
            if aborted and self._transport.collective:
                continue  # (left allocated: NVSHMEM's free waits for every PE, and one may be dead)
            seg.close()
        self._segments = []
        if self._mapped_abort_page is not None:
            self._transport.unmap_host_page(self._mapped_abort_page, self.device)
            self._mapped_abort_page = None


_LIVE_HEAPS: "weakref.WeakSet[SymmetricHeap]" = weakref.WeakSet()


def heap_at(address: int) -> SymmetricHeap:
    """The live heap of this process whose own part holds ``address``."""
    for heap in list(_LIVE_HEAPS):
        if heap.contains(address):
            return heap
    raise ValueError(
        f"tdist: address {address:#x} is not in a symmetric heap of this process; symmetric "
        f"calls take pointers into torch_tdist.get_heap(group) buffers")
