"""Compute-communication ops for tensor parallelism: all-gather + matmul and matmul +
reduce-scatter.

``all_gather_matmul(a_shard, b, group=None, gather_dim=0, return_a=False)`` is
``all_gather(a_shard, gather_dim) @ b``; ``b`` may be a list of matrices sharing one gather (q/k/v
projections), and then a list of outputs comes back. ``matmul_reduce_scatter(a, b, group=None,
scatter_dim=0, reduce_op="sum")`` is this rank's shard of ``reduce_scatter(a @ b, scatter_dim)``,
summed or averaged over the group. Users reach them as ``torch_tdist.ops.*``: ``torch_tdist/ops.py``
re-exports this package's public functions under the name they have always had, and this package
holds the code.

Both are ``torch.ops.tdist.all_gather_matmul`` / ``torch.ops.tdist.matmul_reduce_scatter`` custom
ops that take the group by name, with fake kernels (torch.compile traces them with
``fullgraph=True``) and autograd: the input gradient of one is the other, the weight gradient a
matmul with the gathered operand (``custom_ops.py``).

How they run (``TDIST_OVERLAP``, read with the group's other options: ``config.OVERLAPS``):
the sequential path (the group's collective, then ``torch.matmul``); pipelined (the copy engines
move chunks while torch.matmul takes the ones that have landed, ``pipelined.py``, its steps
recorded once and replayed from C++ and CUDA graphs, ``replay.py``); or fused (one Triton kernel
computes tiles as their chunks land, ``fused.py``), one of their tile configs. With "tune" the
group times them all on a shape's first call and keeps the fastest, so a shape where overlap
cannot pay stays sequential (``tuning.py``). The overlapped ways gather or scatter rows: another
``gather_dim`` / ``scatter_dim`` is moved to the front first (free when the dimensions before it
have size 1, a copy otherwise) and back after. Each group's state between calls (tuned shapes,
recorded programs and their graphs, counters) is one ``OverlapState`` (``state.py``; ``state(group)``).

What this package uses of the layers below, and nothing else of them:

- the group's C++ backend (``backend._tdist_backend(group)``): ``executor``, ``check_open(op)``,
  ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` (a call issued from C++ the way
  its signature's first call ran; None for a new signature) and ``remember_fused`` (how it ran),
  ``watch_queued(op, device_index)`` (the watchdog), ``order_queued(device_index)`` (one stream
  order per group);
- its executor (``collectives.Executor``): ``rank``, ``world_size``, ``overlap`` (the policy),
  ``heap``, and the block marked "interface for torch_tdist.overlap": ``attached(key, make)``
  (per-group state, closed with the group), ``begin_call(op, tensor)``, ``bulk`` (the group's
  ``BulkPath``: capacities, ``kernel_meta``, its gather/scatter calls, ``matmul``, ``streams``),
  ``bulk_call(op, method, out, src, *args)``, ``launch(op, kernel, grid, *args, **meta)``,
  ``replayable_launch(...)``, ``checks_calls``, ``run_unplanned(op, run)``;
- ``collectives.base.LAUNCH_ROLE_PTR`` (the launch-plan format C++ replays), ``bulk.KMAX``,
  ``bulk.aligned``, ``bulk.vector``, ``language.INTERPRET``, and the kernels of
  ``triton_kernels/overlap.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..backend import _tdist_backend
from . import custom_ops  # noqa: F401  (registers torch.ops.tdist.*)
from .state import OverlapState, state_of

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "state", "OverlapState"]


def all_gather_matmul(a_shard: Tensor, b, group=None, gather_dim: int = 0, return_a: bool = False):
    """``all_gather(a_shard, gather_dim) @ b`` over ``group`` (a tdist group; None: the default
    group). ``b``: a [K, N] matrix or a list of them (one output each). With ``return_a``, returns
    ``(a_full, out)``."""
    bs = list(b) if isinstance(b, (list, tuple)) else [b]
    pg, backend = _group(group)
    found = backend.fused_all_gather_matmul(a_shard, bs, gather_dim, return_a) if _direct(a_shard, *bs) else None
    if found is None:  # (the custom op: autograd, torch.compile, a new signature...)
        found = torch.ops.tdist.all_gather_matmul(a_shard, bs, pg.group_name, gather_dim, return_a)
    a_full, outs = found
    out = outs if isinstance(b, (list, tuple)) else outs[0]
    return (a_full, out) if return_a else out


def matmul_reduce_scatter(a: Tensor, b: Tensor, group=None, scatter_dim: int = 0, reduce_op: str = "sum"):
    """This rank's shard of ``reduce_scatter(a @ b, scatter_dim)`` over ``group`` (a tdist group;
    None: the default group), ``reduce_op`` "sum" or "avg"."""
    pg, backend = _group(group)
    found = backend.fused_matmul_reduce_scatter(a, b, scatter_dim, reduce_op) if _direct(a, b) else None
    if found is None:
        found = torch.ops.tdist.matmul_reduce_scatter(a, b, pg.group_name, scatter_dim, reduce_op)
    return found


def state(group=None) -> OverlapState:
    """The overlap state of ``group`` (a tdist group; None: the default group): ``fused_calls``
    (calls the overlapped ways served, by op), ``tuning.tuned`` / ``tuning.tuning_us`` (the way
    "tune" chose per shape class, and the times it chose from), ``replays.graph_calls`` and
    ``replays.replayed_calls`` (pipelined calls replayed from a CUDA graph, and from C++)."""
    return state_of(_tdist_backend(group).executor)


def _group(group):
    """(the process group, its tdist backend): a clear error for groups of other backends."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg, _tdist_backend(pg)


def _direct(*tensors) -> bool:
    """Whether a call may go straight to the C++ backend's remembered signatures
    (``csrc/fused_calls.cpp``) rather than through the custom op: not while torch.compile traces,
    nor under a torch function mode or for a tensor with ``__torch_function__``. (The backend
    itself refuses calls that need autograd, autocast, a dispatch mode or a tensor subclass.)"""
    return (all(isinstance(t, torch.Tensor) for t in tensors)
            and not (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
                     or torch.overrides.has_torch_function(tensors)))
