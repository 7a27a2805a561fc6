"""Streamed: large all_gather, reduce_scatter, all_reduce (two-shot) and even all-to-all in one
launch of ``triton_kernels/streamed.py`` per round, pushes, reductions and copies overlapped in
steps; all-to-alls with split sizes in one launch of its ``streamed_all_to_all_v_kernel``,
shares larger than a mailbox slot in turns."""

from __future__ import annotations

import torch
import triton.language as tl

from .. import language
from ..bulk import aligned, vector
from ..triton_kernels import oneshot as oneshot_kernels
from ..triton_kernels import streamed
from . import oneshot
from .base import NO_COUNT, NO_SHARE_LIMIT, ONESHOT_PROGRAMS, Algorithm, Call, accumulator, call_word, int64_area
from .context import MAILBOXES

# Elements per block under the interpreter: small, so that the tests' messages take several steps.
STREAMED_BLOCK = 256 if language.INTERPRET else None  # None: by the rule in streamed_block
STREAMED_BLOCK_BYTES = 16384
# All-to-alls with split sizes: smaller blocks, more to a step (the same bytes per step), so that
# a small share spreads over more programs (SMs).
UNEVEN_BLOCK_BYTES = 4096
UNEVEN_STEP_BLOCKS = 4
NO_TURNS = 1 << 30  # a ring larger than any share's blocks: no turns (and no acks)
# the rounds left in the call words of streamed_all_to_all_v_kernel (even calls count down to 1):
# an even all-to-all on another rank, whose streamed kernel shares the flags and words but lays
# blocks out otherwise, then differs at once instead of delivering the wrong blocks
SPLIT_SIZES_ROUNDS = 0

STREAMED_FLAGS = int64_area("streamed_flags", lambda world: oneshot_kernels.flag_slots(world, ONESHOT_PROGRAMS),
                            lambda world, heap_bytes: ONESHOT_PROGRAMS)
STREAMED_ACKS = int64_area("streamed_acks", lambda world: oneshot_kernels.flag_slots(world, ONESHOT_PROGRAMS),
                           lambda world, heap_bytes: ONESHOT_PROGRAMS)


def streamed_block(dtype: torch.dtype, longest: int, min_bytes: int) -> int:
    """Elements per block of a streamed launch whose longest share is ``longest`` elements: the
    power of two that spreads it over every program, between ``min_bytes`` and
    STREAMED_BLOCK_BYTES."""
    if STREAMED_BLOCK:
        return STREAMED_BLOCK
    spread = 1 << max(-(-longest * dtype.itemsize // ONESHOT_PROGRAMS) - 1, 1).bit_length()
    return max(min_bytes, min(spread, STREAMED_BLOCK_BYTES)) // dtype.itemsize


def uneven_block(dtype: torch.dtype) -> int:
    return STREAMED_BLOCK or UNEVEN_BLOCK_BYTES // dtype.itemsize


def turns_slot_bytes(dtype: torch.dtype) -> int:
    """The smallest mailbox slot in which streamed_all_to_all_v_kernel moves shares larger than a
    slot in turns: room for two steps of every program."""
    return 2 * UNEVEN_STEP_BLOCKS * ONESHOT_PROGRAMS * uneven_block(dtype) * dtype.itemsize


def turns_ring(ctx, dtype: torch.dtype) -> int | None:
    """Blocks of each program's ring in a mailbox slot where streamed_all_to_all_v_kernel moves
    shares larger than a slot in turns (it needs room for two steps); None where the heap is too
    small for it."""
    if ctx.slot_bytes < turns_slot_bytes(dtype):
        return None
    return ctx.slot_bytes // dtype.itemsize // (ONESHOT_PROGRAMS * uneven_block(dtype))


def launch(ctx, op: str, mode: str, src: torch.Tensor, dst: torch.Tensor, n: int,
           stride: int = 0, reduce_op: str = "sum", rounds_left: int = 1):
    """One launch of ``streamed_kernel`` (arguments as there): all_gather ``n`` input elements,
    ranks' parts ``stride`` apart in ``dst``; reduce_scatter ``n`` output elements, ranks' parts
    ``stride`` apart in ``src``; all_to_all ``n`` per rank pair, ``stride`` apart in both;
    all_reduce ``n`` elements, shared out in parts of whole 16-byte accesses."""
    dtype = dst.dtype
    reducing = mode in ("reduce_scatter", "all_reduce")
    part = -(-n // ctx.world)
    part = -(-part // vector(dtype)) * vector(dtype) if mode == "all_reduce" else 0
    longest = part if mode == "all_reduce" else n
    block = streamed_block(dtype, longest, ctx.config.streamed_min_block_bytes)
    programs = max(1, min(ONESHOT_PROGRAMS, -(-longest // block)))
    ctx.launch(op, streamed.streamed_kernel, (programs,),
               ctx.heap.ctx, src, dst, ctx.box(dtype), ctx.slot_bytes // dtype.itemsize,
               ctx.area("streamed_flags"), ctx.area("words"), ctx.area("counter"), n, stride, part,
               call_word(op, dtype, rounds_left),
               MODE=mode, WORLD=ctx.world, BLOCK=block, STEP=ctx.config.streamed_step_blocks,
               ALIGN=vector(dtype) if aligned(dtype, (stride, part)) else 1,
               OP=reduce_op if reducing else "sum",
               ACC=accumulator(dtype) if reducing else tl.float32,
               MAXP=ONESHOT_PROGRAMS, LANES=ctx.lanes, **ctx.signalling_meta)
    ctx.check_status(op, dtype, n, oneshot.call_status(ctx))


class Streamed(Algorithm):
    name = "streamed"
    serves = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_to_all_v")

    def areas(self):
        return [oneshot.FLAGS, oneshot.WORDS, oneshot.COUNTER, STREAMED_FLAGS, STREAMED_ACKS, MAILBOXES]

    def run(self, ctx, call: Call):
        src, dst, n, family = call.src, call.dst, call.n, call.family
        if family == "all_to_all_v":
            self.all_to_all_v(ctx, call)
            return
        capacity = None
        if family == "all_reduce":  # a share per rank: half a slot each
            capacity = ctx.world * (ctx.slot_bytes // src.element_size() // 2)
            n = src.numel()
        for start, length, left in ctx.slot_rounds(n, src.dtype, capacity):
            launch(ctx, call.op, family, src[start:], dst[start:], length,
                   stride=0 if family == "all_reduce" else n, reduce_op=call.reduce_op, rounds_left=left)

    def share_limit(self, ctx, dtype: torch.dtype) -> int:
        """Any number where larger shares go in turns, else a slot's worth."""
        return NO_SHARE_LIMIT if turns_ring(ctx, dtype) else ctx.slot_bytes // dtype.itemsize

    def share_limit_note(self, ctx, dtype: torch.dtype) -> str:
        heap = turns_slot_bytes(dtype) * 8 * ctx.world
        return f", and from {-(-heap // (1 << 20))} MB on larger shares go in turns, whatever their size"

    def all_to_all_v(self, ctx, call: Call):
        """One launch of ``streamed_all_to_all_v_kernel``: the rank pairs' offsets and counts
        (``call.offsets``, elements) in ``call.table``; the same grid on every rank."""
        dtype = call.dst.dtype
        ctx.launch(call.op, streamed.streamed_all_to_all_v_kernel, (ONESHOT_PROGRAMS,),
                   ctx.heap.ctx, call.src, call.dst, ctx.box(dtype), ctx.slot_bytes // dtype.itemsize,
                   turns_ring(ctx, dtype) or NO_TURNS,
                   ctx.area("streamed_flags"), ctx.area("streamed_acks"), ctx.area("words"), ctx.area("counter"),
                   call_word(call.op, dtype, SPLIT_SIZES_ROUNDS), call.table,
                   WORLD=ctx.world, BLOCK=uneven_block(dtype),
                   STEP=UNEVEN_STEP_BLOCKS, ALIGN=vector(dtype) if aligned(dtype, call.offsets) else 1,
                   MAXP=ONESHOT_PROGRAMS, LANES=ctx.lanes, **ctx.signalling_meta)
        ctx.check_status(call.op, dtype, NO_COUNT, oneshot.call_status(ctx))
