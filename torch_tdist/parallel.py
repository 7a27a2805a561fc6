"""Tensor-parallel styles for DTensor whose sequence-parallel linears run tdist's overlapped ops.

Drop-in replacements for ``torch.distributed.tensor.parallel``'s styles, with the same
constructor arguments: a ``parallelize_module`` plan written for torch's styles works by
importing these instead::

    from torch_tdist.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

On a tdist mesh (1-D), for an ``nn.Linear``:

- ``ColwiseParallel(input_layouts=Shard(d))`` with ``d`` not the last dimension (a sequence-
  sharded input) runs ``torch_tdist.ops.all_gather_matmul`` instead of an all-gather and then the
  matmul. Linears called with the same input one after another (q, k and v projections) gather
  it once: the first keeps the gathered input and the others multiply it.
- ``RowwiseParallel(output_layouts=Shard(d))`` with ``d`` not the last dimension runs
  ``torch_tdist.ops.matmul_reduce_scatter`` instead of the matmul and then a reduce-scatter.

Forward and backward both go through the tdist ops (each one's backward is the other).
Everything else (embeddings, other layouts, meshes of other backends) is torch's style
unchanged. ``PrepareModuleInput``, ``PrepareModuleOutput`` and ``PrepareModuleInputOutput`` are
torch's, exported here so that one import serves a whole plan.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module
from torch.distributed.tensor.parallel import style as torch_style
from torch.distributed.tensor.parallel.style import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)

from . import ops
from .backend import is_tdist_group

__all__ = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "PrepareModuleInputOutput"]


def _sequence_dim(placement) -> int | None:
    """The dimension a Shard placement splits, if it is not the last one (which a linear
    contracts or makes); None otherwise. Negative dimensions count from the end."""
    if not isinstance(placement, Shard) or placement.dim == -1:
        return None
    return placement.dim


def _fusable(module: nn.Module, mesh: DeviceMesh, placement) -> int | None:
    """The sequence dimension to fuse along, or None where torch's style applies unchanged."""
    if not isinstance(module, nn.Linear) or mesh.ndim != 1:
        return None
    dim = _sequence_dim(placement)
    if dim is None or not is_tdist_group(mesh.get_group()):
        return None
    return dim


def _local(x) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


class ColwiseParallel(torch_style.ColwiseParallel):
    __doc__ = torch_style.ColwiseParallel.__doc__

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim = _fusable(module, device_mesh, self.input_layouts[0])
        if dim is None:
            return super()._apply(module, device_mesh)
        # the input reaches the forward as given (sharded along dim), which gathers it
        distribute_module(module, device_mesh, self._partition_linear_fn, lambda mod, inputs, mesh: inputs,
                          partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
        module.forward = partial(_gathered_linear, module, device_mesh, dim)
        return module


class RowwiseParallel(torch_style.RowwiseParallel):
    __doc__ = torch_style.RowwiseParallel.__doc__

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim = _fusable(module, device_mesh, self.output_layouts[0])
        module = super()._apply(module, device_mesh)
        if dim is not None:
            module.forward = partial(_scattered_linear, module, device_mesh, dim)
        return module


class SequenceParallel(torch_style.SequenceParallel):
    """torch's SequenceParallel (norms and dropout on sequence shards have no matmul to fuse)."""


# ---- the fused forwards ------------------------------------------------------------------
# Gathered inputs, for linears that share one: id(input) -> (weak reference to the input, the
# gathered input, ids of the linears that used it). A linear meeting an input it already used is
# in a new forward pass, and gathers anew. (Keyed by id: tensors compare elementwise.)
_GATHERED: dict[int, tuple[weakref.ref, torch.Tensor, set]] = {}


def _gathered_linear(module: nn.Linear, mesh: DeviceMesh, dim: int, x) -> DTensor:
    """``module(all_gather(x, dim))`` as a DTensor sharded on its last dimension; ``x`` this
    rank's shard, or a DTensor (redistributed to ``Shard(dim)`` if it is not)."""
    if isinstance(x, DTensor) and tuple(x.placements) != (Shard(dim),):
        x = x.redistribute(placements=(Shard(dim),))
    weight = module.weight.to_local()  # [out / world, in]
    remember = not torch.compiler.is_compiling()
    ref, gathered, users = _GATHERED.get(id(x), (None, None, None)) if remember else (None, None, None)
    if ref is not None and ref() is x and id(module) not in users:
        users.add(id(module))
        out = torch.matmul(gathered, weight.t())
    else:
        gathered, out = ops.all_gather_matmul(_local(x), weight.t(), group=mesh.get_group(), gather_dim=dim,
                                              return_a=True)
        if remember:
            key = id(x)
            _GATHERED[key] = (weakref.ref(x, lambda _: _GATHERED.pop(key, None)), gathered, {id(module)})
    if module.bias is not None:
        out = out + module.bias.to_local()
    return DTensor.from_local(out, mesh, (Shard(-1),), run_check=False)


def _scattered_linear(module: nn.Linear, mesh: DeviceMesh, dim: int, x) -> DTensor:
    """``reduce_scatter(module(x), dim)`` (x sharded on its last dimension) as a DTensor
    sharded on ``dim``."""
    weight = module.weight.to_local()  # [out, in / world]
    group = mesh.get_group()
    out = ops.matmul_reduce_scatter(_local(x), weight.t(), group=group, scatter_dim=dim)
    if module.bias is not None:
        out = out + _GradSummedOverGroup.apply(module.bias.to_local(), group)
    return DTensor.from_local(out, mesh, (Shard(dim),), run_check=False)


class _GradSummedOverGroup(torch.autograd.Function):
    """The identity, whose gradient is summed over ``group``: a replicated bias added to each
    rank's shard of the output gets every shard's gradient (as torch's style gives it)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None

