"""Low-latency: small all_gathers, all_reduces and all-to-alls (and, when forced, reduce_scatters)
in one launch of ``triton_kernels/lowlatency.py``, data and flag stored together as 4-byte words
in 8-byte lines, so that a peer waits on the data itself."""

from __future__ import annotations

import torch
import triton.language as tl

from .. import language
from ..bulk import aligned
from ..triton_kernels import lowlatency
from ..triton_kernels import oneshot as oneshot_kernels
from . import oneshot
from .base import Algorithm, Area, Call, accumulator, call_word

# A slot (per sender and parity) holds up to LOWLATENCY_SLOT_WORDS words, at most a 16th of the
# heap in all; a program moves LOWLATENCY_BLOCK words of every share. (The interpreter runs one
# program, whose tl.reduce calls its combine function per element: small blocks there.)
LOWLATENCY_SLOT_WORDS = 512 if language.INTERPRET else 16384
LOWLATENCY_BLOCK = 512 if language.INTERPRET else 256
LOWLATENCY_REDUCES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                      torch.int32: tl.int32}
# (every launch counts its epoch in a slot per program)
assert LOWLATENCY_SLOT_WORDS // LOWLATENCY_BLOCK <= oneshot_kernels.EPOCH_SLOTS.value


def slot_words(world: int, heap_bytes: int) -> int:
    """Words of a slot on a heap of ``heap_bytes``."""
    return max(4, min(LOWLATENCY_SLOT_WORDS, heap_bytes // 16 // (16 * world) // 4 * 4))


LINES = Area("lines", lambda world, heap_bytes: 8 * 2 * world * slot_words(world, heap_bytes),
             regions=lambda world, heap_bytes: ((0, 2 * slot_words(world, heap_bytes)),))


class LowLatency(Algorithm):
    name = "lowlatency"
    serves = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

    def areas(self):
        return [oneshot.COUNTER, LINES]

    def fits(self, ctx, call: Call) -> bool:
        """Shares of whole 4-byte words, aligned, that fit a slot (and reductions of a dtype the
        kernel reduces)."""
        src, dst = call.src, call.dst
        stride = 0 if call.family == "all_reduce" else call.n
        nbytes = call.pair_bytes
        reducing = call.family in ("all_reduce", "reduce_scatter")
        return (0 < nbytes <= 4 * slot_words(ctx.world, ctx.heap_bytes)
                and nbytes % 4 == 0 and stride * src.element_size() % 4 == 0
                and src.element_size() <= 4 and src.data_ptr() % 4 == 0 and dst.data_ptr() % 4 == 0
                and (not reducing or src.dtype in LOWLATENCY_REDUCES))

    def run(self, ctx, call: Call):
        """One launch of ``lowlatency_kernel``: ``n`` elements per rank pair, ranks' parts
        ``stride`` elements apart (as the one-shot kernel's), moved as 4-byte words."""
        src, dst, mode = call.src, call.dst, call.family
        stride = 0 if mode == "all_reduce" else call.n
        dtype, per_word = src.dtype, 4 // src.element_size()
        words, word_stride = call.n // per_word, stride // per_word
        block = LOWLATENCY_BLOCK
        copy = mode not in ("all_reduce", "reduce_scatter")
        ctx.launch(call.op, lowlatency.lowlatency_kernel, (-(-words // block),),
                   ctx.heap.ctx, src.view(torch.int32), dst.view(torch.int32), ctx.area("lines"),
                   ctx.area("counter"), words, word_stride,
                   call_word(call.op, dtype) + (words << oneshot_kernels.COUNT_SHIFT.value),
                   MODE=mode, WORLD=ctx.world, SLOT=slot_words(ctx.world, ctx.heap_bytes), BLOCK=block,
                   ALIGN=4 if aligned(torch.int32, (word_stride,)) else 1,
                   OP="sum" if copy else call.reduce_op, ACC=accumulator(dtype),
                   DTYPE=LOWLATENCY_REDUCES.get(dtype, tl.int32), PACK=per_word if not copy else 1,
                   LANES=ctx.lanes, **ctx.signalling_meta)
