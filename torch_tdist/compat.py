"""torch.distributed's names for the single-tensor gather and reduce-scatter, on every torch this
library supports. torch 2.13 renamed them (``all_gather_into_tensor`` became
``all_gather_single``, ``reduce_scatter_tensor`` became ``reduce_scatter_single``, and likewise in
the functional collectives); the old names still work there but warn. torch 2.11 has only the old
ones. The library, its tests and benchmarks call these."""

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
funcol_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
funcol_all_gather_coalesced = (getattr(funcol, "all_gather_single_coalesced", None)
                               or funcol.all_gather_into_tensor_coalesced)
funcol_reduce_scatter_coalesced = (getattr(funcol, "reduce_scatter_single_coalesced", None)
                                   or funcol.reduce_scatter_tensor_coalesced)
