"""Two-shot all_reduce: one launch of ``triton_kernels/twoshot.py`` per round (each rank reduces
its share, then gathers the others'), on the one-shot kernel's mailboxes, flags and words."""

from __future__ import annotations

from ..bulk import vector
from ..triton_kernels import twoshot
from . import oneshot
from .base import ONESHOT_PROGRAMS, Algorithm, Call, accumulator, call_word, int64_area
from .context import MAILBOXES

# Set in the op byte of a two-shot launch's call word: it shares the one-shot kernel's flags and
# mailboxes but lays shares out otherwise, so a peer that served the same call one-shot (another
# TDIST_ALGORITHM) must see a different call, not sum half-written slots.
TWOSHOT_CALL_BIT = 1 << 7

GATHERED_FLAGS = int64_area("gathered_flags", lambda world: world * ONESHOT_PROGRAMS,
                            lambda world, heap_bytes: ONESHOT_PROGRAMS)


def launch(ctx, op: str, src, dst, n: int, reduce_op: str, rounds_left: int):
    """One launch of ``twoshot_all_reduce_kernel``: an all_reduce of ``n`` elements, shared out
    in parts of whole 16-byte accesses, each part's blocks spread as one-shot reduce_scatter's
    (``oneshot.grid``)."""
    dtype, step = dst.dtype, vector(dst.dtype)
    part = -(-n // ctx.world // step) * step
    block, programs = oneshot.grid(ctx, dtype, part)
    ctx.launch(op, twoshot.twoshot_all_reduce_kernel, (programs,),
               ctx.heap.ctx, src, dst, ctx.box(dtype), ctx.slot_bytes // dtype.itemsize,
               ctx.area("flags"), ctx.area("gathered_flags"), ctx.area("words"), ctx.area("counter"), n, part,
               call_word(op, dtype, rounds_left) | TWOSHOT_CALL_BIT,
               WORLD=ctx.world, BLOCK=block, ALIGN=step, OP=reduce_op,
               ACC=accumulator(dtype), MAXP=ONESHOT_PROGRAMS, LANES=ctx.lanes,
               **ctx.signalling_meta)
    ctx.check_status(op, dtype, n, oneshot.call_status(ctx))


class TwoShot(Algorithm):
    name = "twoshot"
    serves = ("all_reduce",)

    def areas(self):
        return [oneshot.FLAGS, oneshot.WORDS, oneshot.COUNTER, GATHERED_FLAGS, MAILBOXES]

    def run(self, ctx, call: Call):
        src = call.src
        # a share per rank: half a slot each (slots are whole 256 bytes: halves hold whole shares)
        shares = ctx.world * (ctx.slot_bytes // src.element_size() // 2)
        for start, length, left in ctx.slot_rounds(src.numel(), src.dtype, shares):
            launch(ctx, call.op, src[start:], call.dst[start:], length, call.reduce_op, left)
