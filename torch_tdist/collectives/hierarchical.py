"""Hierarchical all_gather (``torch_tdist.hierarchical_all_gather``): NVSHMEM puts between nodes,
P2P stores inside a node (``triton_kernels/hierarchical.py``), through the staging area."""

from __future__ import annotations

from .. import language
from ..triton_kernels import hierarchical
from .base import BLOCK, ONESHOT_WARPS, Algorithm, Call, int64_area
from .context import STAGE

TREE_SIGNALS = int64_area("tree_signals", lambda world: world, lambda world, heap_bytes: 1)


class Hierarchical(Algorithm):
    name = "hierarchical"
    serves = ("hierarchical_all_gather",)
    selectable = False
    default = True

    def __init__(self):
        self.epoch = 0

    def areas(self):
        return [TREE_SIGNALS, STAGE]

    def attach(self, ctx):
        self.epoch = 0

    def run(self, ctx, call: Call):
        """``call.dst``: world x ``call.n`` elements of staging, which no peer uses now (the
        executor's barriers around the call see to it)."""
        self.epoch += 1
        meta = {} if language.INTERPRET else {"num_warps": ONESHOT_WARPS}
        ctx.launch(call.op, hierarchical.hierarchical_all_gather_kernel, (1,), ctx.heap.ctx, call.src, call.dst,
                   ctx.area("tree_signals"), call.n, self.epoch, RANKS_PER_NODE=call.ranks_per_node,
                   BLOCK=BLOCK, **meta)
