"""Large all_gather, reduce_scatter and all_reduce between heaps, in rounds (a piece of the
message that fits the bulk area), on the group's stream.

all_gather pulls: every rank copies its input into its own area, passes the start barrier, and
one copy engine pulls each peer's area into the output, one copy per peer (on H200s faster than
any push, and than several streams at once);
an end barrier follows, since a rank refills its area only once every peer has pulled from it.

reduce_scatter and all_reduce push: every rank pushes its data into its peers' slots in chunks,
raising a flag after each chunk: with plain copies (on GPUs the copy engines, one side stream
per peer, flags by ``stream_ops``) or by the first programs of the receiving kernel itself
(the backend option ``bulk_push``). One kernel on the receiving rank takes each chunk as soon as its flags are
up (``triton_kernels/bulk.py``), so reducing or copying out overlaps the transfer:

- start barrier: raise ``start[me]`` on every peer, wait for every peer's, zero them (the
  pipelined matmul_reduce_scatter waits on a side stream, the main stream meanwhile computing
  the first peer's first piece, which no peer touches yet);
- reduce_scatter: push input part ``p`` to peer ``p``'s slot [me]; the reduce kernel combines
  each arrived chunk in rank order (this rank's part read from the input) into the output;
- all_reduce: reduce_scatter's push and reduction into a "reduced" slot, then all_gather's push
  of that slot into a second set of slots, and the gather kernel;
- the flags a kernel waited on are zeroed after it.

Why it is safe: a peer writes this rank's slots and flags, or reads its area, only after the
start barrier of the same call, which it passes only after this rank's previous call is done
(every step is on the group's stream before this rank's start writes; a call whose area its
peers read returns only after they read it). Before its own barrier passes, a rank writes only
its own slot of its area, which no peer reads or writes. Every value written or waited for is 0
or 1, nothing is chosen per call on the host, so a CUDA graph of these calls is correct on every
replay. The area is not the one-shot mailboxes: a one-shot call right after a bulk call cannot
write where a slower peer still reads.
"""

import ctypes

import torch

from . import language
from .language import poll_until
from .stream_ops import Streams
from .triton_kernels import bulk

KMAX = 64  # most chunks per slot in a round
# Who pushes: "copy_engine" (copies on side streams; torch copies on the CPU) or "sm" (the
# receiving kernel's first PUSH_PROGRAMS programs). The backend option bulk_push chooses; by default the
# copies on the CPU, the kernel on GPUs (faster on H200s at 16 to 256 MB).
PUSHERS = ("copy_engine", "sm")
DEFAULT_PUSHER = {"cpu": "copy_engine", "cuda": "sm"}
# Bytes per chunk (fewer, larger chunks when KMAX would be exceeded); small on the CPU, so that
# the tests' messages come in several chunks. On H200s 16 MB copy-engine chunks did best for
# 64 MB messages: each costs a copy and a flag from Python (about 20 us of host time each).
# Kernel pushes cost no host time per chunk; 1 MB chunks and 48 pushers of 132 programs did
# best of 9 settings tried on H200s.
CHUNK_BYTES = {"copy_engine": 4096 if language.INTERPRET else 16 << 20,
               "sm": 4096 if language.INTERPRET else 1 << 20}
NO_LIMIT = 1 << 62
KERNEL_BLOCK_BYTES = 16384
KERNEL_PROGRAMS = 1 if language.INTERPRET else 132  # one per H200 SM (programs wait on flags)
# The gather and reduce kernels without pushers wait only on flags that copy engines raise, so
# their programs need not all be resident at once: on an H200, 264 programs reduced 4 parts of
# 16 MB (flags already up) in 26.8 us (3.1 TB/s), 132 in 34.9 us (2.4 TB/s); 528 and 1056
# smaller ones no faster than 132 (the overlap benchmark's matmul_reduce_scatter geometric mean
# went 1.248x -> 1.295x with 264).
RECEIVING_PROGRAMS = 1 if language.INTERPRET else 264
# Their warps in the reduce kernel. On an H200, 4 parts of 117 MB (flags up) summed in 186.8 us
# with 16, 195.2 with 8; on another 163.2 and 174.0 (a plain copy of the bytes: 3.5-3.7 TB/s).
# The pipelined matmul_reduce_scatter with 16: 1.006x and 1.014x on 4 H200s (geometric means of
# the 9 overlap shapes at 1 and 2 chunks), 1.000x and 1.002x on 2.
RECEIVING_WARPS = 16
# Of those, the pushers with the "sm" pusher (the interpreter runs programs in order: pushers first).
PUSH_PROGRAMS = 1 if language.INTERPRET else 48
# all_gather_matmul's pipelined matmuls of successive pieces alternate between the main stream
# and a side stream (2) or all run on the main one (1): a piece of a fraction of the rows fills
# the last wave of the GPU's SMs worse than the whole matmul, and the next piece, once its rows
# have landed, can fill the gap (2 H200s, in turn with 1 in one run: 1.00x-1.04x faster). Not
# matmul_reduce_scatter's: there two pieces made side by side both finish late, and so do their
# pushes (4 H200s, two benchmark runs minutes apart, not side by side: 1.13x-1.15x slower where
# the transfer outlasts the matmul, the matmul alone 1.02x).
MATMUL_STREAMS = 2


def _runs_of_rows(lo: int, hi: int, row: int, runs: int) -> list[tuple[int, int]]:
    """Elements ``[lo, hi)``, whole rows of ``row`` elements, as (start, end) runs of
    ceil(rows / ``runs``) rows each, the last one shorter where they do not divide (so at most
    ``runs`` runs, fewer when the rows are few)."""
    per_run = -(-(hi - lo) // row // runs) * row if hi > lo else 1
    return [(start, min(hi, start + per_run)) for start in range(lo, hi, per_run)] or [(lo, hi)]


def vector(dtype: torch.dtype) -> int:
    """Elements in a 16-byte access."""
    return max(16 // dtype.itemsize, 1)


def aligned(dtype: torch.dtype, offsets) -> bool:
    return all(v % vector(dtype) == 0 for v in offsets)


class BulkPath:
    """The bulk algorithms of one group over ``heap`` bytes ``[offset, offset + nbytes)``.
    ``launch(op, kernel, grid, *args, **meta)`` launches a kernel as the executor does;
    ``accumulator(dtype)`` is the type reductions of ``dtype`` accumulate in; ``pusher`` one of
    PUSHERS (None: the device's default)."""

    def __init__(self, heap, offset: int, nbytes: int, launch, accumulator, pusher: str | None = None):
        world = heap.world_size
        self.heap, self.rank, self.world = heap, heap.rank, world
        self.device = heap.device
        self._launch, self._accumulator = launch, accumulator
        # int64 flags: start[world], then ready[2 sets][world][KMAX]
        flag_bytes = -(-(world + 2 * world * KMAX) * 8 // 256) * 256
        if nbytes <= flag_bytes:
            raise ValueError("tdist: the symmetric heap is too small for the bulk path; raise "
                             "TDIST_HEAP_SIZE (or the backend option 'heap_size')")
        self._flags_offset, self._data_offset = offset, offset + flag_bytes
        self._data_bytes = nbytes - flag_bytes
        self._flags = heap.view(offset, (world + 2 * world * KMAX,), torch.int64)
        # tile counters[world][KMAX] of kernels that finish a chunk with several programs: only
        # this rank's programs touch them, so they live outside the heap; zero between calls
        self._counters = torch.zeros(world * KMAX, dtype=torch.int64, device=heap.device)
        self._data = {}
        self.streams = Streams(heap.device)
        self.in_flight = False  # a call passed its start barrier and has not returned
        self.pusher = pusher or DEFAULT_PUSHER[heap.device.type]
        # beside a compute-bound receiving kernel (a GEMM, which wants every SM): the copy
        # engines, unless the bulk_push option chose
        self.pusher_beside_compute = pusher or "copy_engine"

    # ---- heap addresses -----------------------------------------------------------------
    def _slots(self, dtype: torch.dtype, peer: int | None = None) -> torch.Tensor:
        """The data area as a flat ``dtype`` tensor (this rank's, or ``peer``'s)."""
        key = (self.rank if peer is None else peer, dtype)
        if key not in self._data:
            self._data[key] = self.heap.view(self._data_offset, (self._data_bytes // dtype.itemsize,),
                                             dtype, peer)
        return self._data[key]

    def _flag_address(self, peer: int, index: int) -> int:
        return self.heap.base_address(peer) + self._flags_offset + 8 * index

    def _ready_index(self, flag_set: int, sender: int, k: int) -> int:
        return self.world + (flag_set * self.world + sender) * KMAX + k

    # ---- steps --------------------------------------------------------------------------
    def _kernel(self, op: str, kernel, grid, *args, stream: int = 0, **meta):
        """Launch ``kernel`` on ``stream`` (0: the main one; recorded as ``("launch", stream,
        kernel, compiled, grid, args, meta)`` while the streams record)."""
        with self.streams.on(stream):
            compiled = self._launch(op, kernel, grid, *args, **meta)
        self.streams.record("launch", stream, kernel, compiled, grid, args, meta)

    def matmul(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, stream: int = 0):
        """``out = a @ b`` on ``stream`` (recorded as ``("mm", stream, out, a, b)``)."""
        with self.streams.on(stream):
            torch.mm(a, b, out=out)
        self.streams.record("mm", stream, out, a, b)

    def _matmul_streams(self, first_side: int) -> tuple[int, ...]:
        """The streams all_gather_matmul's pipelined matmuls take in turn: the main one, then (with
        MATMUL_STREAMS 2) side stream ``first_side``, ordered after the main stream's work so far."""
        if MATMUL_STREAMS == 1 or self.device.type == "cpu":
            return (0,)
        self.streams.begin(first_side)
        self.streams.after(first_side, 0)
        return (0, first_side)

    def _start_barrier(self, op: str, signature: int, sides: int | None = None, stream: int = 0):
        """Every peer has finished its previous call and makes this one (the same
        ``signature``: op, dtype, count, chunks), on ``stream``; then the call's other side
        streams are ordered after it. From here until the call returns, the group's flags are
        in flight (``in_flight``). ``stream`` 0, the main stream, waits there; a side stream
        ``stream`` waits after the main stream's earlier work while the main stream goes on
        (with what touches no peer: its own part of a pipelined op), and the caller orders the
        main stream after it before any kernel that waits for peers (which could otherwise
        hold every SM while this barrier's kernel waits for one)."""
        self.in_flight = True
        streams = self.streams
        sides = self.world - 1 if sides is None else sides
        streams.begin(max(sides, stream))
        if stream:
            streams.after(stream, 0)
        for p in self._peers():
            streams.write(stream, self._flag_address(p, self.rank), signature)
        self._wait_for_peers(op, 0, 1, signature, "to start the same call", stream)
        streams.zero(stream, self._flags[:self.world])
        streams.fork(sides, stream)

    def _push(self, flag_set: int, src: torch.Tensor, src_stride: int, part_len: int, limit: int,
              dst_offset: int, chunk: int, n_chunks: int, pusher: str | None = None):
        """Peer ``p``'s part of ``src`` (``src[p * src_stride:]``, ``min(part_len, limit - p *
        src_stride)`` elements, at least 0) -> ``p``'s slots at element ``dst_offset``, chunk by
        chunk, raising ``p``'s ready flag of each of the ``n_chunks`` chunks (empty ones too);
        all peers at once. The copy engines' pushes are queued on the side streams here; the
        "sm" pushes are returned, for the receiving kernel to make (``_pushers``). ``pusher``:
        this call's, if not the group's."""
        if (pusher or self.pusher) == "sm":
            return src, src_stride, part_len, limit
        for stream, peer in enumerate(self._peers(), start=1):
            length = max(0, min(part_len, limit - peer * src_stride))
            part = src[peer * src_stride:peer * src_stride + length]
            dst = self._slots(src.dtype, peer)[dst_offset:dst_offset + length]
            for k in range(n_chunks):
                piece = part[k * chunk:(k + 1) * chunk]
                if piece.numel():
                    self.streams.copy(stream, dst[k * chunk:k * chunk + piece.numel()], piece)
                address = self._flag_address(peer, self._ready_index(flag_set, self.rank, k))
                self.streams.write(stream, address, 1)
        return None

    def _pushers(self, push, fallback: torch.Tensor, alone: int = KERNEL_PROGRAMS) -> tuple[int, tuple, int]:
        """(grid, the kernel's push arguments and PUSHERS) for ``push`` from ``_push``; ``alone``:
        the grid without pushers."""
        if push is None or self.world == 1:
            return alone, (fallback, 0, 0, 0), 0
        return max(KERNEL_PROGRAMS, PUSH_PROGRAMS + 1), push, PUSH_PROGRAMS

    def _wait_for_peers(self, op: str, first: int, stride: int, value: int, what: str, stream: int = 0):
        """Hold ``stream`` (0: the caller's) until every peer ``p``'s flag ``first + p * stride``
        (in this rank's heap) is ``value``. GPUs: a one-program kernel, which gives up once the group is
        aborted (the watchdog raises). CPU: this thread polls, gives up after the group's timeout,
        and raises a ValueError at once if a peer wrote another value (it made a different call:
        another collective, dtype or element count)."""
        if self.device.type == "cuda":
            self._kernel(op, bulk.wait_peers_kernel, (1,), self.heap.ctx, self._flags[first:], stride, value,
                         stream=stream, ME=self.rank, WORLD=self.world)
            return
        for p in self._peers():
            slot = ctypes.c_int64.from_address(self._flag_address(self.rank, first + p * stride))
            wanted = f"{op}: rank {p} {what}"
            seen = poll_until(lambda: slot.value, lambda v: v != 0, self.heap.timeout_s, wanted,
                              self.heap.abort_address)
            if seen != value:
                raise ValueError(f"tdist: waited for {wanted}, but it made a different call (another "
                                 f"collective, dtype or element count; signature {seen:#x}, "
                                 f"this rank's {value:#x})")

    def signal_regions(self):
        """(first slot's address, slots per peer, peers) of the flags the bulk path waits on."""
        yield self._flag_address(self.rank, 0), 1, self.world
        for flag_set in (0, 1):
            yield self._flag_address(self.rank, self._ready_index(flag_set, 0, 0)), KMAX, self.world

    def _done_with(self, flag_set: int):
        first = self._ready_index(flag_set, 0, 0)
        self.streams.zero(0, self._flags[first:first + self.world * KMAX])

    @staticmethod
    def _signature(call_word: int, count: int, n_chunks: int) -> int:
        """What a call writes into its peers' start flags: ``call_word`` (op | dtype << 8, from
        the executor), the chunks per slot and the element count. Never 0."""
        return call_word | n_chunks << 16 | count << 24

    def _peers(self):
        """Peers in the order this rank pushes to them (rotated, so peers do not all start on
        the same rank)."""
        return [(self.rank + i) % self.world for i in range(1, self.world)]

    def _chunking(self, dtype: torch.dtype, length: int, pusher: str | None = None) -> tuple[int, int]:
        """(elements per chunk, chunks) for a slot of ``length`` elements."""
        v = vector(dtype)
        chunk = max(CHUNK_BYTES[pusher or self.pusher] // dtype.itemsize, -(-length // KMAX))
        chunk = -(-chunk // v) * v
        return chunk, max(1, -(-length // chunk))

    def _slot_length(self, dtype: torch.dtype, slots: int) -> int:
        v = vector(dtype)
        length = self._data_bytes // dtype.itemsize // slots // v * v
        if length == 0:
            raise ValueError("tdist: the symmetric heap is too small for the bulk path; raise "
                             "TDIST_HEAP_SIZE (or the backend option 'heap_size')")
        return length

    def kernel_meta(self, dtype: torch.dtype) -> dict:
        """ME, WORLD, KMAX and BLOCK of the bulk kernels (and their warps on GPUs)."""
        block = 8192 if language.INTERPRET else KERNEL_BLOCK_BYTES // dtype.itemsize
        meta = {"ME": self.rank, "WORLD": self.world, "KMAX": KMAX, "BLOCK": block}
        return meta if language.INTERPRET else {**meta, "num_warps": 8}

    def _gather(self, op, own, slots, slot_stride, flag_set, out, part_stride, part_len, limit,
                chunk, n_chunks, offsets, push):
        dtype = out.dtype
        grid, push_args, pushers = self._pushers(push, own, RECEIVING_PROGRAMS)
        offsets = (*offsets, slot_stride, chunk, push_args[1])
        self._kernel(op, bulk.gather_chunks_kernel, (grid,), self.heap.ctx, own, slots, slot_stride,
                     self._flags[self._ready_index(flag_set, 0, 0):], out, part_stride, part_len, limit,
                     chunk, n_chunks, *push_args, ALIGN=vector(dtype) if aligned(dtype, offsets) else 1,
                     PUSHERS=pushers, **self.kernel_meta(dtype))
        self._done_with(flag_set)

    def _reduce(self, op, own, slots, slot_stride, flag_set, dst, n, chunk, n_chunks, reduce_op, offsets,
                push):
        dtype = dst.dtype
        grid, push_args, pushers = self._pushers(push, own, RECEIVING_PROGRAMS)
        offsets = (*offsets, slot_stride, chunk, push_args[1])
        meta = self.kernel_meta(dtype)
        if not pushers and "num_warps" in meta:
            meta["num_warps"] = RECEIVING_WARPS
        self._kernel(op, bulk.reduce_chunks_kernel, (grid,), self.heap.ctx, own, slots, slot_stride,
                     self._flags[self._ready_index(flag_set, 0, 0):], dst, n, chunk, n_chunks, *push_args,
                     ALIGN=vector(dtype) if aligned(dtype, offsets) else 1, OP=reduce_op,
                     ACC=self._accumulator(dtype), PUSHERS=pushers, **meta)
        self._done_with(flag_set)

    # ---- the algorithms -----------------------------------------------------------------
    def _slot_rounds(self, op: str, call_word: int, n: int, dtype: torch.dtype):
        """all_gather's and reduce_scatter's rounds: ``(start, length, chunk, n_chunks)`` for
        each piece of the ``n`` elements per rank that fits one slot per rank, yielded once its
        start barrier is passed; the side streams are joined after each."""
        capacity = self._slot_length(dtype, self.world)
        for start in range(0, n, capacity):
            length = min(capacity, n - start)
            chunk, n_chunks = self._chunking(dtype, length)
            self._start_barrier(op, self._signature(call_word, n, n_chunks))
            yield start, length, chunk, n_chunks
            self.streams.join(self.world - 1)
        self.in_flight = False

    def all_gather(self, op: str, call_word: int, out: torch.Tensor, src: torch.Tensor):
        """``out`` (flat, world x n) = every rank's flat ``src`` (n elements) in rank order,
        pulled from the peers' areas (``all_gather_pulled``) in rounds of ``pull_capacity``."""
        n, world = src.numel(), self.world
        capacity = self.pull_capacity(src.dtype)
        for start in range(0, n, capacity):
            length = min(capacity, n - start)
            self.all_gather_pulled(op, call_word, src[start:start + length],
                                   out.view(world, n)[:, start:start + length])

    def part_capacity(self, dtype: torch.dtype) -> int:
        """Elements of each rank's part that fit the slots in one round."""
        return self._slot_length(dtype, self.world)

    def pull_capacity(self, dtype: torch.dtype) -> int:
        """Elements a rank's part may have in one round of ``all_gather_pulled`` (the whole
        area: every rank pulls from its peers' own data)."""
        return self._slot_length(dtype, 1)

    def all_gather_consumed(self, op: str, call_word: int, src: torch.Tensor, consume):
        """all_gather's pushes of flat ``src`` in one round (``part_capacity``), taken by the
        compute kernel ``consume(own, slots, slot_stride, ready, chunk, n_chunks, grid,
        push_args, pushers)`` launches instead of the gather kernel (the arguments as there);
        pushed by ``pusher_beside_compute``."""
        n, dtype = src.numel(), src.dtype
        pusher = self.pusher_beside_compute
        chunk, n_chunks = self._chunking(dtype, n, pusher)
        self._start_barrier(op, self._signature(call_word, n, n_chunks))
        push = self._push(0, src, 0, n, NO_LIMIT, self.rank * n, chunk, n_chunks, pusher)
        grid, push_args, pushers = self._pushers(push, src)
        consume(src, self._slots(dtype), n, self._flags[self._ready_index(0, 0, 0):], chunk, n_chunks,
                grid, push_args, pushers)
        self._done_with(0)
        self.streams.join(self.world - 1)
        self.in_flight = False

    def reduce_scatter_produced(self, op: str, call_word: int, out: torch.Tensor, rows: int, chunk: int,
                                reduce_op: str, produce):
        """reduce_scatter whose parts a kernel makes straight into the peers' slots: ``out``
        (flat, ``rows`` x its row length) = OP over ranks of their parts for this rank.
        ``produce(slots, slot_stride, ready, counters)`` launches the kernel, which raises a
        rank's flag for each ``chunk`` elements of its part (``slot_stride`` elements, one round:
        ``part_capacity``; at most KMAX chunks)."""
        n, dtype = out.numel(), out.dtype
        n_chunks = max(1, -(-n // chunk))
        self._start_barrier(op, self._signature(call_word, n, n_chunks))
        slots = self._slots(dtype)
        produce(slots, n, self._flags[self._ready_index(0, 0, 0):], self._counters)
        self._reduce(op, slots[self.rank * n:], slots, n, 0, out, n, chunk, n_chunks, reduce_op,
                     offsets=(self.rank * n, chunk), push=None)
        self.streams.join(self.world - 1)
        self.in_flight = False

    def all_gather_pulled(self, op: str, call_word: int, src: torch.Tensor, gathered: torch.Tensor,
                          chunk: int | None = None, consume=None, row: int = 1, end_pieces: int = 1):
        """``gathered`` ([world, n], rows contiguous) = every rank's flat ``src`` (n elements, one
        round: ``pull_capacity``): ``src`` is copied into this rank's area, then a copy engine
        pulls each peer's area into its row. Ends with a barrier: a peer refills its slot only
        after every rank has pulled from it.

        With ``consume``, the pulls go in chunks of ``chunk`` elements on a side stream, each
        taken as it lands: ``consume(rank, start, piece, stream)`` is queued for this rank's
        ``src`` first, then for every chunk of every peer (element ``start`` of its part,
        ``piece`` its rows of ``gathered``), and queues torch ops on ``stream`` (the caller's and
        a side stream in turn, ``_matmul_streams``) while later chunks are in flight. The last
        pull's ``consume`` (the last peer's last chunk) overlaps no pull: that chunk is pulled in
        ``end_pieces`` pieces of whole rows (``row`` elements each), each taken as it lands.

        One stream of pulls, one copy per peer and chunk: on H200s peer-to-peer copies from
        several streams at once, or in smaller pieces, were slower, so the order they are queued
        in is the order they land in."""
        n, me, dtype = src.numel(), self.rank, src.dtype
        chunk = chunk or max(n, 1)
        n_chunks = max(1, -(-n // chunk))
        streams, side = self.streams, 1 if consume else 0
        # (the copy and the barrier on the main stream: on a side stream, beside this rank's own
        # part, the barrier's kernel started only as the matmul ended, and the pulls with it; on 4 H200s 8192x4608x36864 took 1803 us instead of 1556, only
        # matmul-bound shapes gained. With the barrier launched before the matmul and the copy on
        # a third stream: 1.003x, comm-bound shapes losing, the copy, which needs SMs as a kernel
        # does, sharing them with the matmul)
        streams.begin(side)
        streams.copy(0, self._slots(dtype)[:n], src)  # before the barrier tells the peers
        self._start_barrier(op, self._signature(call_word, n, n_chunks), sides=side)
        pulls = [(p, k * chunk, min(n, (k + 1) * chunk)) for k in range(n_chunks) for p in self._peers()]
        compute = self._matmul_streams(side + 1) if consume else (0,)
        if consume:
            consume(me, 0, src, 0)
            if pulls:
                p, lo, hi = pulls.pop()
                pulls += [(p, start, end) for start, end in _runs_of_rows(lo, hi, row, end_pieces)]
        for i, (p, lo, hi) in enumerate(pulls, start=1):
            streams.copy(side, gathered[p, lo:hi], self._slots(dtype, p)[lo:hi])
            if consume:
                stream = compute[i % len(compute)]
                streams.after(stream, side)
                consume(p, lo, gathered[p, lo:hi], stream)
        streams.copy(side, gathered[me], src)  # (last: the copy engine is free while the last chunks are multiplied)
        streams.join(side + len(compute) - 1)
        for p in self._peers():
            streams.write(0, self._flag_address(p, self._ready_index(1, me, 0)), 1)
        self._wait_for_peers(op, self._ready_index(1, 0, 0), KMAX, 1, "to finish pulling")
        self._done_with(1)
        self.in_flight = False

    def reduce_scatter_pipelined(self, op: str, call_word: int, out: torch.Tensor, chunk: int,
                                 reduce_op: str, produce, staging: torch.Tensor, row: int = 1,
                                 end_pieces: int = 1):
        """reduce_scatter whose parts torch ops make on the caller's stream: ``out`` (flat, n) =
        OP over ranks of their part for this rank. ``produce(rank, start, dst)`` queues elements
        ``[start, start + dst.numel())`` of this rank's part for ``rank`` into ``dst``: the
        peers' chunks first (chunk by chunk, every peer's), each pushed by a copy engine while
        the next is made, this rank's own part last, then the reduce kernel sums the chunks as
        they land, the peers' parts made in ``staging`` (at least world x n elements). One round
        (``part_capacity``), at most KMAX chunks. The first peer's first chunk is made while
        nothing is pushed: it is made and pushed in ``end_pieces`` pieces of whole rows (``row``
        elements each), its flag raised after the last."""
        n, world, me, dtype = out.numel(), self.world, self.rank, out.dtype
        n_chunks = max(1, -(-n // chunk))
        # The barrier waits on the first peer's push stream while the main stream makes the first
        # piece (on 4 H200s 8192x3584x14336 373 -> 359 us, 8192x8192x28672 1581 -> 1538); then
        # the main stream waits for it before anything else: the barrier's kernel must not wait
        # for an SM behind the reduce kernel, whose programs wait for the peers that wait for this
        # barrier (without that wait, tuning small shapes hung on every rank).
        barrier_pending = min(1, world - 1)
        self._start_barrier(op, self._signature(call_word, n, n_chunks), stream=barrier_pending)
        slots = self._slots(dtype)
        for k in range(n_chunks):
            lo, hi = k * chunk, min(n, (k + 1) * chunk)
            for stream, d in enumerate(self._peers(), start=1):
                pieces = _runs_of_rows(lo, hi, row, end_pieces) if k == 0 and stream == 1 else [(lo, hi)]
                for start, end in pieces:
                    part = staging[d * n + start:d * n + end]
                    produce(d, start, part)
                    if barrier_pending:
                        self.streams.after(0, barrier_pending)
                        barrier_pending = 0
                    self.streams.after(stream, 0)
                    self.streams.copy(stream, self._slots(dtype, d)[me * n + start:me * n + end], part)
                self.streams.write(stream, self._flag_address(d, self._ready_index(0, me, k)), 1)
        own = slots[me * n:(me + 1) * n]
        produce(me, 0, own)
        self._reduce(op, own, slots, n, 0, out, n, chunk, n_chunks, reduce_op,
                     offsets=(me * n, chunk), push=None)
        self.streams.join(world - 1)
        self.in_flight = False

    def reduce_scatter(self, op: str, call_word: int, out: torch.Tensor, src: torch.Tensor, reduce_op: str):
        """``out`` (flat, n) = OP over ranks of part [this rank] of their flat ``src`` (world x n)."""
        n, me = out.numel(), self.rank
        for start, length, chunk, n_chunks in self._slot_rounds(op, call_word, n, src.dtype):
            push = self._push(0, src[start:], n, length, NO_LIMIT, me * length, chunk, n_chunks)
            self._reduce(op, src[me * n + start:], self._slots(src.dtype), length, 0, out[start:],
                         length, chunk, n_chunks, reduce_op, offsets=(me * n + start, length, start), push=push)

    def all_reduce(self, op: str, call_word: int, out: torch.Tensor, src: torch.Tensor, reduce_op: str):
        """``out`` (flat, may be ``src``) = OP over ranks of their flat ``src``: a reduce_scatter
        into this rank's reduced slot, then an all_gather of the reduced slots."""
        n, me, world, dtype = src.numel(), self.rank, self.world, src.dtype
        capacity = self._slot_length(dtype, 2 * world + 1)  # two sets of slots, and the reduced one
        v = vector(dtype)
        for start in range(0, n, world * capacity):
            piece = min(world * capacity, n - start)
            part = -(-piece // (world * v)) * v  # elements per rank, a multiple of 16 bytes
            chunk, n_chunks = self._chunking(dtype, part)
            lo, hi = start + min(me * part, piece), start + min((me + 1) * part, piece)
            mine = self._slots(dtype)
            reduced = mine[2 * world * part:2 * world * part + part]
            self._start_barrier(op, self._signature(call_word, n, n_chunks))
            push = self._push(0, src[start:], part, part, piece, me * part, chunk, n_chunks)
            self._reduce(op, src[lo:], mine, part, 0, reduced, hi - lo, chunk, n_chunks, reduce_op,
                         offsets=(lo, part, start), push=push)
            self.streams.fork(world - 1)  # the reduced slot is complete
            push = self._push(1, reduced, 0, hi - lo, NO_LIMIT, (world + me) * part, chunk, n_chunks)
            self._gather(op, reduced, mine[world * part:], part, 1, out[start:], part, part, piece,
                         chunk, n_chunks, offsets=(start, part), push=push)
            self.streams.join(world - 1)
        self.in_flight = False
