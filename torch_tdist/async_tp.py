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
Inductor pass of its own (``_PrepareForMicroPipeline``) so that the micro-pipeline pass
recognises two more forms on tdist groups: a batch-1 sequence-parallel gather, and the
reduce-scatter of a sum of matmuls (a block's input gradient in the backward). Torch runs the pass only
where it was built with NCCL (its GPU builds). Gathers along the last dimension, dtypes other
than bf16, fp16 and fp32, and the fp8 (scaled) forms are not overlapped by tdist: the first two
run torch's sequential form on the tdist group, the last torch's symm_mem kernels.
"""

from __future__ import annotations

import collections
import inspect
import math
import operator
import warnings

import torch
import torch.distributed as dist
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.distributed import _symmetric_memory as symm_mem
from torch.distributed.device_mesh import DeviceMesh

from .backend import is_tdist_group
from .overlap import custom_ops
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
    _install_pre_pass()


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


class _PrepareForMicroPipeline(CustomGraphPass):
    """Post-grad pre-pass: two forms of a tdist group's collectives that the micro-pipeline pass
    does not fuse, rewritten into forms it does (``_restore_gather_dims``,
    ``_join_summed_matmuls``), where it will fuse them (a tdist group with symmetric memory).
    Elsewhere the graph is left alone. (One pass: torch 2.11 takes only one.)"""

    def __call__(self, graph: torch.fx.Graph) -> None:
        if not (torch._inductor.config._micro_pipeline_tp and dist.is_nccl_available()):
            return  # (the pass would not run: the rewrites would only add copies)
        _restore_gather_dims(graph)
        _join_summed_matmuls(graph)

    def uuid(self):
        return get_hash_for_files((__file__, custom_ops.__file__))  # (DTYPES decides what it rewrites)


def _fused_here(group_name) -> bool:
    """Whether the micro-pipeline pass fuses this group's collectives into tdist's ops."""
    return group_name is not None and symm_mem.is_symm_mem_enabled_for_group(group_name) and _is_tdist(group_name)


def _new_node(graph: torch.fx.Graph, like: torch.fx.Node, target, args):
    """A node computing ``target(*args)``, its value's metadata computed from its arguments'."""
    node = graph.call_function(target, args)
    node.meta["val"] = target(*torch.fx.node.map_arg(args, lambda n: n.meta["val"]))
    node.meta["stack_trace"] = like.meta.get("stack_trace")
    return node


def _restore_gather_dims(graph: torch.fx.Graph) -> None:
    """A gather along dim d > 0 whose leading dimensions are all 1 (a sequence-parallel batch of
    1) reaches Inductor as a reshape of the dim-0 gather (funcol returns a view where no copy is
    needed), a form the micro-pipeline pass does not take for an all-gather. Where the gather's
    only use is that reshape, which feeds an N-D matmul the pass takes, this spells the reshape
    the way funcol spells every other gather along d, cat(split(gathered)); the fused op then
    gathers straight into place and the cat never runs."""
    c10d = torch.ops._c10d_functional
    for wait in list(graph.nodes):
        gather = wait.args[0] if wait.target is c10d.wait_tensor.default else None
        if not (isinstance(gather, torch.fx.Node) and gather.target is c10d.all_gather_into_tensor.default):
            continue
        group_name = gather.kwargs.get("group_name", gather.args[2] if len(gather.args) > 2 else None)
        if not _fused_here(group_name) or len(wait.users) != 1:
            continue
        shard, world = gather.args[0].meta["val"], gather.args[1]
        reshape = next(iter(wait.users))
        dim = _reshaped_gather_dim(reshape, shard.shape, world)
        if dim is None or not _feeds_matmul(reshape):
            continue
        with graph.inserting_before(reshape):
            # the pass's pattern is split(gathered, size) with the dimension (0) left unsaid, as
            # funcol's chunk writes it; the size is the shard's first, which is 1 here
            split = _new_node(graph, reshape, torch.ops.aten.split.Tensor, (wait, shard.shape[0]))
            parts = [graph.call_function(operator.getitem, (split, i)) for i in range(world)]
            for i, part in enumerate(parts):
                part.meta["val"] = split.meta["val"][i]
                part.meta["stack_trace"] = reshape.meta.get("stack_trace")
            cat = _new_node(graph, reshape, torch.ops.aten.cat.default, (parts, dim))
        reshape.replace_all_uses_with(cat)
        graph.erase_node(reshape)


def _join_summed_matmuls(graph: torch.fx.Graph) -> None:
    """A reduce-scatter of a sum of matmuls: a tensor-parallel block's input gradient in the
    backward, dq @ Wq + dk @ Wk + dv @ Wv, or the MLP's dh1 @ W1 + dh3 @ W3 (their weights
    column-sharded). The micro-pipeline pass fuses a reduce-scatter with the one matmul that
    makes its input only, so this makes the sum one matmul over the operands joined along K,
    cat(dq, dk, dv) @ cat(Wq, Wk, Wv). The joins are copies (of a sharded weight, and of the
    gradients where Inductor does not write them into place); the reduce-scatter they let
    overlap takes longer."""
    c10d = torch.ops._c10d_functional
    for scatter in list(graph.nodes):
        if scatter.target is not c10d.reduce_scatter_tensor.default:
            continue
        group_name = scatter.kwargs.get("group_name", scatter.args[3] if len(scatter.args) > 3 else None)
        summed = _scattered(scatter.args[0])
        value = summed.meta.get("val")
        # (tdist overlaps no scatter along the last dimension, nor other dtypes: the joins would
        # only add copies; nor a sum used elsewhere, which the pass leaves unfused)
        if not _fused_here(group_name) or value is None or value.dtype not in DTYPES or len(summed.users) != 1 \
                or (summed is not scatter.args[0] and _split_dim(summed) % value.dim() == value.dim() - 1):
            continue
        terms, reshaped = _matmul_terms(summed)
        if not terms:
            continue
        aten = torch.ops.aten
        with graph.inserting_before(summed):
            if reshaped:  # the pass's form: reshape(mm(reshape(A), B)), A of the product's leading dimensions
                lead = list(summed.meta["val"].shape[:-1])
                a = _new_node(graph, summed, aten.cat.default, ([_leading(graph, a, lead) for a, _ in terms], len(lead)))
                a = _new_node(graph, summed, aten.reshape.default, (a, [math.prod(lead), a.meta["val"].shape[-1]]))
            else:
                a = _new_node(graph, summed, aten.cat.default, ([a for a, _ in terms], 1))
            b = _joined_rows(graph, summed, [b for _, b in terms])
            product = _new_node(graph, summed, aten.mm.default, (a, b))
            if reshaped:
                product = _new_node(graph, summed, aten.reshape.default, (product, list(summed.meta["val"].shape)))
        summed.replace_all_uses_with(product)
        _erase_unused(graph, summed)


def _scattered(node: torch.fx.Node) -> torch.fx.Node:
    """What a reduce-scatter's input scatters: x where it is cat(split(x, n, d)) as funcol
    writes a scatter along d > 0 (the form the pass takes: the cat's dimension left unsaid),
    else itself."""
    if node.target is torch.ops.aten.cat.default and len(node.args) == 1 and not node.kwargs and node.args[0] \
            and all(part.target is operator.getitem for part in node.args[0]):
        splits = {part.args[0] for part in node.args[0]}
        if len(splits) == 1:
            split = next(iter(splits))
            if split.target in (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default):
                return split.args[0]
    return node


def _split_dim(node: torch.fx.Node) -> int:
    """The dimension along which ``node``'s one user, a split, splits it."""
    split = next(iter(node.users))
    return split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)


def _is_sum(node: torch.fx.Node) -> bool:
    return (node.target is torch.ops.aten.add.Tensor and len(node.args) == 2 and not node.kwargs
            and all(isinstance(x, torch.fx.Node) for x in node.args))


def _matmul_terms(node: torch.fx.Node) -> tuple[list[tuple[torch.fx.Node, torch.fx.Node]], bool]:
    """([(A, B)], whether each product is reshaped) where ``node`` is a sum of two or more
    products A @ B, each an mm or the reshape of one (all alike, of one shape and dtype), the
    sums and products used only there; else ([], False)."""
    if not _is_sum(node):
        return [], False
    leaves, pending = [], [node]
    while pending:
        x = pending.pop()
        if _is_sum(x) and (x is node or len(x.users) == 1):
            pending.extend(reversed(x.args))
        else:
            leaves.append(x)
    terms, forms = [], set()
    aten = torch.ops.aten
    for leaf in leaves:
        mm = leaf.args[0] if leaf.target is aten.reshape.default else leaf
        if mm.target is not aten.mm.default or len(leaf.users) != 1 or len(mm.users) != 1:
            return [], False
        shape, (m, n) = tuple(leaf.meta["val"].shape), mm.meta["val"].shape
        if shape[-1] != n or math.prod(shape[:-1]) != m:  # (a reshape of the product's rows only)
            return [], False
        forms.add((leaf.target, shape, leaf.meta["val"].dtype))
        terms.append(tuple(mm.args))
    if len(forms) != 1:
        return [], False
    return terms, next(iter(forms))[0] is aten.reshape.default


def _leading(graph: torch.fx.Graph, a: torch.fx.Node, lead: list) -> torch.fx.Node:
    """The matrix ``a`` [M, K] with its M rows as the leading dimensions ``lead``: what ``a``
    reshapes where it is such a reshape, else a reshape of it."""
    if a.target is torch.ops.aten.reshape.default and list(a.args[0].meta["val"].shape[:-1]) == lead:
        return a.args[0]
    return _new_node(graph, a, torch.ops.aten.reshape.default, (a, [*lead, a.meta["val"].shape[-1]]))


def _joined_rows(graph: torch.fx.Graph, like: torch.fx.Node, bs: list[torch.fx.Node]) -> torch.fx.Node:
    """cat(bs) along the rows (K). Transposes of row-major matrices (how a weight multiplies
    in some graphs) are joined as those, into a transposed result: a plain copy, where a
    row-major result would transpose as it copies."""
    aten = torch.ops.aten
    if all(b.meta["val"].stride(0) == 1 and b.meta["val"].stride(1) == b.meta["val"].shape[0] for b in bs):
        rows = [_new_node(graph, like, aten.permute.default, (b, [1, 0])) for b in bs]
        return _new_node(graph, like, aten.permute.default,
                         (_new_node(graph, like, aten.cat.default, (rows, 1)), [1, 0]))
    return _new_node(graph, like, aten.cat.default, (bs, 0))


def _erase_unused(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erases ``node`` and what it used, as far as nothing else uses them (a sum's terms)."""
    pending, erased = [node], set()
    while pending:
        x = pending.pop()
        if x not in erased and x.op == "call_function" and not x.users and not x.is_impure():
            erased.add(x)
            pending.extend(x.all_input_nodes)
            graph.erase_node(x)


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


def _install_pre_pass():
    """Adds _PrepareForMicroPipeline to Inductor's post-grad pre-passes: the only one, or after those
    already there where this torch takes a list (torch 2.13 does, 2.11 does not: a pass already
    there is kept, and batch-1 gathers and summed scatters stay unfused, with a warning)."""
    config = torch._inductor.config
    present = config.post_grad_custom_pre_pass
    passes = list(present) if isinstance(present, (list, tuple)) else [] if present is None else [present]
    if any(isinstance(p, _PrepareForMicroPipeline) for p in passes):
        return
    if not passes:
        config.post_grad_custom_pre_pass = _PrepareForMicroPipeline()
    elif hasattr(custom_graph_pass, "get_custom_graph_passes"):  # (what runs a list of them)
        config.post_grad_custom_pre_pass = [*passes, _PrepareForMicroPipeline()]
    else:
        warnings.warn("torch_tdist.async_tp.enable: torch._inductor.config.post_grad_custom_pre_pass already "
                      "holds a pass and this torch takes only one; tdist's pass, which lets a batch-1 "
                      "sequence-parallel gather and a reduce-scatter of summed matmuls fuse, is not "
                      "installed", stacklevel=3)
