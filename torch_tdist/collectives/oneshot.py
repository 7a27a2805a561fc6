"""One-shot: every collective in one launch of ``triton_kernels/oneshot.py`` per mailbox slot's
worth (several rounds for a larger message); the default where no other algorithm serves."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import language
from ..bulk import aligned, vector
from ..triton_kernels import oneshot
from .base import BLOCK, ONESHOT_PROGRAMS, Algorithm, Call, accumulator, call_word, int64_area
from .context import MAILBOXES

# Bytes one program moves per step (every rank's share together, so a rank's block is 1/LANES
# of it): 32 KB led 16 KB and 64 KB in CUDA graphs on 4 H200s.
ONESHOT_TILE_BYTES = 32768
# A message of fewer than ONESHOT_PROGRAMS full tiles is spread over every program instead, in
# tiles down to one 16-byte access per thread (faster for small reduce_scatters on H200s).
ONESHOT_MIN_TILE_BYTES = 16 * 32 * 8  # 8 warps
# (every launch of the signalling kernels counts its epoch in a slot per program)
assert ONESHOT_PROGRAMS <= oneshot.EPOCH_SLOTS.value

# The areas the one-shot kernel shares with the two-shot, streamed and low-latency ones.
FLAGS = int64_area("flags", lambda world: oneshot.flag_slots(world, ONESHOT_PROGRAMS),
                   lambda world, heap_bytes: ONESHOT_PROGRAMS)
WORDS = int64_area("words", lambda world: oneshot.word_slots(world, ONESHOT_PROGRAMS))
COUNTER = int64_area("counter", lambda world: oneshot.COUNTER_SLOTS)


def call_status(ctx) -> torch.Tensor:
    """The slot of the counter area where a signalling kernel reports a peer's different call."""
    slot = oneshot.STATUS_SLOT.value
    return ctx.area("counter")[slot:slot + 1]


def grid(ctx, dtype: torch.dtype, n: int | None) -> tuple[int, int]:
    """(elements per tile, programs) of a one-shot or two-shot launch that moves ``n`` elements
    per rank pair: on GPUs tiles of ONESHOT_TILE_BYTES in all, or spread over every program in
    tiles down to ONESHOT_MIN_TILE_BYTES (whole 16-byte accesses). None: every program, full
    tiles."""
    block = BLOCK if language.INTERPRET else max(ONESHOT_TILE_BYTES // dtype.itemsize // ctx.lanes, 16)
    if n is None:
        return block, ONESHOT_PROGRAMS
    if not language.INTERPRET:
        smallest = max(ONESHOT_MIN_TILE_BYTES // dtype.itemsize // ctx.lanes, 16)
        block = max(smallest, min(block, triton.next_power_of_2(-(-n // ONESHOT_PROGRAMS))))
    return block, max(1, min(ONESHOT_PROGRAMS, -(-n // block)))


def launch(ctx, op: str, mode: str, src: torch.Tensor, dst: torch.Tensor, n: int, stride: int = 0,
           reduce_op: str = "sum", root: int = 0, tables=None, offsets=(), rounds_left: int = 1):
    """One launch of ``oneshot_kernel`` (arguments as there); ``offsets``: the element offsets
    the kernel adds to ``src`` or ``dst``, for the alignment it may assume."""
    dtype = dst.dtype
    # (all-to-alls whose counts come in a table: ranks' counts may differ, the grid must not)
    block, programs = grid(ctx, dtype, None if mode == "all_to_all" and n == 0 else n)
    copy = mode in ("all_gather", "broadcast", "all_to_all")
    ctx.launch(op, oneshot.oneshot_kernel, (programs,),
               ctx.heap.ctx, src, dst, ctx.box(dtype), ctx.slot_bytes // dtype.itemsize,
               ctx.area("flags"), ctx.area("words"), ctx.area("counter"), n, stride, root,
               call_word(op, dtype, rounds_left),
               ctx.empty_header if tables is None else tables,
               MODE=mode, WORLD=ctx.world, BLOCK=block,
               ALIGN=vector(dtype) if aligned(dtype, offsets) else 1,
               OP="sum" if copy else reduce_op,
               ACC=accumulator(dtype) if not copy else tl.float32, MAXP=ONESHOT_PROGRAMS,
               LANES=ctx.lanes, **ctx.signalling_meta)
    ctx.check_status(op, dtype, n, call_status(ctx))


class OneShot(Algorithm):
    name = "oneshot"
    serves = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_to_all_v", "broadcast", "barrier")
    default = True

    def areas(self):
        return [FLAGS, WORDS, COUNTER, MAILBOXES]

    def run(self, ctx, call: Call):
        src, dst, n, family = call.src, call.dst, call.n, call.family
        if family == "all_to_all_v":
            launch(ctx, call.op, "all_to_all", src, dst, 0, tables=call.table, offsets=call.offsets)
            return
        if family == "barrier":
            launch(ctx, call.op, "all_reduce", src, dst, 0)
            return
        mode = "all_reduce" if family == "all_reduce" else family
        for start, length, left in ctx.slot_rounds(n, src.dtype):
            if family in ("all_gather", "reduce_scatter"):
                launch(ctx, call.op, mode, src[start:], dst[start:], length, stride=n, reduce_op=call.reduce_op,
                       offsets=(n,), rounds_left=left)
            elif family == "all_to_all":
                parts = [d * n for d in range(ctx.world)]
                tables = (parts + [length] * ctx.world) * 2
                launch(ctx, call.op, mode, src[start:], dst[start:], length,
                       tables=ctx.table(tables, src.device), offsets=tables, rounds_left=left)
            else:  # all_reduce, broadcast
                launch(ctx, call.op, mode, src[start:], dst[start:], length, reduce_op=call.reduce_op,
                       root=call.root, rounds_left=left)
