"""The Python side of the custom ops ``torch.ops.tdist.all_gather_matmul`` and
``torch.ops.tdist.matmul_reduce_scatter`` (the group passed by name). Their schemas and dispatcher
kernels are C++ (``csrc/fused_ops.cpp``): a call issued from C++ needs no Python. Here: what C++
hands over to Python (the first call of a signature: the checks, the sequential path and the hand-over
to an overlapped way, ``fused.py`` or ``pipelined.py``, as ``tuning.run`` chooses), the fake kernels,
and autograd (an ``autograd.Function`` per op)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..backend import _tdist_backend
from ..compat import all_gather_single, funcol_reduce_scatter, reduce_scatter_single
from . import fused, pipelined, tuning
from .replay import interleaved
from .state import state_of

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}
WAY_KINDS = {"fused": fused, "pipelined": pipelined}  # tuning.WAYS' kinds -> their module


def group_by_name(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


# ---- checks (shared by the real and the fake kernels) ------------------------------------
def _check_operands(op: str, a: Tensor, bs: list[Tensor]) -> int:
    """Dtypes, devices and the contracted size K; returns K."""
    if a.dtype not in DTYPES:
        raise TypeError(f"tdist {op}: A is {a.dtype}; expected bfloat16, float16 or float32")
    if a.dim() < 2:
        raise ValueError(f"tdist {op}: A has shape {tuple(a.shape)}; expected 2 or more dimensions")
    if not bs:
        raise ValueError(f"tdist {op}: no B matrix given")
    k = a.shape[-1]
    for i, b in enumerate(bs):
        if b.dtype != a.dtype or b.device != a.device:
            raise TypeError(f"tdist {op}: B[{i}] is {b.dtype} on {b.device}, A is {a.dtype} on {a.device}; "
                            f"they must match")
        if b.dim() != 2 or b.shape[0] != k:
            raise ValueError(f"tdist {op}: B[{i}] has shape {tuple(b.shape)}; expected [{k}, N] "
                             f"(A's last dimension is {k})")
    return k


def _dim(op: str, name: str, dim: int, ndim: int) -> int:
    """``dim`` of a result with ``ndim`` dimensions, not the last (the matmul's columns)."""
    if not -ndim <= dim < ndim or dim % ndim == ndim - 1:
        raise ValueError(f"tdist {op}: {name}={dim}; expected one of A's {ndim} dimensions but the "
                         f"last (the one the matmul contracts or makes)")
    return dim % ndim


# ---- the sequential path ------------------------------------------------------------------


def _row_major(t: Tensor) -> Tensor:
    """``t`` laid out as a new tensor of its shape (the fake kernels' layout)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    return with_strides(t, strides[::-1])


def with_strides(t: Tensor, strides) -> Tensor:
    """``t`` with exactly ``strides``: a view where only dimensions of size 1 differ (they address
    nothing, yet torch.compile's guards tell them apart: a compiled region fed such a tensor
    recompiles with dynamic strides), a copy otherwise."""
    strides = tuple(strides)
    if t.stride() == strides:
        return t
    if all(have == want for size, have, want in zip(t.shape, t.stride(), strides) if size > 1):
        return t.as_strided(t.shape, strides)
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _all_gather(x: Tensor, dim: int, group) -> Tensor:
    rows = x.movedim(dim, 0).contiguous()
    out = rows.new_empty((group.size() * rows.shape[0], *rows.shape[1:]))
    all_gather_single(out, rows, group=group)
    return _row_major(out.movedim(0, dim))


def _reduce_scatter(x: Tensor, dim: int, reduce_op: str, group) -> Tensor:
    rows = x.movedim(dim, 0).contiguous()
    out = rows.new_empty((rows.shape[0] // group.size(), *rows.shape[1:]))
    reduce_scatter_single(out, rows, op=REDUCE_OPS[reduce_op], group=group)
    return _row_major(out.movedim(0, dim))


# ---- the overlapped ways' rows --------------------------------------------------------------
def _as_rows(t: Tensor, dim: int) -> Tensor:
    """``t`` as the overlapped ways take it: [rows, last dimension] contiguous, ``dim`` first
    (free for a row-major matrix and dim 0; a copy unless the dimensions before ``dim`` have size
    1 otherwise)."""
    if dim == 0 and t.dim() == 2 and t.is_contiguous():
        return t  # (a few microseconds of host time a call saved: the common case)
    return t.movedim(dim, 0).reshape(-1, t.shape[-1]).contiguous()


def _from_rows(rows: Tensor, shape: list[int], dim: int) -> Tensor:
    """The inverse of ``_as_rows``: ``rows`` as a row-major tensor of ``shape`` (itself where it
    is one already: ``_row_major``)."""
    if dim != 0 or len(shape) != 2:
        rows = rows.reshape([shape[dim], *shape[:dim], *shape[dim + 1:]]).movedim(0, dim)
    return _row_major(rows)


# An all_gather_matmul of several B matrices (q, k and v; an MLP's gate and up projections) runs
# the pipelined way as one matmul per B and chunk, each into an output of its own, where every B
# is at least PER_B_MIN_COLUMNS wide. Otherwise the Bs go side by side as one matrix (a copy),
# and its product is copied apart into the outputs the op returns, as the fused way always does:
# narrow matmuls lose more in chunks than the copies cost. Matmuls alone on one H200, bf16, 8192
# rows in 8 chunks (the pipelined way's on 4 ranks), K 8192, the Bs of a 70B-shaped layer at TP=4:
# gate and up 7168 + 7168 columns: one by one 3095 us, side by side 2833 us + 118 (the Bs
# joined) + 267 (the outputs copied apart); q, k, v 2048 + 256 + 256: one by one 628 us, side by
# side 500 + 24 + 57.
PER_B_MIN_COLUMNS = 1024


def _side_by_side(bs: list[Tensor]) -> Tensor:
    """The B matrices as one, their columns side by side. Bs that are transposes of row-major
    matrices (nn.Linear weights as the compiled graph passes them) are joined as those, into a
    transposed result: a plain copy, where a row-major result transposes as it copies (7.8x the
    time for two 7168 x 8192 bf16 weights on an H200). C++ joins them alike (csrc/fused_calls.cpp)."""
    if len(bs) == 1:
        return bs[0]
    if all(b.stride(0) == 1 and b.stride(1) == b.shape[0] for b in bs):
        return torch.cat([b.t() for b in bs], dim=0).t()
    return torch.cat(bs, dim=1)


def _watched(backend, op: str, run, state, *args) -> bool:
    """``run(state, *args)``, an overlapped way (it returns whether it ran), checked and
    watched as the group's collectives are (``backend``: the group's): it raises once the group
    was aborted, and where its GPU work has not finished within the group's timeout (a peer
    died) the group's watchdog aborts the group, so that its waits give up and later calls
    raise. The group's calls after it run after it (``_ordered``: before it)."""
    backend.check_open(op)
    device = args[0].device  # (the group's: the executor refuses tensors on another)
    try:
        return run(state, *args)
    finally:  # (also what a way that raised part-way had queued)
        if device.type == "cuda":
            backend.watch_queued(op, device.index)


def _ordered(backend, t: Tensor):
    """On GPUs, the caller's stream waits for the group's last call where that ran on another
    stream (an async collective not yet waited for), so that an op, whichever way it runs (its
    copies and matmuls included), runs after the group's calls before it: one stream order per
    group, as NCCL's."""
    if t.device.type == "cuda":
        backend.order_queued(t.device.index)


# ---- tdist::all_gather_matmul --------------------------------------------------------------
def all_gather_matmul_impl(a_shard: Tensor, bs: list[Tensor], group_name: str, gather_dim: int,
                           return_a: bool) -> tuple[Tensor, list[Tensor]]:
    """(A gathered, [A gathered @ b for b in bs]): the op's kernel below autograd where C++ did
    not issue the call (``csrc/fused_ops.cpp``). The gathered A always comes back (the backward
    needs it); gradients flow into it only with ``return_a``."""
    group = group_by_name(group_name)
    backend = _tdist_backend(group)
    dim = _checked_gather(a_shard, bs, gather_dim)
    _ordered(backend, a_shard)
    state = state_of(backend.executor)
    served = []  # the way each call of the op made here ran: the last one made the result

    def sequential():
        a_full = _all_gather(a_shard, dim, group)
        served.append("sequential")
        return a_full, [torch.matmul(a_full, b) for b in bs]

    def overlapped(way):
        result = _overlapped_all_gather_matmul(a_shard, bs, backend, state, group.size(), way, dim)
        served.append(way if result is not None else None)
        return result
    state.replays.last = None
    # (only sizes every rank shares: whether a shape is tuned yet must agree across ranks; the
    # count of Bs, since several wide Bs run one by one and one B of their total width does not)
    key = ("all_gather_matmul", a_shard.dtype, tuning.rows_class(a_shard), a_shard.shape[-1], len(bs))
    result = tuning.run(group, state, key, sequential, overlapped, width=sum(b.shape[-1] for b in bs))
    _remember(group, backend, state, "all_gather_matmul", served, a_shard, bs, dim, int(return_a))
    return result


def _remember(group, backend, state, op: str, served: list, a: Tensor, bs: list[Tensor], dim: int, flag: int):
    """Let C++ issue later calls of this signature the way this one ran (the sequential way, or
    the pipelined way's recorded program), unless it ran inside a CUDA graph capture (where
    tuning waits), another way (fused) served it, or the group's backend for ``a``'s device is
    not ``backend`` itself (another backend for that device, or torch's debug wrapper, whose
    checks C++ would skip)."""
    way, last = (served[-1] if served else None), state.replays.last
    state.replays.last = None  # (its tensors go with this call)
    if way is None or (a.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return
    if not isinstance(group._get_backend(a.device), type(backend)):
        return
    if way == "sequential":
        backend.remember_fused(op, a, bs, dim, flag, None, None, 1, state, state.issued)
    elif way is not None and way[0] == "pipelined" and last is not None:
        program, roles = last
        staging = roles[3] if op == "matmul_reduce_scatter" else None
        # the Bs the program multiplies by: all_gather_matmul's roles are A, those Bs, as many
        # outputs and the gathered A (PER_B_MIN_COLUMNS)
        operands = (len(roles) - 2) // 2 if op == "all_gather_matmul" else 1
        backend.remember_fused(op, a, bs, dim, flag, program, staging, operands, state, state.issued)


def _overlapped_all_gather_matmul(a_shard: Tensor, bs: list[Tensor], backend, state, world: int, way: tuple,
                                  dim: int):
    """The op overlapped (``fused.all_gather_matmul``, or ``pipelined``'s), or None where the
    heap cannot take it. The ways gather rows (``_as_rows``, ``_from_rows``)."""
    k = a_shard.shape[-1]
    a = _as_rows(a_shard, dim)
    kind, setting = way
    widths, rows = [b.shape[1] for b in bs], world * a.shape[0]
    if kind == "pipelined" and min(widths) >= PER_B_MIN_COLUMNS and not interleaved(bs):  # (replay.recorded)
        operands, outs = list(bs), [a.new_empty((rows, w)) for w in widths]
    else:
        operands, outs = [_side_by_side(bs)], [a.new_empty((rows, sum(widths)))]
    a_full = a.new_empty((rows, k))
    if not _watched(backend, "all_gather_matmul", WAY_KINDS[kind].all_gather_matmul, state, a, operands, outs,
                    a_full, setting):
        return None
    shape = list(a_shard.shape)
    shape[dim] *= world
    if len(outs) != len(bs):
        outs = outs[0].split(widths, dim=1)
    return _from_rows(a_full, shape, dim), [_from_rows(o, shape[:-1] + [o.shape[1]], dim) for o in outs]


def _checked_gather(a_shard, bs, gather_dim) -> int:
    _check_operands("all_gather_matmul", a_shard, bs)
    return _dim("all_gather_matmul", "gather_dim", gather_dim, a_shard.dim())


@torch.library.register_fake("tdist::all_gather_matmul")
def _(a_shard, bs, group_name, gather_dim, return_a):
    dim = _checked_gather(a_shard, bs, gather_dim)
    shape = list(a_shard.shape)
    shape[dim] *= group_by_name(group_name).size()
    return a_shard.new_empty(shape), [a_shard.new_empty((*shape[:-1], b.shape[1])) for b in bs]


class _AllGatherMatmul(torch.autograd.Function):
    """The op where autograd records it (its tensors flattened: ``apply`` takes no lists)."""

    @staticmethod
    def forward(ctx, a_shard, group_name, gather_dim, return_a, *bs):
        with torch._C._AutoDispatchBelowAutograd():
            a_full, outs = torch.ops.tdist.all_gather_matmul(a_shard, list(bs), group_name, gather_dim, return_a)
        # (gradients stay materialised: an output one rank leaves unused gets zeros there, so
        # every rank's backward issues the same collectives)
        ctx.group_name, ctx.gather_dim, ctx.return_a = group_name, gather_dim, return_a
        ctx.save_for_backward(a_full, *bs)
        return (a_full, *outs)

    @staticmethod
    def backward(ctx, grad_a_full, *grad_outs):
        a_full, *bs = ctx.saved_tensors
        used = [(g, b) for g, b in zip(grad_outs, bs) if g is not None]
        # (a frozen weight, as in low-rank fine-tuning, gets no gradient: its matmul is skipped)
        wanted = ctx.needs_input_grad[4:]  # (the inputs' order: a_shard, three options, *bs)
        grad_bs = [None if g is None or not want else _weight_grad(a_full, g) for g, want in zip(grad_outs, wanted)]
        dim = ctx.gather_dim % a_full.dim()
        grad_a = None
        if used:  # sum_i grad_i @ b_i^T, scattered back: the other op
            grad_a = torch.ops.tdist.matmul_reduce_scatter(
                torch.cat([g for g, _ in used], dim=-1), _side_by_side([b for _, b in used]).t(),
                ctx.group_name, dim, "sum")
        if ctx.return_a and grad_a_full is not None:
            extra = funcol_reduce_scatter(grad_a_full.contiguous(), "sum", dim, ctx.group_name)
            grad_a = extra if grad_a is None else grad_a + extra
        return (grad_a, None, None, None, *grad_bs)


def all_gather_matmul_autograd(a_shard, bs, group_name, gather_dim, return_a):
    """The op's Autograd kernel where a gradient is to be recorded (``csrc/fused_ops.cpp``)."""
    a_full, *outs = _AllGatherMatmul.apply(a_shard, group_name, gather_dim, return_a, *bs)
    return a_full, outs


# ---- tdist::matmul_reduce_scatter ----------------------------------------------------------
def matmul_reduce_scatter_impl(a: Tensor, b: Tensor, group_name: str, scatter_dim: int,
                               reduce_op: str) -> Tensor:
    """This rank's shard of reduce_scatter(a @ b): the op's kernel below autograd where C++ did
    not issue the call."""
    group = group_by_name(group_name)
    backend = _tdist_backend(group)
    world = group.size()
    dim = _checked_scatter(a, b, world, scatter_dim, reduce_op)
    _ordered(backend, a)
    state = state_of(backend.executor)
    served = []  # the way each call of the op made here ran: the last one made the result

    def sequential():
        served.append("sequential")
        return _reduce_scatter(torch.matmul(a, b), dim, reduce_op, group)

    def overlapped(way):
        result = _overlapped_matmul_reduce_scatter(a, b, backend, state, world, reduce_op, way, dim)
        served.append(way if result is not None else None)
        return result
    state.replays.last = None
    # (only sizes every rank shares: whether a shape is tuned yet must agree across ranks)
    key = ("matmul_reduce_scatter", a.dtype, tuning.rows_class(a), b.shape[1])
    # (K, A's columns: this rank's share of the contracted size, which may differ between ranks)
    result = tuning.run(group, state, key, sequential, overlapped, width=a.shape[-1])
    _remember(group, backend, state, "matmul_reduce_scatter", served, a, [b], dim, list(REDUCE_OPS).index(reduce_op))
    return result


def _overlapped_matmul_reduce_scatter(a: Tensor, b: Tensor, backend, state, world: int, reduce_op: str,
                                      way: tuple, dim: int):
    """The op overlapped (``fused.matmul_reduce_scatter``, or ``pipelined``'s), or None where
    the heap cannot take it. The ways scatter rows (``_as_rows``, ``_from_rows``)."""
    rows = _as_rows(a, dim)
    out = a.new_empty((rows.shape[0] // world, b.shape[1]))
    kind, setting = way
    if not _watched(backend, "matmul_reduce_scatter", WAY_KINDS[kind].matmul_reduce_scatter, state, rows, b, out,
                    reduce_op, setting):
        return None
    shape = [*a.shape[:-1], b.shape[1]]
    shape[dim] //= world
    return _from_rows(out, shape, dim)


def _checked_scatter(a, b, world: int, scatter_dim: int, reduce_op: str) -> int:
    op = "matmul_reduce_scatter"
    _check_operands(op, a, [b])
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"tdist {op}: reduce_op={reduce_op!r}; expected one of {', '.join(REDUCE_OPS)}")
    dim = _dim(op, "scatter_dim", scatter_dim, a.dim())
    if a.shape[dim] % world:
        raise ValueError(f"tdist {op}: A's dimension {dim} has {a.shape[dim]} rows, which the "
                         f"group's {world} ranks do not divide")
    return dim


@torch.library.register_fake("tdist::matmul_reduce_scatter")
def _(a, b, group_name, scatter_dim, reduce_op):
    world = group_by_name(group_name).size()
    dim = _checked_scatter(a, b, world, scatter_dim, reduce_op)
    shape = [*a.shape[:-1], b.shape[1]]
    shape[dim] //= world
    return a.new_empty(shape)


class _MatmulReduceScatter(torch.autograd.Function):
    """The op where autograd records it."""

    @staticmethod
    def forward(ctx, a, b, group_name, scatter_dim, reduce_op):
        with torch._C._AutoDispatchBelowAutograd():
            out = torch.ops.tdist.matmul_reduce_scatter(a, b, group_name, scatter_dim, reduce_op)
        ctx.group_name, ctx.scatter_dim, ctx.reduce_op = group_name, scatter_dim, reduce_op
        ctx.save_for_backward(a, b)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        if ctx.reduce_op == "avg":
            grad_out = grad_out / group_by_name(ctx.group_name).size()
        # the gradient of a @ b is grad_out gathered: grad_a = gathered @ b^T (the other op)
        gathered, (grad_a,) = torch.ops.tdist.all_gather_matmul(
            grad_out.contiguous(), [b.t()], ctx.group_name, ctx.scatter_dim, False)
        grad_b = _weight_grad(a, gathered) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None, None


def matmul_reduce_scatter_autograd(a, b, group_name, scatter_dim, reduce_op):
    """The op's Autograd kernel where a gradient is to be recorded (``csrc/fused_ops.cpp``)."""
    return _MatmulReduceScatter.apply(a, b, group_name, scatter_dim, reduce_op)


def _weight_grad(x: Tensor, grad: Tensor) -> Tensor:
    """d(x @ w)/dw contracted with ``grad``: x^T @ grad over every leading dimension."""
    return x.reshape(-1, x.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1])
