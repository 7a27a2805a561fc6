"""The call context: what an algorithm launches through, one per group and heap.

The executor lays the heap out from what the registered algorithms declare (:func:`lay_out`),
then hands every algorithm a :class:`CallContext`: the heap and its areas, this rank, the world
size, the group's config, cached views and tables, and ``launch`` (which records launches for
C++ to replay and turns a peer's timeout into the group's stop).
"""

from __future__ import annotations

import torch
import triton

from .. import language
from .base import ONESHOT_WARPS, Area


def lay_out(heap, heap_bytes: int, world: int, algorithms) -> dict:
    """Allocate every area the ``algorithms`` declare on ``heap`` (an area several declare, once):
    the int64 areas first, then the byte areas, each in the order first declared. Returns
    name -> (Area, int64 tensor or byte offset)."""
    declared = {}
    for algorithm in algorithms:
        for area in algorithm.areas():
            declared.setdefault(area.name, area)
    laid = {}
    for area in sorted(declared.values(), key=lambda a: not a.words):  # (a stable sort)
        nbytes = area.nbytes(world, heap_bytes)
        laid[area.name] = (area, heap.empty(nbytes // 8, torch.int64) if area.words else heap.alloc(nbytes))
    return laid


def region_count(world: int, algorithms) -> int:
    """How many signal regions the ``algorithms`` declare (language.PAGE_REGIONS)."""
    declared = {area.name: area for algorithm in algorithms for area in algorithm.areas()}
    return sum(len(area.regions(world, 0)) for area in declared.values())


class CallContext:
    """One group's heap as its algorithms see it. ``launch(op, kernel, grid, *args, **meta)``
    launches (and records) a kernel; ``check_status(op, dtype, count, status_slot=None)`` raises
    where a kernel saw a peer's different call; ``peer_timeouts(op)`` is the context in which
    a peer's timeout stops the group."""

    def __init__(self, heap, heap_bytes: int, rank: int, world: int, config, laid: dict,
                 launch, check_status, peer_timeouts):
        self.heap, self.heap_bytes, self.rank, self.world, self.config = heap, heap_bytes, rank, world, config
        self.device = heap.device
        self.lanes = triton.next_power_of_2(world)  # kernels signal every rank at once, a lane each
        self.laid = laid
        self.launch, self.check_status, self.peer_timeouts = launch, check_status, peer_timeouts
        self._views = {}
        self._tables = {}
        self._captured_tables = {}  # values -> (pinned values or None, device table): tables CUDA graphs use
        self.empty_header = torch.zeros(1, dtype=torch.int64, device=heap.device)
        self.first_round_only = False  # a stand-in for a rejected call (rejection.py) runs one
        # Launch options of the signalling kernels: they may start while the kernel before them
        # runs (programmatic dependent launch; they wait for it in the kernel).
        pdl = language.DEPENDENT_LAUNCH and config.dependent_launch
        self.signalling_meta = {} if language.INTERPRET else {"num_warps": ONESHOT_WARPS,
                                                              **({"launch_pdl": True} if pdl else {})}

    def area(self, name: str):
        """The int64 tensor or byte offset laid out for area ``name``."""
        return self.laid[name][1]

    def signal_regions(self):
        """(first slot's address, slots per peer, peers) of every signal array the kernels wait
        on, as the areas declare them."""
        for area, where in self.laid.values():
            first = where.data_ptr() if area.words else self.heap.base_address(self.rank) + where
            for word, per_peer in area.regions(self.world, self.heap_bytes):
                yield first + 8 * word, per_peer, self.world

    # ---- the mailboxes and the staging area (areas "box" and "stage") -------------------
    @property
    def slot_bytes(self) -> int:
        """Bytes of a mailbox slot: what one rank may send another in one turn."""
        return slot_bytes(self.world, self.heap_bytes)

    def box(self, dtype: torch.dtype) -> torch.Tensor:
        return self.view(self.area("box"), 2 * self.world * self.slot_bytes, dtype)

    @property
    def stage_bytes(self) -> int:
        return stage_bytes(self.world, self.heap_bytes)

    def stage(self, dtype: torch.dtype, numel: int, op: str) -> torch.Tensor:
        if numel * dtype.itemsize > self.stage_bytes:
            raise ValueError(
                f"tdist {op}: {numel * dtype.itemsize} bytes to stage but the symmetric heap "
                f"holds {self.stage_bytes}; raise TDIST_HEAP_SIZE (or the backend option 'heap_size')")
        return self.view(self.area("stage"), self.stage_bytes, dtype)

    def rounds(self, numel: int, dtype: torch.dtype, parts: int = 1) -> list[tuple[int, int]]:
        """(start, length) pieces of ``numel`` elements per part such that ``parts`` pieces fit
        the staging area together: messages larger than the heap go in several rounds."""
        capacity = self.stage_bytes // dtype.itemsize // parts
        if capacity == 0:
            raise ValueError(f"tdist: the symmetric heap is too small to stage {parts} elements of "
                             f"{dtype}; raise TDIST_HEAP_SIZE (or the backend option 'heap_size')")
        pieces = [(s, min(capacity, numel - s)) for s in range(0, numel, capacity)] or [(0, 0)]
        return pieces[:1] if self.first_round_only else pieces

    def slot_rounds(self, numel: int, dtype: torch.dtype, capacity: int | None = None):
        """(start, length, rounds left) of the pieces of ``numel`` elements, ``capacity`` each
        (None: a mailbox slot's). Rounds left go into the call words (base.call_word)."""
        capacity = self.slot_bytes // dtype.itemsize if capacity is None else capacity
        starts = range(0, numel, capacity)
        return [(s, min(capacity, numel - s), len(starts) - i) for i, s in enumerate(starts)] or [(0, 0, 1)]

    # ---- cached views and tables --------------------------------------------------------
    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat ``dtype`` view of heap bytes; cached, since every call asks for one."""
        view = self._views.get((offset, dtype))
        if view is None:
            view = self.heap.view(offset, (nbytes // dtype.itemsize,), dtype)
            self._views[(offset, dtype)] = view
        return view

    def table(self, values, device) -> torch.Tensor:
        """An int64 table (segments, a header) on the device; cached, so a repeated op costs no copy."""
        key = tuple(values)
        table = self._tables.get(key)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing:
            kept = self._captured_tables.get(key)
            if kept is None:
                if table is not None:  # written already; the cache may drop it before a graph's last replay
                    kept = (None, table)
                else:  # written by a copy each graph makes at each replay (a blocking one may not be captured)
                    kept = (torch.tensor(values, dtype=torch.int64).pin_memory(),
                            torch.empty(len(values), dtype=torch.int64, device=device))
                self._captured_tables[key] = kept  # as long as the group; graphs share it (same values)
            host, table = kept
            if host is not None:
                table.copy_(host, non_blocking=True)
        elif table is None:
            if len(self._tables) >= 256:
                self._tables.clear()
            table = torch.tensor(values, dtype=torch.int64, device=device)
            self._tables[key] = table
        if table.is_cuda:  # calls on other streams may use it: not freed before their work is done
            table.record_stream(torch.cuda.current_stream(device))
        return table

    def close(self):
        self._views.clear()
        self._tables.clear()


def slot_bytes(world: int, heap_bytes: int) -> int:
    return heap_bytes // 8 // world // 256 * 256


def stage_bytes(world: int, heap_bytes: int) -> int:
    return heap_bytes // 4


# A quarter each: the mailboxes (two slots per peer), the bulk path's area, staging, and users'
# own symmetric buffers (torch_tdist.get_heap(group).empty(...)).
MAILBOXES = Area("box", lambda world, heap_bytes: 2 * world * slot_bytes(world, heap_bytes), words=False)
STAGE = Area("stage", stage_bytes, words=False)
