"""Bulk: large all_gather (copy-engine pulls), reduce_scatter and all_reduce (pushes in chunks,
reduced as they land) between heaps, by ``torch_tdist.bulk.BulkPath``; its area also serves the
fused overlap ops."""

from __future__ import annotations

from ..bulk import KMAX, BulkPath
from .base import Algorithm, Area, Call, accumulator

# A quarter of the heap (see context.MAILBOXES); its flags first: the start barrier's (one per
# peer), then two sets of KMAX chunk flags per peer.
BULK_AREA = Area("bulk", lambda world, heap_bytes: heap_bytes // 4 // 256 * 256, words=False,
                 regions=lambda world, heap_bytes: ((0, 1), (world, KMAX), (world + world * KMAX, KMAX)))


class Bulk(Algorithm):
    name = "bulk"
    serves = ("all_gather", "reduce_scatter", "all_reduce")

    def __init__(self):
        self.path = None  # the group's BulkPath on its heap

    def areas(self):
        return [BULK_AREA]

    def attach(self, ctx):
        self.path = BulkPath(ctx.heap, ctx.area("bulk"), BULK_AREA.nbytes(ctx.world, ctx.heap_bytes), ctx.launch,
                             accumulator, ctx.config.bulk_push)

    def run(self, ctx, call: Call):
        method = {"all_gather": self.path.all_gather, "reduce_scatter": self.path.reduce_scatter,
                  "all_reduce": self.path.all_reduce}[call.family]
        args = () if call.family == "all_gather" else (call.reduce_op,)
        ctx.bulk_call(call.op, method, call.dst, call.src, *args)
