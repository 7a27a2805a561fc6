"""torch.compile async tensor parallelism on tdist groups.

Inductor's micro-pipeline TP pass (``torch._inductor.config._micro_pipeline_tp``) rewrites a
group's all-gather followed by matmuls into ``torch.ops.symm_mem.fused_all_gather_matmul`` and a
matmul followed by a reduce-scatter into ``torch.ops.symm_mem.fused_matmul_reduce_scatter``, for
groups with symmetric memory enabled. ``enable(group_or_mesh)`` turns the pass on for a tdist
group, and makes those two ops run tdist's (``torch.ops.tdist.all_gather_matmul`` /
``matmul_reduce_scatter``) when their group is a tdist group::

    import torch_tdist.async_tp
    torch_tdist.async_tp.enable(tp_mesh)
    model = torch.compile(model)

Groups of other backends keep torch's kernels; importing this module changes nothing until
``enable`` is called. ``served`` counts the fused regions tdist ran. ``enable`` also adds one
Inductor pass of its own (``_RestoreGatherDims``) so that a batch-1 sequence-parallel gather of a
tdist group is recognised by the micro-pipeline pass. Torch runs the pass only
where it was built with NCCL (its GPU builds). Gathers along the last dimension, dtypes other
than bf16, fp16 and fp32, and the fp8 (scaled) forms are not overlapped by tdist: the first two
run torch's sequential form on the tdist group, the last torch's symm_mem kernels.
"""

from __future__ import annotations

import collections
import inspect
import operator
import warnings

import torch
import torch.distributed as dist
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.distributed import _symmetric_memory as symm_mem
from torch.distributed.device_mesh import DeviceMesh

from .backend import is_tdist_group
from .overlap.custom_ops import DTYPES, with_strides
from .overlap.custom_ops import group_by_name as _resolve_group

__all__ = ["enable", "served"]

served = collections.Counter()  # symm_mem op name -> fused regions tdist's ops ran

_OVERRIDDEN_KEYS = ("CUDA", "CPU")
_overrides = None  # the torch.library.Library holding the kernels, once enable() made them


def enable(group_or_mesh=None) -> None:
    """Async TP under torch.compile for a tdist group: a ProcessGroup, a 1-D DeviceMesh (the
    TP mesh, ``mesh["tp"]`` of a larger one) or None (the default group). Turns Inductor's
    micro-pipeline TP pass on, enables symmetric memory for the group (what the pass asks
    before it fuses) and serves its fused regions with tdist's overlapped ops."""
    group = _group(group_or_mesh)
    if not is_tdist_group(group):
        raise ValueError(f"torch_tdist.async_tp.enable: group {group.group_name!r} is served by "
                         f"{dist.get_backend(group)!r}; expected a tdist group (init_process_group('tdist') "
                         f"or a mesh/new_group of backend 'tdist')")
    _override_fused_ops()
    enable_symm_mem(group.group_name)
    torch._inductor.config._micro_pipeline_tp = True
    _install_gather_pass()


def enable_symm_mem(group_name: str) -> None:
    """What Inductor's micro-pipeline pass asks of a group before it fuses (for any backend)."""
    with warnings.catch_warnings():  # torch calls this deprecated, yet its pass still asks for it
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group_name)


def _group(group_or_mesh):
    if isinstance(group_or_mesh, DeviceMesh):
        if group_or_mesh.ndim != 1:
            raise ValueError(f"torch_tdist.async_tp.enable: the mesh has {group_or_mesh.ndim} dimensions "
                             f"{group_or_mesh.mesh_dim_names}; pass the TP one, e.g. mesh['tp']")
        return group_or_mesh.get_group()
    if group_or_mesh is None:
        return dist.distributed_c10d._get_default_group()
    if isinstance(group_or_mesh, dist.ProcessGroup):
        return group_or_mesh
    raise TypeError(f"torch_tdist.async_tp.enable: got {type(group_or_mesh).__name__}; expected a "
                    f"ProcessGroup, a 1-D DeviceMesh or None")


def _is_tdist(group_name: str) -> bool:
    # (asked at every call: torch gives a destroyed group's name to the next group it makes)
    return is_tdist_group(_resolve_group(group_name))


def _override_fused_ops():
    """Registers kernels for the two symm_mem ops (once): tdist groups to tdist's ops, every
    other group to torch's kernel (on the CPU torch has none)."""
    global _overrides
    if _overrides is not None:
        return
    library = torch.library.Library("symm_mem", "IMPL")
    # (torch 2.11 refuses to replace a kernel registered from Python unless told to; 2.13 allows it)
    override = {"allow_override": True} if "allow_override" in inspect.signature(library.impl).parameters else {}
    with warnings.catch_warnings():  # torch warns that a kernel replaces another: that is the point
        warnings.simplefilter("ignore", UserWarning)
        for key in _OVERRIDDEN_KEYS:
            library.impl("fused_all_gather_matmul", _kernel(key, _all_gather_matmul, "_fused_all_gather_matmul"),
                         key, **override)
            library.impl("fused_matmul_reduce_scatter",
                         _kernel(key, _matmul_reduce_scatter, "_fused_matmul_reduce_scatter"), key, **override)
    _overrides = library


def _kernel(key: str, tdist_form, torch_kernel_name: str):
    op = torch_kernel_name.lstrip("_")
    torch_kernel = getattr(symm_mem, torch_kernel_name) if key == "CUDA" else None

    def kernel(*args, **kwargs):
        group_name = args[3] if op == "fused_all_gather_matmul" else args[4]
        if _is_tdist(group_name):
            served[op] += 1
            return tdist_form(*args, **kwargs)
        if torch_kernel is None:
            raise NotImplementedError(f"symm_mem::{op} has no {key} kernel for group {group_name!r}: "
                                      f"torch_tdist serves it there only for tdist groups")
        return torch_kernel(*args, **kwargs)
    return kernel


def _all_gather_matmul(a_shard, bs, gather_dim, group_name, *, return_A=True):
    if gather_dim % a_shard.dim() == a_shard.dim() - 1 or a_shard.dtype not in DTYPES:
        return symm_mem._fused_all_gather_matmul_fallback(a_shard, bs, gather_dim, group_name,
                                                          return_A=return_A)
    a_full, outs = torch.ops.tdist.all_gather_matmul(a_shard, list(bs), group_name, gather_dim, return_A)
    want_a, want_outs = _torch_layout("fused_all_gather_matmul", a_shard, bs, gather_dim, group_name)
    outs = [with_strides(o, w) for o, w in zip(outs, want_outs)]
    return (with_strides(a_full, want_a) if return_A else None), outs


def _matmul_reduce_scatter(a, b, reduce_op, scatter_dim, group_name):
    if scatter_dim % a.dim() == a.dim() - 1 or a.dtype not in DTYPES:
        return symm_mem._fused_matmul_reduce_scatter_fallback(a, b, reduce_op, scatter_dim, group_name)
    out = torch.ops.tdist.matmul_reduce_scatter(a, b, group_name, scatter_dim, reduce_op)
    return with_strides(out, _torch_layout("fused_matmul_reduce_scatter", a, b, reduce_op, scatter_dim, group_name))


_layouts: dict[tuple, object] = {}  # a call's shapes and arguments -> its outputs' strides in torch's kernel


def _torch_layout(op: str, *args):
    """The strides of ``op``'s outputs as torch's fake kernel gives them (what Inductor planned
    for, and what torch's kernel returns), from that kernel run on meta tensors."""
    def described(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.stride(), x.dtype)
        return tuple(map(described, x)) if isinstance(x, (list, tuple)) else x

    key = (op, described(args), _resolve_group(args[-1]).size())  # (the last: the group's name)
    strides = _layouts.get(key)
    if strides is None:
        def meta(x):
            if isinstance(x, torch.Tensor):
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            return [meta(y) for y in x] if isinstance(x, (list, tuple)) else x
        result = getattr(torch.ops.symm_mem, op)(*map(meta, args))
        if op == "fused_all_gather_matmul":
            strides = (result[0].stride(), [t.stride() for t in result[1]])
        else:
            strides = result.stride()
        _layouts[key] = strides
    return strides


class _RestoreGatherDims(CustomGraphPass):
    """Post-grad pre-pass: a gather along dim d > 0 whose leading dimensions are all 1 (a
    sequence-parallel batch of 1) reaches Inductor as a reshape of the dim-0 gather (funcol
    returns a view where no copy is needed), a form the micro-pipeline pass does not take for an
    all-gather. Where the pass will fuse it (a tdist group with symmetric memory, the gather's
    only use that reshape, which feeds an N-D matmul the pass takes), this spells the reshape the
    way funcol spells every other gather along d, cat(split(gathered)); the fused op then
    gathers straight into place and the cat never runs. Elsewhere the graph is left alone."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        if not (torch._inductor.config._micro_pipeline_tp and dist.is_nccl_available()):
            return  # (the pass would not run: a cat would stay where a view was)
        c10d = torch.ops._c10d_functional
        for wait in list(graph.nodes):
            gather = wait.args[0] if wait.target is c10d.wait_tensor.default else None
            if not (isinstance(gather, torch.fx.Node) and gather.target is c10d.all_gather_into_tensor.default):
                continue
            group_name = gather.kwargs.get("group_name", gather.args[2] if len(gather.args) > 2 else None)
            if group_name is None or not symm_mem.is_symm_mem_enabled_for_group(group_name) \
                    or not _is_tdist(group_name) or len(wait.users) != 1:
                continue
            shard, world = gather.args[0].meta["val"], gather.args[1]
            reshape = next(iter(wait.users))
            dim = _reshaped_gather_dim(reshape, shard.shape, world)
            if dim is None or not _feeds_matmul(reshape):
                continue
            with graph.inserting_before(reshape):
                # the pass's pattern is split(gathered, size) with the dimension (0) left unsaid, as
                # funcol's chunk writes it; the size is the shard's first, which is 1 here
                split = graph.call_function(torch.ops.aten.split.Tensor, (wait, shard.shape[0]))
                split.meta["val"] = torch.ops.aten.split.Tensor(wait.meta["val"], shard.shape[0])
                parts = [graph.call_function(operator.getitem, (split, i)) for i in range(world)]
                for i, part in enumerate(parts):
                    part.meta["val"] = split.meta["val"][i]
                cat = graph.call_function(torch.ops.aten.cat.default, (parts, dim))
                cat.meta["val"] = torch.ops.aten.cat.default([p.meta["val"] for p in parts], dim)
                for node in (split, *parts, cat):
                    node.meta["stack_trace"] = reshape.meta.get("stack_trace")
            reshape.replace_all_uses_with(cat)
            graph.erase_node(reshape)

    def uuid(self):
        return get_hash_for_files((__file__,))


def _reshaped_gather_dim(node, shard_shape, world: int) -> int | None:
    """d when ``node`` reshapes a dim-0 gather of ``shard_shape`` into its gather along d > 0
    (not the last: the pass leaves those unfused), the leading dimensions being 1; else None."""
    if node.target is not torch.ops.aten.reshape.default:
        return None
    shape = tuple(node.meta["val"].shape)
    for dim in range(1, len(shard_shape) - 1):
        if any(size != 1 for size in shard_shape[:dim]):
            break
        if shape == (*shard_shape[:dim], shard_shape[dim] * world, *shard_shape[dim + 1:]):
            return dim
    return None


def _feeds_matmul(node) -> bool:
    """Whether ``node`` is the left operand of an N-D matmul as the pass takes it: reshaped to
    2-D, multiplied, the product reshaped back to ``node``'s leading dimensions."""
    reshape, mm = torch.ops.aten.reshape.default, torch.ops.aten.mm.default
    lead = tuple(node.meta["val"].shape[:-1])
    return any(product.target is mm and product.args[0] is flat
               and any(out.target is reshape and tuple(out.meta["val"].shape) == (*lead, product.meta["val"].shape[-1])
                       for out in product.users)
               for flat in node.users if flat.target is reshape for product in flat.users)


def _install_gather_pass():
    """Adds _RestoreGatherDims to Inductor's post-grad pre-passes: the only one, or after those
    already there where this torch takes a list (torch 2.13 does, 2.11 does not: a pass already
    there is kept and batch-1 gathers stay unfused, with a warning)."""
    config = torch._inductor.config
    present = config.post_grad_custom_pre_pass
    passes = list(present) if isinstance(present, (list, tuple)) else [] if present is None else [present]
    if any(isinstance(p, _RestoreGatherDims) for p in passes):
        return
    if not passes:
        config.post_grad_custom_pre_pass = _RestoreGatherDims()
    elif hasattr(custom_graph_pass, "get_custom_graph_passes"):  # (what runs a list of them)
        config.post_grad_custom_pre_pass = [*passes, _RestoreGatherDims()]
    else:
        warnings.warn("torch_tdist.async_tp.enable: torch._inductor.config.post_grad_custom_pre_pass already "
                      "holds a pass and this torch takes only one; tdist's pass, which lets a batch-1 "
                      "sequence-parallel gather fuse, is not installed", stacklevel=3)
