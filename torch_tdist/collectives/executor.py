"""The executor: one group's state, and each torch.distributed op handed to the algorithm that
routing chooses.

The C++ backend (``torch_tdist._C.ProcessGroupTDist``) validates arguments, counts calls and
calls the :class:`Executor` method of the same name as torch.distributed's function. The
executor makes the group's heap on first use, laid out from what the registered algorithms
declare (``context.lay_out``), checks and records each call's launches (C++ replays a plain
launch for the next call of the same shape: ``_plan``), and stops the group when a peer never
answers.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from datetime import timedelta

import torch

from .. import language
from ..bulk import PUSHERS, BulkPath
from ..config import OVERLAPS, Config
from ..heap import DEFAULT_HEAP_BYTES, TRANSPORTS, SymmetricHeap
from ..transports import PeersMissing
from ..triton_kernels import staged
from . import registry, rejection, routing
from .base import CALL_CODE, DTYPE_CODE, NO_COUNT, Call, flat
from .context import CallContext, lay_out, region_count
from .plans import LaunchPlans
from .streamed import STREAMED_BLOCK_BYTES


class _Output:
    """A flat contiguous buffer to write an op's result into, copied out at the end."""

    def __init__(self, targets: list[torch.Tensor]):
        self.targets = targets
        if len(targets) == 1 and targets[0].is_contiguous():
            self.flat = flat(targets[0])
        else:
            total = sum(t.numel() for t in targets)
            self.flat = flat(torch.empty(total, dtype=targets[0].dtype, device=targets[0].device))

    def finish(self):
        if len(self.targets) == 1 and self.targets[0].is_contiguous():
            return
        start = 0
        for t in self.targets:
            chunk = self.flat[start:start + t.numel()]
            t.copy_(chunk.view(t.dtype if t.dtype != torch.bool else torch.uint8).view(t.shape))
            start += t.numel()


class Executor(LaunchPlans):
    """Runs one process group's collectives on its symmetric heap (created on first use)."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta, options=None):
        self.config = Config.from_options(options, choices={
            "transport": TRANSPORTS, "algorithm": registry.selectable(), "overlap": OVERLAPS,
            "bulk_push": PUSHERS, "streamed_min_block_bytes": (16, STREAMED_BLOCK_BYTES)})
        config = self.config
        self.served_devices = ["cpu"] if language.INTERPRET else ["cuda"] if config.gpu_kernels else []
        self.transport, self.heap_bytes = config.transport, config.heap_bytes
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self.group_name = "?"  # set by the C++ backend once torch names the group
        self.algorithms = registry.create()
        self._heap = None
        self._ctx = None  # the call context on the group's heap
        self._heaps_made = 0
        # why this group can serve no more collectives (also read by the C++ backend before a
        # fused call it issues: csrc/fused_calls.cpp)
        self._stopped = None
        self._calls = 0  # the calls the executor began: the same count on every rank (rejection.key)
        # The group's abort word, a page of its own (a GPU can map it): the C++ backend sets it
        # (ProcessGroupTDist.abort()), waits give up and calls refuse once it is set.
        self._abort_page = mmap.mmap(-1, mmap.PAGESIZE)
        self._abort_word = ctypes.c_int64.from_buffer(self._abort_page)
        self.abort_word_address = ctypes.addressof(self._abort_word)
        # the rest of the page (language.PAGE_REGIONS), for the C++ watchdog: (word of the first
        # region, regions, word of the first stuck record, records)
        regions = region_count(world_size, self.algorithms.values())
        if regions > language.MAX_REGIONS.value:
            raise RuntimeError(f"tdist: {regions} signal regions; the abort page holds {language.MAX_REGIONS.value}")
        self.abort_page_layout = (language.PAGE_REGIONS.value, regions,
                                  language.PAGE_STUCK.value, language.STUCK_RECORDS.value)
        self._launched = []  # (kernel, compiled, grid, args, meta) of the call being served
        self._replayable = True  # whether the call is only what _launched holds
        self._planned = []  # tensors that launch plans point to
        self._check_calls = language.INTERPRET or config.check_calls
        self.algorithm = config.algorithm
        self.bulk_pusher = config.bulk_push  # None: the device's default
        self.streamed_step_blocks = config.streamed_step_blocks
        self.streamed_min_block_bytes = config.streamed_min_block_bytes
        self.overlap = config.overlap
        # op -> (most bytes the one-shot kernels serve, bytes from which another algorithm does)
        self.gpu_size_limits = routing.gpu_size_limits(config)
        self.gpu_uneven_all_to_all = config.uneven_all_to_all or not self.gpu_size_limits
        # read by the C++ backend: a GPU call past the timeout takes the process down (README)
        self.tear_down_on_timeout = config.tear_down_on_timeout

    # ---- state -------------------------------------------------------------------------
    @property
    def _bulk(self):
        return self.algorithms["bulk"].path

    @property
    def mailbox_bytes(self) -> int:
        """Bytes of a mailbox slot: what one rank may send another in one turn."""
        return self._ctx.slot_bytes

    def _ensure_heap(self, device: torch.device, op: str):
        if self._ctx is not None:
            if device != self._heap.device:
                raise ValueError(
                    f"tdist {op}: tensors are on {device}, but this group's symmetric heap is on "
                    f"{self._heap.device} (one device per rank and group)")
            return
        nbytes = self.heap_bytes or DEFAULT_HEAP_BYTES[device.type]
        # each heap its own store keys: a peer could still read the handles of one that failed
        self._heaps_made += 1
        try:
            heap = SymmetricHeap(self.store, self.rank, self.world_size, nbytes, self.timeout, device=device,
                                 transport=self.transport, key=f"tdist_heap_{self._heaps_made}",
                                 abort_address=self.abort_word_address)
        except PeersMissing as err:
            raise TimeoutError(f"tdist {op}: Timed out after {self.timeout.total_seconds():g} s (rank "
                               f"{self.rank} of {self.world_size}, group '{self.group_name}'): {err}") from err
        try:  # the group's own buffers (a heap too small for them raises)
            ctx = CallContext(heap, nbytes, self.rank, self.world_size, self.config,
                              lay_out(heap, nbytes, self.world_size, self.algorithms.values()),
                              self._launch, self._check_status, self._peer_timeouts)
            ctx.bulk_call = self._bulk_call
            for algorithm in self.algorithms.values():
                algorithm.attach(ctx)
        except BaseException:
            heap.close()
            raise
        self._heap, self._ctx = heap, ctx
        self._publish_signal_regions()

    def _default_device(self) -> torch.device:
        if self._heap is not None:
            return self._heap.device
        if self.served_devices == ["cuda"]:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def heap(self) -> SymmetricHeap:
        self._ensure_heap(self._default_device(), "get_heap")
        return self._heap

    def _begin(self, op: str, tensor: torch.Tensor | None):
        if self._abort_word.value:
            raise RuntimeError(f"tdist {op}: this group was aborted; destroy it and create a new one")
        if self._stopped:
            raise RuntimeError(f"tdist {op}: this group stopped after {self._stopped}; destroy it "
                               f"and create a new one")
        device = self._default_device() if tensor is None else _canonical(tensor.device)
        self._ensure_heap(device, op)
        self._calls += 1
        self._launched = []
        self._replayable = True

    def _serve(self, call: Call):
        """``call`` by the algorithm routing chooses."""
        routing.choose(self.algorithms.values(), self.algorithm, self._ctx, call).run(self._ctx, call)

    def _bulk_call(self, op: str, method, out: torch.Tensor, src: torch.Tensor, *args):
        """``method(op, call word, out, src, *args)`` of the bulk path. It is copies and stream
        signals besides its launches, so C++ never replays it; one that fails after its start
        barrier leaves flags behind on its peers, so the group stops."""
        self._replayable = False
        with self._peer_timeouts(op):
            try:
                method(op, CALL_CODE[op] | DTYPE_CODE[src.dtype] << 8, out, src, *args)
            except Exception as err:
                if self._bulk.in_flight:
                    self._bulk.in_flight = False
                    self._stopped = f"{op} failed part-way ({type(err).__name__})"
                raise

    def _launch(self, op: str, kernel, grid, *args, **meta):
        with self._peer_timeouts(op):
            compiled = kernel[grid](*args, **meta)
            if not language.INTERPRET and self._replayable:
                self._launched.append((kernel, compiled, grid, args, meta))
            return compiled

    @contextlib.contextmanager
    def _peer_timeouts(self, op: str):
        """A peer that never signalled ends this group: peers and this rank now disagree on
        where the group is, so it refuses further work."""
        try:
            yield
        except _GroupStopped:
            raise
        except Exception as err:
            cause = err
            while cause is not None and not isinstance(cause, language.PeerTimeoutError):
                cause = cause.__cause__
            if cause is None:
                raise
            aborted = isinstance(cause, language.GroupAbortedError)
            self._stopped = f"{op} was aborted" if aborted else f"{op} timed out waiting for a peer"
            missing = self._missing_peers(cause)
            arrived = f"rank(s) {', '.join(map(str, missing))} did not arrive; " if missing else ""
            what = "Aborted" if aborted else f"Timed out after {self.timeout.total_seconds():g} s"
            raise _GroupStopped(f"tdist {op}: {what} (rank {self.rank} of {self.world_size}, group "
                                f"'{self.group_name}'): {arrived}{cause}") from err

    def _publish_signal_regions(self):
        """Writes the signal regions the algorithms declared into the abort word's page
        (language.PAGE_REGIONS)."""
        words = [v for region in self._ctx.signal_regions() for v in region]
        first, most = language.PAGE_REGIONS.value, self.abort_page_layout[1]
        page = (ctypes.c_int64 * (first + 3 * most)).from_buffer(self._abort_page)
        page[first:first + 3 * most] = words + [0] * (3 * most - len(words))

    def _missing_peers(self, timeout: language.PeerTimeoutError) -> list[int]:
        """The peers whose slot, in the signal array and position a timed-out wait watched, does
        not hold what the wait wanted (CPU heaps: the slots are host memory)."""
        if timeout.address is None or self._heap is None or self._heap.device.type != "cpu":
            return []
        for first, stride, peers in self._ctx.signal_regions():
            index = (timeout.address - first) // 8
            if 0 <= index < stride * peers and (timeout.address - first) % 8 == 0:
                position = index % stride
                return [p for p in range(peers) if p != self.rank and not timeout.satisfied(
                    ctypes.c_int64.from_address(first + 8 * (p * stride + position)).value)]
        return []

    def _check_status(self, op: str, dtype: torch.dtype, count: int, status_slot):
        """Raise if a kernel saw a peer whose call differs from ours (on GPUs this reads device
        memory, so it runs only with TDIST_CHECK_CALLS=1)."""
        if not self._check_calls:
            return
        status = int(status_slot[0])
        if status == staged.STATUS_OK.value:
            return
        status_slot.zero_()
        peer, kind = status // 4 - 1, status % 4
        reason = self._rejection(peer)
        if reason is not None:
            raise ValueError(f"tdist {op}: rank {peer} rejected its arguments of this call, so the call "
                             f"failed; the group serves the next one (rank {peer}: {reason})")
        if kind == staged.STATUS_SIZE_MISMATCH.value:
            raise ValueError(
                f"tdist {op}: rank {peer} sends this rank a different number of elements than this "
                f"rank's output sizes expect (split sizes must agree across ranks)")
        what = f"{count} {str(dtype).replace('torch.', '')} elements" if count != NO_COUNT else str(dtype)
        raise ValueError(
            f"tdist {op}: rank {peer} made a different call than this rank ({op} of {what}): "
            f"another collective, dtype or element count (or another TDIST_ALGORITHM). Every rank of "
            f"a group must make the same calls in the same order with matching tensors")

    def _rejection(self, peer: int) -> str | None:
        """``peer``'s reason for rejecting the call being served, if it rejected it."""
        found = rejection.key(self._calls, peer)
        return self.store.get(found).decode() if self.store.check([found]) else None

    def reject(self, op: str, tensor: torch.Tensor, root: int, reason: str):
        """This rank's arguments of ``op`` failed the C++ checks, which raise ``reason`` once this
        returns: stand in for the call so that the peers raise too (collectives/rejection.py).
        ``tensor``: this rank's tensor that sizes the call; ``root``: its root rank."""
        if self._stopped or self._abort_word.value:
            return  # (the group serves no calls: neither do the peers)
        self._begin(op, tensor)
        self.store.set(rejection.key(self._calls, self.rank), reason)
        call = rejection.stand_in(op, tensor, root, self.world_size, self.rank)
        if call is None or not self._check_calls:
            return  # the peers learn of it at their timeout
        self._ctx.first_round_only = True  # (the peers stop after theirs: it differs)
        try:
            routing.choose(self.algorithms.values(), self.algorithm, self._ctx, call).run(self._ctx, call)
        except ValueError:
            pass  # the peers' calls differ from the stand-in, as they should
        finally:
            self._ctx.first_round_only = False
            if self._stopped:  # (named after the call the user made)
                self._stopped = self._stopped.replace("rejected", f"{op} (rejected here)", 1)

    # ---- the collectives (names as in torch.distributed) ---------------------------------
    def all_gather_into_tensor(self, output, input):
        self._gather_to_all("all_gather_into_tensor", [output], input)
        return self._plan(input, output)

    def all_gather(self, outputs, input):
        self._gather_to_all("all_gather", list(outputs), input)

    def _gather_to_all(self, op, targets, input):
        self._begin(op, input)
        src = flat(input)
        out = _Output(targets)
        self._serve(Call(op, "all_gather", src, out.flat, src.numel()))
        out.finish()

    def reduce_scatter_tensor(self, output, input, op):
        self._reduce_scatter("reduce_scatter_tensor", output, flat(input), op)
        return self._plan(input, output)

    def reduce_scatter(self, output, inputs, op):
        self._reduce_scatter("reduce_scatter", output, torch.cat([flat(t) for t in inputs]), op)

    def _reduce_scatter(self, name, output, src, reduce_op):
        self._begin(name, output)
        out = _Output([output])
        self._serve(Call(name, "reduce_scatter", src, out.flat, output.numel(), reduce_op))
        out.finish()

    def all_reduce(self, tensor, op):
        self._begin("all_reduce", tensor)
        src = flat(tensor)
        out = _Output([tensor])
        self._serve(Call("all_reduce", "all_reduce", src, out.flat, src.numel(), op))
        out.finish()
        return self._plan(tensor, tensor)

    def reduce(self, tensor, dst, op):
        self._begin("reduce", tensor)
        out = _Output([tensor])
        self._serve(Call("reduce", "reduce", flat(tensor), out.flat, tensor.numel(), op, root=dst))
        if dst == self.rank:
            out.finish()

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes):
        """No split sizes: even splits, called so on every rank (the C++ backend passes none then)."""
        if not output_split_sizes and not input_split_sizes:
            self._exchange_even("all_to_all_single", output, flat(input))
            return self._plan(input, output)
        rows_in, rows_out = max(input.shape[0], 1), max(output.shape[0], 1)
        row_in = input.numel() // rows_in if input.shape[0] else _row_numel(input)
        row_out = output.numel() // rows_out if output.shape[0] else _row_numel(output)
        table = self._exchange("all_to_all_single", [output], [row_out * s for s in output_split_sizes],
                               flat(input), [row_in * s for s in input_split_sizes])
        return self._plan(input, output, table)

    def all_to_all(self, outputs, inputs):
        src = torch.cat([flat(t) for t in inputs])
        self._exchange("all_to_all", list(outputs), [t.numel() for t in outputs],
                       src, [t.numel() for t in inputs])

    def _exchange_even(self, op, output, src):
        """An all-to-all where every rank sends every rank the same count, and every rank knows
        it: the grid may follow the count, and a large message goes in rounds."""
        self._begin(op, src)
        out = _Output([output])
        self._serve(Call(op, "all_to_all", src, out.flat, src.numel() // self.world_size))
        out.finish()

    def _uneven(self, src: torch.Tensor):
        """The algorithm that serves all-to-alls with split sizes of ``src``'s dtype (every rank
        alike: no size test)."""
        call = Call("all_to_all_single", "all_to_all_v", src, src, 0)
        return routing.choose(self.algorithms.values(), self.algorithm, self._ctx, call)

    def uneven_share_limit(self, tensor: torch.Tensor) -> int:
        """The most elements an all-to-all with split sizes of ``tensor``'s dtype may send one rank."""
        return self._uneven(tensor).share_limit(self._ctx, tensor.dtype)

    def _exchange(self, op, targets, recv_counts, src, send_counts) -> torch.Tensor:
        """An all-to-all of the given counts (elements) through a kernel that reads them from a
        table; returns the table."""
        self._begin(op, src)
        out = _Output(targets)
        algorithm = self._uneven(src)
        capacity = algorithm.share_limit(self._ctx, src.dtype)
        # A pair too large for its mailbox (where no turns are taken) moves nothing, and both of its
        # ranks raise after the launch: the group's other ranks cannot know, and must not wait for
        # them in vain.
        sent = [0 if c > capacity else c for c in send_counts]
        received = [0 if c > capacity else c for c in recv_counts]
        tables = _offsets(send_counts) + sent + _offsets(recv_counts) + received
        table = self._ctx.table(tables, src.device)
        algorithm.run(self._ctx, Call(op, "all_to_all_v", src, out.flat, 0, table=table, offsets=tables))
        out.finish()
        if sent != send_counts or received != recv_counts:
            too_large = {r for r, c in enumerate(send_counts) if c > capacity}
            too_large |= {r for r, c in enumerate(recv_counts) if c > capacity}
            raise ValueError(
                f"tdist {op}: {max(send_counts + recv_counts)} elements between rank {self.rank} and "
                f"rank(s) {', '.join(map(str, sorted(too_large)))}, but a mailbox holds {capacity} "
                f"{str(src.dtype).replace('torch.', '')} elements, so nothing moved between them (the "
                f"other ranks' shares did); raise TDIST_HEAP_SIZE (or the backend option 'heap_size'): "
                f"a mailbox is 1/(8 x world size) of the heap{algorithm.share_limit_note(self._ctx, src.dtype)}")
        return table

    def broadcast(self, tensor, src):
        self._begin("broadcast", tensor)
        data = flat(tensor)
        out = _Output([tensor])
        self._serve(Call("broadcast", "broadcast", data, out.flat, data.numel(), root=src))
        if self.rank != src:
            out.finish()
        return self._plan(tensor, tensor)

    def scatter(self, output, inputs, src):
        self._begin("scatter", output)
        packed = torch.cat([flat(t) for t in inputs]) if self.rank == src else None
        out = _Output([output])
        self._serve(Call("scatter", "scatter", packed, out.flat, output.numel(), root=src))
        out.finish()

    def gather(self, outputs, input, dst):
        self._begin("gather", input)
        src = flat(input)
        out = _Output(list(outputs)) if self.rank == dst else None
        self._serve(Call("gather", "gather", src, None if out is None else out.flat, src.numel(), root=dst))
        if out is not None:
            out.finish()

    def hierarchical_all_gather(self, output, input, ranks_per_node: int):
        """all_gather_into_tensor as between nodes of ``ranks_per_node`` ranks: NVSHMEM puts
        between nodes, P2P stores inside (collectives/hierarchical.py). Runs on the caller's
        stream."""
        op = "hierarchical_all_gather"
        world = self.world_size
        if ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"tdist {op}: ranks_per_node={ranks_per_node} does not divide the "
                             f"group's {world} ranks")
        if output.dtype != input.dtype or output.numel() != world * input.numel():
            raise ValueError(f"tdist {op}: output must hold {world} x {input.numel()} elements of "
                             f"{input.dtype}; got {output.numel()} of {output.dtype}")
        self._begin(op, input)
        if self._heap.device.type == "cuda" and self._heap.transport not in ("nvshmem", "rocshmem"):
            raise ValueError(f"tdist {op}: its puts between nodes are NVSHMEM (ROCSHMEM) calls; create "
                             f"the group with TDIST_TRANSPORT=nvshmem (rocshmem on AMD GPUs; this one "
                             f"uses {self._heap.transport})")
        src = flat(input)
        n = src.numel()
        gathered = self._ctx.stage(src.dtype, world * n, op)[:world * n]
        self.barrier()  # every peer is done with the staging area this call writes into
        self._serve(Call(op, op, src, gathered, n, ranks_per_node=ranks_per_node))
        output.copy_(gathered.view(output.shape))
        self.barrier()  # no peer writes the next call's chunks here before the copy above

    # ---- interface for torch_tdist.overlap ----
    # What the overlap ops (torch_tdist/overlap/) use of a group's executor besides rank,
    # world_size, overlap and heap; they read nothing else of it.
    def attached(self, key: str, make):
        """The object ``make(self)`` made for this group under ``key`` on the first call and kept
        with the group (the overlap ops' state); each one's ``close()`` runs when the group
        closes, before its heap goes."""
        attached = self.__dict__.setdefault("_attached", {})
        found = attached.get(key)
        if found is None:
            found = attached[key] = make(self)
        return found

    def close_attached(self):
        """Close what ``attached`` made (from ``close``, while the heap is still there)."""
        for found in self.__dict__.get("_attached", {}).values():
            found.close()

    def begin_call(self, op: str, tensor: torch.Tensor):
        """Start serving ``op`` on ``tensor``'s device, as every collective starts: raises once
        the group was aborted or stopped, makes the heap on first use."""
        self._begin(op, tensor)

    @property
    def bulk(self) -> BulkPath:
        """The group's bulk path (made with the heap: after ``begin_call``)."""
        return self._bulk

    def bulk_call(self, op: str, method, out: torch.Tensor, src: torch.Tensor, *args):
        """``method(op, call word, out, src, *args)`` of the bulk path, as the collectives call it
        (``_bulk_call``: a peer that never signals, or a failure part-way, stops the group)."""
        self._bulk_call(op, method, out, src, *args)

    def launch(self, op: str, kernel, grid, *args, **meta):
        """Launch ``kernel`` for ``op`` as the collectives do (``_launch``)."""
        return self._launch(op, kernel, grid, *args, **meta)

    def replayable_launch(self, kernel, compiled, grid, args, meta, bind):
        """A recorded launch as C++ replays it (``_launch_tuple``), or None."""
        return self._launch_tuple(kernel, compiled, grid, args, meta, bind)

    @property
    def checks_calls(self) -> bool:
        """Whether calls are checked against the peers' (TDIST_CHECK_CALLS=1, the interpreter)."""
        return self._check_calls

    def run_unplanned(self, op: str, run):
        """``run()``: work of ``op`` that is not launches C++ could replay as the call's plan (a
        recorded stream program); where it raises, the group stops (peers may be left part-way)."""
        self._replayable = False
        try:
            return run()
        except Exception as err:
            self._stopped = f"{op} failed part-way ({type(err).__name__})"
            raise
    # ---- end of the interface for torch_tdist.overlap ----

    def barrier(self):
        self._begin("barrier", None)
        nothing = torch.empty(0, dtype=torch.uint8, device=self._heap.device)
        self._serve(Call("barrier", "barrier", nothing, nothing, 0))

    def close(self):
        if self._ctx is not None:
            self.close_attached()  # (interface for torch_tdist.overlap)
            self._ctx.close()
            self._planned.clear()
            self._heap.close()
            self._heap = self._ctx = None


class _GroupStopped(TimeoutError):
    """A collective timed out waiting for a peer; the group serves no more calls."""


def _canonical(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _offsets(counts):
    offsets, total = [], 0
    for c in counts:
        offsets.append(total)
        total += c
    return offsets


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n
