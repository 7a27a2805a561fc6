"""The symmetric heap: one per process group, the same layout on every rank.

Every rank allocates the same sequence of buffers, so an offset names the same buffer on
every rank. Each rank maps every peer's heap; ``bases[p]`` is where peer ``p``'s heap sits in
this process, and kernels translate pointers through it (see ``torch_tdist.language``).

Transports: ``shm`` (CPU: POSIX shared memory, one segment per rank), ``cuda`` (device
memory shared through CUDA IPC within a node) and ``nvshmem`` (the heap is one
``nvshmem_malloc`` of NVSHMEM, bootstrapped by the C++ backend through the group's store;
P2P peers mapped with ``nvshmem_ptr``; kernels reach other nodes with the NVSHMEM calls of
``torch_tdist.shmem_device``).
"""

import ctypes
import glob
import mmap
import os
import re
import secrets
import socket
import weakref
from datetime import timedelta

import torch

from . import language

TRANSPORTS = ("auto", "shm", "cuda", "nvshmem")
DEFAULT_HEAP_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}  # per rank and group
SHM_DIR = "/dev/shm"

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, what: str = "TDIST_HEAP_SIZE") -> int:
    """Bytes from ``"268435456"``, ``"256M"``, ``"256MiB"``, ``"1g"``..."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not match or int(match.group(1)) <= 0:
        raise ValueError(
            f"tdist: {what}={text!r} is not a heap size; expected a positive number of bytes "
            f"such as 268435456, 256M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def heap_options(options=None) -> tuple[str, int | None]:
    """(transport, heap bytes) from the backend options or TDIST_TRANSPORT / TDIST_HEAP_SIZE
    (None: the device's default, DEFAULT_HEAP_BYTES)."""
    options = options or {}
    transport = str(options.get("transport") or os.environ.get("TDIST_TRANSPORT") or "auto").lower()
    if transport not in TRANSPORTS:
        raise ValueError(
            f"tdist: unknown transport {transport!r} (TDIST_TRANSPORT or the backend option "
            f"'transport'); expected one of {', '.join(TRANSPORTS)}")
    size = options.get("heap_size") or os.environ.get("TDIST_HEAP_SIZE")
    return transport, None if size is None else parse_size(size)


def resolve_transport(transport: str, device: torch.device, spans_nodes: bool = False) -> str:
    """The transport that serves tensors on ``device`` (``transport`` as the user chose it;
    ``auto`` picks NVSHMEM for a CUDA group whose ranks are on several hosts)."""
    wanted = {"cpu": ("shm",), "cuda": ("cuda", "nvshmem")}.get(device.type, ())
    if not wanted:
        raise ValueError(f"tdist: no symmetric-heap transport for {device.type} tensors")
    if transport == "auto":
        return "nvshmem" if device.type == "cuda" and spans_nodes else wanted[0]
    if transport not in wanted:
        raise ValueError(
            f"tdist: transport {transport!r} cannot serve {device.type} tensors; "
            f"use {' or '.join(wanted)} (TDIST_TRANSPORT)")
    return transport


class _ShmSegment:
    """One POSIX shared-memory segment mapped into this process.

    Its handle is ``name:token``. The owner writes the random token into the segment's first
    bytes (the heap keeps them out of allocations), and a peer that opens the name checks the
    owner, the mode and the token before using it: a file that is not this job's is refused.
    The name is unlinked once every peer mapped it; it carries its creator's pid (and pid
    namespace), so that the name of one whose creator was killed before that (a peer died
    during the heap's rendezvous and the launcher stopped the rest) is removed by the next
    segment made on the machine (``_remove_dead_creators_segments``).
    """

    TOKEN_BYTES = 16

    def __init__(self, path: str, nbytes: int, create: bool):
        flags = os.O_RDWR | os.O_NOFOLLOW | ((os.O_CREAT | os.O_EXCL) if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            else:
                info = os.fstat(fd)
                if info.st_size != nbytes or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                    raise ValueError(f"tdist: shared-memory segment {path} is not this job's "
                                     f"(size, owner or mode differ)")
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path = path
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> "_ShmSegment":
        _remove_dead_creators_segments()
        path = os.path.join(SHM_DIR, f"tdist-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(16)}")
        try:
            segment = cls(path, nbytes, create=True)
        except BaseException:
            _unlink(path)
            raise
        token = secrets.token_bytes(cls.TOKEN_BYTES)
        segment.bytes[:cls.TOKEN_BYTES] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
        segment.handle = os.path.basename(path).encode() + b":" + token.hex().encode()
        return segment

    @classmethod
    def open(cls, handle: bytes, nbytes: int, device: torch.device) -> "_ShmSegment":
        name, _, token = handle.decode().partition(":")
        segment = cls(os.path.join(SHM_DIR, name), nbytes, create=False)
        if bytes(segment.bytes[:cls.TOKEN_BYTES].tolist()).hex() != token:
            segment.close()
            raise ValueError(f"tdist: shared-memory segment {name} does not carry this job's token")
        return segment

    def all_peers_mapped(self):
        _unlink(self.path)  # nothing stays in /dev/shm, whatever happens to the job later

    @staticmethod
    def forget(handle: bytes):
        """Remove the name of a peer's segment (its handle) from /dev/shm."""
        name = handle.decode().partition(":")[0]
        if _SEGMENT_NAME.fullmatch(name):
            _unlink(os.path.join(SHM_DIR, name))

    def close(self):
        self.bytes = None
        try:
            self._map.close()
        except BufferError:
            pass  # views handed out still hold it; the mapping goes with the last of them


# what _ShmSegment names its segments: tdist-<creator's pid namespace>-<creator's pid>-<random>
_SEGMENT_NAME = re.compile(r"tdist-(\d+)-(\d+)-[0-9a-f]{32}")


def shm_segment_names() -> set[str]:
    """The tdist segments now named in /dev/shm. Each is unlinked as soon as every peer mapped
    it, so none should stay between calls, after an error, or after a process exits."""
    return {name for name in os.listdir(SHM_DIR) if _SEGMENT_NAME.fullmatch(name)}


def _pid_namespace() -> int:
    """This process's pid namespace (its inode): pids name processes only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _remove_dead_creators_segments():
    """Unlinks the segment names of this user whose creator, in this pid namespace, is gone
    (no peer can be waiting to map them: their heap's rendezvous ended with the creator)."""
    namespace = _pid_namespace()
    for name in shm_segment_names():
        match = _SEGMENT_NAME.fullmatch(name)
        if int(match.group(1)) != namespace or not namespace:
            continue
        try:
            os.kill(int(match.group(2)), 0)
            continue  # alive (or its pid reused: left alone)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid == os.geteuid():
                os.unlink(path)
        except OSError:
            pass  # gone already, or not ours to remove


def _unlink(path: str):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _CudaSegment:
    """Device memory shared through CUDA IPC (cuda-python); its handle is the IPC handle."""

    def __init__(self, address: int, nbytes: int, device: torch.device, owned: bool):
        self._address, self._owned, self.device = address, owned, device
        self.bytes = torch.as_tensor(_CudaArray(address, nbytes, device), device=device)

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> "_CudaSegment":
        cudart = _cudart(device)
        address = _check(cudart.cudaMalloc(nbytes), "cudaMalloc")
        _check(cudart.cudaMemset(address, 0, nbytes), "cudaMemset")
        segment = cls(address, nbytes, device, owned=True)
        segment.handle = bytes(_check(cudart.cudaIpcGetMemHandle(address), "cudaIpcGetMemHandle").reserved)
        return segment

    @classmethod
    def open(cls, handle: bytes, nbytes: int, device: torch.device) -> "_CudaSegment":
        cudart = _cudart(device)
        ipc = cudart.cudaIpcMemHandle_t()
        ipc.reserved = handle
        address = _check(cudart.cudaIpcOpenMemHandle(ipc, cudart.cudaIpcMemLazyEnablePeerAccess),
                         "cudaIpcOpenMemHandle (are the GPUs peer-to-peer capable?)")
        return cls(address, nbytes, device, owned=False)

    def all_peers_mapped(self):
        pass

    @staticmethod
    def forget(handle: bytes):
        pass  # an IPC handle names nothing that outlives its process

    def close(self):
        if self.bytes is None:
            return
        self.bytes = None
        torch.cuda.synchronize(self.device)
        self._release()

    def _release(self):
        cudart = _cudart(self.device)
        if self._owned:
            cudart.cudaFree(self._address)
        else:
            cudart.cudaIpcCloseMemHandle(self._address)


class _CudaArray:
    """Lets torch wrap raw device memory without copying (``__cuda_array_interface__``)."""

    def __init__(self, address: int, nbytes: int, device: torch.device):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


def _cudart(device: torch.device):
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as err:
        raise RuntimeError("tdist: the cuda transport needs cuda-python (pip install cuda-python)") from err
    _check(cudart.cudaSetDevice(device.index), "cudaSetDevice")
    return cudart


def _check(result, call: str):
    from cuda.bindings import runtime as cudart

    err, *value = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"tdist: {call} failed: {cudart.cudaGetErrorString(err)[1].decode()}")
    return value[0] if value else None


class _NvshmemSegment(_CudaSegment):
    """A heap from ``nvshmem_malloc`` (own) or its mapping on a P2P peer (``nvshmem_ptr``)."""

    @classmethod
    def allocate(cls, store, key: str, rank: int, world_size: int, nbytes: int,
                 device: torch.device, timeout: timedelta) -> list:
        """Every rank of a group that spans the whole job calls it, in the same order."""
        from . import _C

        _cudart(device)  # NVSHMEM binds to the current device
        _, my_pe, n_pes = _C.nvshmem_bootstrap(store, f"{key}/nvshmem", rank, world_size,
                                               nvshmem_host_library())
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
        _check(_cudart(device).cudaMemset(address, 0, nbytes), "cudaMemset")
        _check(_cudart(device).cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        store.set(f"{key}/zeroed/{rank}", "1")  # no peer writes here before the zeros land
        store.wait([f"{key}/zeroed/{peer}" for peer in range(world_size)], timeout)
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
            from . import _C

            _C.nvshmem_free(self._address)  # collective, like the malloc


def nvshmem_host_library() -> str:
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


def _spans_nodes(store, key: str, rank: int, world_size: int, timeout: timedelta) -> bool:
    store.set(f"{key}/host/{rank}", socket.gethostname())
    store.wait([f"{key}/host/{peer}" for peer in range(world_size)], timeout)  # (the group's timeout)
    return len({store.get(f"{key}/host/{peer}") for peer in range(world_size)}) > 1


_SEGMENTS = {"shm": _ShmSegment, "cuda": _CudaSegment}


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
        spans_nodes = transport == "auto" and self.device.type == "cuda" and _spans_nodes(
            store, key, rank, world_size, timeout)
        self.transport = resolve_transport(transport, self.device, spans_nodes)
        if self.transport == "nvshmem":
            self._segments = _NvshmemSegment.allocate(store, key, rank, world_size, nbytes, self.device, timeout)
        else:
            self._segments = self._map_segments(_SEGMENTS[self.transport], store, key, timeout)
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
        if abort_address and self.device.type == "cuda":
            cudart = _cudart(self.device)
            page = abort_address - abort_address % mmap.PAGESIZE
            _check(cudart.cudaHostRegister(page, mmap.PAGESIZE, cudart.cudaHostRegisterMapped), "cudaHostRegister")
            self._mapped_abort_page = page
            device_page = _check(cudart.cudaHostGetDevicePointer(page, 0), "cudaHostGetDevicePointer")
            ctx[language.CTX_ABORT.value] = int(device_page) + abort_address - page
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

    def _map_segments(self, segment_type, store, key: str, timeout: timedelta) -> list:
        own = segment_type.create(self.nbytes, self.device)
        try:
            store.set(f"{key}/handle/{self.rank}", own.handle)
            store.wait([f"{key}/handle/{peer}" for peer in range(self.world_size)], timeout)
            handles = [store.get(f"{key}/handle/{peer}") for peer in range(self.world_size)]
            segments = [own if peer == self.rank else segment_type.open(handle, self.nbytes, self.device)
                        for peer, handle in enumerate(handles)]
            store.set(f"{key}/mapped/{self.rank}", "1")
            store.wait([f"{key}/mapped/{peer}" for peer in range(self.world_size)], timeout)
            for handle in handles:  # every peer mapped them: the first rank here removes the names
                segment_type.forget(handle)
        except BaseException:
            # A peer that died between creating its segment and every peer mapping it never
            # removed its segment's name: the ranks still here remove every name they know.
            for peer in range(self.world_size):
                try:
                    handle_key = f"{key}/handle/{peer}"
                    if store.check([handle_key]):
                        segment_type.forget(store.get(handle_key))
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
            if aborted and isinstance(seg, _NvshmemSegment):
                continue  # (left allocated: NVSHMEM's free waits for every PE, and one may be dead)
            seg.close()
        self._segments = []
        if self._mapped_abort_page is not None:
            _cudart(self.device).cudaHostUnregister(self._mapped_abort_page)
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
