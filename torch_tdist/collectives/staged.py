"""Staged: reduce, scatter and gather as the publish/pull pair of ``triton_kernels/staged.py``:
every rank stages its data (publish), then pulls what it needs from its peers' staging areas,
in rounds of what the staging area holds."""

from __future__ import annotations

import torch

from ..bulk import aligned, vector
from ..triton_kernels import staged
from .base import ACCUMULATOR, BLOCK, CALL_CODE, DTYPE_CODE, Algorithm, Area, Call, int64_area, programs
from .context import STAGE

# (the arrivals of every rank's publish, then of its pulls: a region each)
SIGNALS = Area("signals", lambda world, heap_bytes: 8 * staged.signal_slots(world),
               regions=lambda world, heap_bytes: ((0, 1), (world, 1)))
HEADER = int64_area("header", lambda world: staged.HEADER_FIXED.value)


def status_slot(ctx) -> torch.Tensor:
    signals, world = ctx.area("signals"), ctx.world
    return signals[2 * world + 2:2 * world + 3]


class Staged(Algorithm):
    name = "staged"
    serves = ("reduce", "scatter", "gather")
    selectable = False
    default = True

    def areas(self):
        return [SIGNALS, HEADER, STAGE]

    def run(self, ctx, call: Call):
        if call.family == "reduce":
            self.reduce(ctx, call)
        elif call.family == "scatter":
            self.scatter(ctx, call)
        else:
            self.gather(ctx, call)

    def reduce(self, ctx, call: Call):
        """``call.dst`` (this rank's tensor) = OP over ranks of ``call.src`` on the root only."""
        src, keeps_result = call.src, call.root == ctx.rank
        for start, length in ctx.rounds(src.numel(), src.dtype):
            self.publish(ctx, call.op, src[start:start + length], count=src.numel())
            self.pull_reduce(ctx, call.op, call.dst[start:start + length], 0, length if keeps_result else 0,
                             call.reduce_op, count=src.numel())

    def scatter(self, ctx, call: Call):
        """``call.src``: the root's packed inputs (None elsewhere); ``call.n``: elements per rank."""
        n, packed, root = call.n, call.src, call.root
        for start, length in ctx.rounds(n, call.dst.dtype, parts=ctx.world):
            if packed is not None:
                self.publish(ctx, call.op, _columns(packed, ctx.world, start, length), count=ctx.world * n)
            self.pull_copy(ctx, call.op, call.dst, [(root, ctx.rank * length, start, length)],
                           count=ctx.world * n)

    def gather(self, ctx, call: Call):
        """``call.dst``: the root's output for every rank's input (None elsewhere)."""
        src, n = call.src, call.src.numel()
        for start, length in ctx.rounds(n, src.dtype):
            self.publish(ctx, call.op, src[start:start + length], count=n)
            if call.dst is None:  # nothing to pull, but the root's header is checked (a wait for
                # the root's publish, so that a root that rejected its call fails it here too)
                self.pull_copy(ctx, call.op, src, [(call.root, 0, 0, 0)], count=n)
            else:
                self.pull_copy(ctx, call.op, call.dst,
                               [(p, 0, p * n + start, length) for p in range(ctx.world)], count=n)

    # ---- the two phases ----------------------------------------------------------------
    def publish(self, ctx, op: str, src: torch.Tensor, count: int):
        """Stage ``src``; ``count`` goes into the header for peers to compare with their own."""
        stage = ctx.stage(src.dtype, src.numel(), op)
        ctx.launch(op, staged.publish_kernel, (programs(src.numel()),),
                   ctx.heap.ctx, src, stage, src.numel(), ctx.empty_header, ctx.area("header"),
                   0, ctx.area("signals"),
                   CALL_CODE[op], DTYPE_CODE[src.dtype], count, WORLD=ctx.world, BLOCK=BLOCK)

    def pull_copy(self, ctx, op: str, out: torch.Tensor, segments, count: int):
        """``count``: how many elements each peer read from must have published."""
        segments = list(segments) or [(ctx.rank, 0, 0, 0)]  # still signals done
        segs = ctx.table(segments, out.device)
        stage = ctx.stage(out.dtype, 0, op)
        longest = max(s[3] for s in segments)
        grid = (programs(longest, per=len(segments)), len(segments))
        is_aligned = aligned(out.dtype, [v for s in segments for v in s[1:]])
        ctx.launch(op, staged.pull_copy_kernel, grid,
                   ctx.heap.ctx, stage, ctx.area("header"), out, segs, ctx.area("signals"),
                   CALL_CODE[op], DTYPE_CODE[out.dtype], count,
                   WORLD=ctx.world, BLOCK=BLOCK,
                   ALIGN=vector(out.dtype) if is_aligned else 1)
        ctx.check_status(op, out.dtype, count, status_slot(ctx))

    def pull_reduce(self, ctx, op: str, out: torch.Tensor, src_offset: int, n: int, reduce_op: str,
                    count: int):
        stage = ctx.stage(out.dtype, 0, op)
        ctx.launch(op, staged.pull_reduce_kernel, (programs(n),),
                   ctx.heap.ctx, stage, ctx.area("header"), out, src_offset, n, ctx.area("signals"),
                   CALL_CODE[op], DTYPE_CODE[out.dtype], count,
                   WORLD=ctx.world, BLOCK=BLOCK, OP=reduce_op, ACC=ACCUMULATOR[out.dtype])
        ctx.check_status(op, out.dtype, count, status_slot(ctx))


def _columns(src: torch.Tensor, parts: int, start: int, length: int) -> torch.Tensor:
    """Elements [start, start + length) of each of the ``parts`` equal parts of flat ``src``."""
    if length * parts == src.numel():
        return src
    return src.view(parts, -1)[:, start:start + length].reshape(-1)
