"""Jobs for test_ops.py: torch_tdist.ops (all_gather_matmul, matmul_reduce_scatter) on the
default group, outputs and gradients against float64 references every rank computes alone
(every rank's operands come from shared generators), and their bad input.

Errors are relative: ||got - want|| / ||want||, at most 1e-2 for 16-bit dtypes,
1e-5 for float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import torch_tdist
from tests.common import Checker, dt, rand, shared_gen
from torch_tdist.overlap import pipelined


def _operand(shape, d, seed, salt):
    return rand(shape, d, shared_gen(seed, salt), "sum")


SHAPES = {"small": (3, 8, [5, 4, 6]), "tiles": (37, 40, [50, 18, 33]), "big": (150, 40, [50])}  # m, k, [n per B]


def all_gather_matmul(rank, ws, dtype, seed, gather_dim, n_bs, shape="small", fused=False):
    """A [ws*m, k] (or [2, ws*m, k] gathered along dim 1) row-sharded; every rank has its own Bs
    and weights; loss = sum_i <out_i, w_i> + <A gathered, v>, so A's gradient sums over ranks."""
    chk = Checker(rank, f"all_gather_matmul[{dtype}, dim {gather_dim}, {n_bs} B]")
    d = dt(dtype)
    m, k, ns = SHAPES[shape]
    ns = ns[:n_bs]
    state = torch_tdist.overlap.state()
    fused_before = state.fused_calls["all_gather_matmul"]
    full_shape = [ws * m, k] if gather_dim == 0 else [2, ws * m, k]
    a_full = _operand(full_shape, d, seed, 1)
    a_shard = a_full.chunk(ws, dim=gather_dim)[rank].clone().requires_grad_()
    bs = {r: [_operand([k, n], d, seed, 100 + 10 * r + i) for i, n in enumerate(ns)] for r in range(ws)}
    ws_ = {r: [_operand([*full_shape[:-1], n], d, seed, 200 + 10 * r + i) for i, n in enumerate(ns)]
           for r in range(ws)}
    v = {r: _operand(full_shape, d, seed, 300 + r) for r in range(ws)}
    mine = [b.clone().requires_grad_() for b in bs[rank]]

    got_a, outs = torch_tdist.ops.all_gather_matmul(a_shard, mine if n_bs > 1 else mine[0],
                                                    gather_dim=gather_dim, return_a=True)
    outs = outs if n_bs > 1 else [outs]
    chk.equal(got_a, a_full, "gathered A")
    served = state.fused_calls["all_gather_matmul"] - fused_before
    chk.true(served == int(fused), "path", f"{served} calls by the overlapping kernel, expected {int(fused)}")
    for i, out in enumerate(outs):
        chk.products_close(out, a_full.double() @ bs[rank][i].double(), f"output {i}")
    ((got_a * v[rank]).sum() + sum((o * w).sum() for o, w in zip(outs, ws_[rank]))).backward()

    grad_full = sum(w.double() @ b.double().t() for r in range(ws) for w, b in zip(ws_[r], bs[r]))
    grad_full = grad_full + sum(v[r].double() for r in range(ws))
    chk.products_close(a_shard.grad, grad_full.chunk(ws, dim=gather_dim)[rank], "grad of A's shard")
    a64 = a_full.double().reshape(-1, k)
    for i, b in enumerate(mine):
        chk.products_close(b.grad, a64.t() @ ws_[rank][i].double().reshape(-1, ns[i]), f"grad of B {i}")
    chk.done()


def matmul_reduce_scatter(rank, ws, dtype, seed, reduce_op, shape="small", fused=False, scatter_dim=0):
    """Rank r has A_r [ws*m, k] (or [2, ws*m, k] scattered along dim 1) and B_r [k, n]; out_r =
    rows r of OP_r(A_r @ B_r)."""
    chk = Checker(rank, f"matmul_reduce_scatter[{dtype}, {reduce_op}, {shape}, dim {scatter_dim}]")
    d = dt(dtype)
    m, k, n = {"small": (3, 6, 5), "tiles": (37, 40, 50), "big": (150, 40, 50)}[shape]
    lead = [ws * m] if scatter_dim == 0 else [2, ws * m]
    state = torch_tdist.overlap.state()
    fused_before = state.fused_calls["matmul_reduce_scatter"]
    a = {r: _operand([*lead, k], d, seed, 300 + r) for r in range(ws)}
    b = {r: _operand([k, n], d, seed, 400 + r) for r in range(ws)}
    w = {r: _operand([*lead, n], d, seed, 500 + r).chunk(ws, dim=scatter_dim)[r] for r in range(ws)}
    scale = 1.0 / ws if reduce_op == "avg" else 1.0
    mine_a, mine_b = a[rank].clone().requires_grad_(), b[rank].clone().requires_grad_()

    out = torch_tdist.ops.matmul_reduce_scatter(mine_a, mine_b, scatter_dim=scatter_dim, reduce_op=reduce_op)
    total = sum(a[r].double() @ b[r].double() for r in range(ws)) * scale
    chk.products_close(out, total.chunk(ws, dim=scatter_dim)[rank], "output")
    served = state.fused_calls["matmul_reduce_scatter"] - fused_before
    chk.true(served == int(fused), "path", f"{served} calls by the overlapping kernel, expected {int(fused)}")
    (out * w[rank]).sum().backward()

    # d loss / d (A_rank @ B_rank)
    grad_c = torch.cat([w[r].double() for r in range(ws)], dim=scatter_dim) * scale
    chk.products_close(mine_a.grad, grad_c @ b[rank].double().t(), "grad of A")
    chk.products_close(mine_b.grad, (a[rank].double().reshape(-1, k).t() @ grad_c.reshape(-1, n)), "grad of B")
    chk.done()


def frozen_weights(rank, ws, seed):
    """Both ops with a B that needs no gradient (low-rank fine-tuning freezes them): A's gradient
    is right, B gets none, and the backward makes no weight-gradient matmul."""
    from torch_tdist.overlap import custom_ops

    chk = Checker(rank, "frozen weights")
    d = torch.float32
    m, k, n = 3, 8, 5
    weight_grads = []
    real = custom_ops._weight_grad
    custom_ops._weight_grad = lambda x, g: weight_grads.append(1) or real(x, g)
    try:
        a_full = _operand([ws * m, k], d, seed, 1)
        b = {r: _operand([k, n], d, seed, 100 + r) for r in range(ws)}
        w = {r: _operand([ws * m, n], d, seed, 200 + r) for r in range(ws)}
        a_shard = a_full.chunk(ws)[rank].clone().requires_grad_()
        frozen = b[rank].clone()
        out = torch_tdist.ops.all_gather_matmul(a_shard, frozen)
        (out * w[rank]).sum().backward()
        grad_full = sum(w[r].double() @ b[r].double().t() for r in range(ws))
        chk.products_close(a_shard.grad, grad_full.chunk(ws)[rank], "all_gather_matmul: grad of A's shard")

        a = {r: _operand([ws * m, k], d, seed, 300 + r) for r in range(ws)}
        v = {r: _operand([m, n], d, seed, 400 + r) for r in range(ws)}
        mine_a = a[rank].clone().requires_grad_()
        out = torch_tdist.ops.matmul_reduce_scatter(mine_a, b[rank].clone())
        (out * v[rank]).sum().backward()
        grad_c = torch.cat([v[r].double() for r in range(ws)])
        chk.products_close(mine_a.grad, grad_c @ b[rank].double().t(), "matmul_reduce_scatter: grad of A")
        chk.true(frozen.grad is None, "B's gradient", "a frozen B got a gradient")
        chk.true(not weight_grads, "weight-gradient matmuls", f"{len(weight_grads)} made for frozen weights")
    finally:
        custom_ops._weight_grad = real
    chk.done()


def pipelined_reduce_scatter(rank, ws, dtype, seed, reduce_op, chunks):
    """The pipelined matmul_reduce_scatter (overlap.pipelined, BulkPath.reduce_scatter_pipelined),
    ``chunks`` chunks a part, twice on fresh operands into a poisoned output (the second call
    must find the flags the first raised cleared)."""
    chk = Checker(rank, f"matmul_reduce_scatter_pipelined[{dtype}, {reduce_op}, {chunks} chunks]")
    d = dt(dtype)
    m, k, n = 9, 40, 50
    state = torch_tdist.overlap.state()
    for call in range(2):
        a = {r: _operand([ws * m, k], d, seed, 800 + 10 * call + r) for r in range(ws)}
        b = {r: _operand([k, n], d, seed, 900 + 10 * call + r) for r in range(ws)}
        out = torch.full((m, n), float("nan"), dtype=d)
        ran = pipelined.matmul_reduce_scatter(state, a[rank], b[rank], out, reduce_op, chunks)
        chk.true(ran, "path", "the heap did not take the pipelined op")
        total = sum(a[r].double() @ b[r].double() for r in range(ws)) / (ws if reduce_op == "avg" else 1)
        chk.products_close(out, total.chunk(ws)[rank], f"output of call {call}")
    chk.done()


def compiled(rank, ws, seed):
    """torch.compile(fullgraph=True) traces both ops (their fake kernels and autograd) and
    computes what eager mode does."""
    chk = Checker(rank, "ops under torch.compile")
    d = torch.float32
    name = dist.group.WORLD.group_name
    a = _operand([2 * ws, 4], d, seed, 600 + rank).requires_grad_()
    b = _operand([4, 3 * ws], d, seed, 700 + rank).requires_grad_()

    def step(a, b):
        _, (h,) = torch.ops.tdist.all_gather_matmul(a, [b], name, 0, False)
        return torch.ops.tdist.matmul_reduce_scatter(torch.relu(h), b.t().contiguous(), name, 0, "sum")

    eager = step(a, b)
    eager.sum().backward()
    grads = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(a, b)
    got.sum().backward()
    chk.products_close(got, eager, "compiled output")
    chk.products_close(a.grad, grads[0], "compiled grad of A")
    chk.products_close(b.grad, grads[1], "compiled grad of B")
    chk.done()


def bad_input(rank, ws, case):
    """The op's error, as (type name, message); every rank makes the same bad call."""
    a, b = torch.randn(2 * ws, 4), torch.randn(4, 3)
    calls = {
        "int dtype": lambda: torch_tdist.ops.all_gather_matmul(a.long(), b.long()),
        "K mismatch": lambda: torch_tdist.ops.all_gather_matmul(a, torch.randn(5, 3)),
        "B dtype differs": lambda: torch_tdist.ops.all_gather_matmul(a, b.double()),
        "B not 2-D": lambda: torch_tdist.ops.all_gather_matmul(a, torch.randn(2, 4, 3)),
        "A 1-D": lambda: torch_tdist.ops.matmul_reduce_scatter(torch.randn(4), b),
        "gather along K": lambda: torch_tdist.ops.all_gather_matmul(a, b, gather_dim=1),
        "rows not divisible": lambda: torch_tdist.ops.matmul_reduce_scatter(torch.randn(2 * ws + 1, 4), b),
        "reduce_op max": lambda: torch_tdist.ops.matmul_reduce_scatter(a, b, reduce_op="max"),
        "not a tdist group": lambda: torch_tdist.ops.all_gather_matmul(
            a, b, group=dist.new_group(backend="gloo")),
        "empty B list": lambda: torch_tdist.ops.all_gather_matmul(a, []),
    }
    try:
        calls[case]()
    except Exception as err:  # noqa: BLE001 - the test checks the type
        # afterwards the group still computes correctly
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x)
        assert x.tolist() == [ws * (ws + 1) / 2] * 3, x
        return type(err).__name__, str(err)
    return None, "no error"


def tuned_choices(rank, ws, seed):
    """Two calls of each op on a TDIST_OVERLAP=tune group, each checked against references
    (all_gather_matmul with two B widths, the same on every rank: q/k/v's and an MLP's, and with
    two Bs as wide together as the first); returns what the group chose per shape class, and how
    many overlapped calls the second calls made."""
    chk = Checker(rank, "tuned ops")
    state = torch_tdist.overlap.state()
    m, k, n = 20, 24, 18
    a_full = _operand([ws * m, k], torch.float32, seed, 1)
    bs = [_operand([k, width], torch.float32, seed, 2 + rank) for width in (n, 7)]
    pair = [_operand([k, width], torch.float32, seed, 5 + rank + 7 * i) for i, width in enumerate((11, n - 11))]
    for _ in range(2):
        before = sum(state.fused_calls.values())
        for b in bs:
            chk.products_close(torch_tdist.ops.all_gather_matmul(a_full.chunk(ws)[rank], b),
                   a_full.double() @ b.double(), f"all_gather_matmul n={b.shape[1]}")
        for got, b in zip(torch_tdist.ops.all_gather_matmul(a_full.chunk(ws)[rank], pair), pair):
            chk.products_close(got, a_full.double() @ b.double(), f"all_gather_matmul of two Bs, n={b.shape[1]}")
        parts = {r: _operand([ws * m, k], torch.float32, seed, 10 + r) for r in range(ws)}
        weights = {r: _operand([k, n], torch.float32, seed, 20 + r) for r in range(ws)}
        total = sum(parts[r].double() @ weights[r].double() for r in range(ws))
        chk.products_close(torch_tdist.ops.matmul_reduce_scatter(parts[rank], weights[rank]), total.chunk(ws)[rank],
               "matmul_reduce_scatter")
        fused_in_call = sum(state.fused_calls.values()) - before
    chk.done()
    return sorted((str(key), way) for key, way in state.tuning.tuned.items()), fused_in_call


def uneven_columns(rank, ws, seed):
    """Ranks with different weight widths (rank 0's is 0 columns wide), twice each: the same
    gathered A, each rank's own product; on a tuned group no rank tunes alone (the second call:
    a width rank 0 had, the others' new). Returns the shape classes the group found uneven and
    the tuned keys of this one."""
    chk = Checker(rank, "uneven columns")
    m, k = 9, 12
    a_full = _operand([ws * m, k], torch.float32, seed, 30)
    for n in ([0, 5, 7, 3][rank % 4], [0, 6, 8, 4][rank % 4]):
        b = _operand([k, n], torch.float32, seed, 40 + rank) if n else torch.empty(k, 0)
        out = torch_tdist.ops.all_gather_matmul(a_full.chunk(ws)[rank].clone(), b)
        if n:
            chk.products_close(out, a_full.double() @ b.double(), f"all_gather_matmul n={n}")
        else:
            chk.true(out.shape == (ws * m, 0), f"n={n}", f"shape {tuple(out.shape)}")
    chk.done()
    tuning = torch_tdist.overlap.state().tuning
    return ([str(c) for c in tuning.uneven_classes],
            sorted(str(key) for key in tuning.tuned if key[:4] == ("all_gather_matmul", torch.float32, 16, k)))


def opchecks(rank, ws):
    """torch.library.opcheck of both ops (schema, fake kernels and their strides, autograd
    registration), sharded along dim 1 of a 3-D A."""
    name = dist.group.WORLD.group_name
    a3 = torch.randn(2, 2 * ws, 8)
    b = torch.randn(8, 5)
    torch.library.opcheck(torch.ops.tdist.all_gather_matmul.default, (a3, [b], name, 1, True))
    torch.library.opcheck(torch.ops.tdist.matmul_reduce_scatter.default, (a3, b, name, 1, "avg"))


def issued_from_cpp(rank, ws, seed):
    """After a signature's first call ran in Python, later calls of it are issued by the C++
    backend (csrc/fused_calls.cpp): on the same inputs bit for bit what the Python path gave, on
    fresh inputs the float64 reference; a new shape, dtype, stride or dimension, inputs that need
    autograd, and bad input take the Python path (its errors unchanged)."""
    chk = Checker(rank, "fused calls issued from C++")
    state = torch_tdist.overlap.state()
    issued = state.issued

    def counts():
        return (issued.sequential[0], issued.sequential[1])

    d = torch.bfloat16
    m, k, n = 6, 16, 12
    for case, (shape, dim, n_bs, return_a) in {
            "2-D, one B": ([m, k], 0, 1, False), "3-D along dim 1, three Bs": ([2, m, k], 1, 3, True)}.items():
        full_shape = list(shape)
        full_shape[dim] *= ws
        bs = [_operand([k, n + i], d, seed, 400 + 10 * rank + i) for i in range(n_bs)]

        def call(a, bs=bs, dim=dim, return_a=return_a, n_bs=n_bs):
            got = torch_tdist.ops.all_gather_matmul(a, bs if n_bs > 1 else bs[0], gather_dim=dim,
                                                    return_a=True)
            return got[0], (got[1] if n_bs > 1 else [got[1]])

        for round_ in range(3):  # the first through Python, then from C++
            a_full = _operand(full_shape, d, seed + round_, 500)
            a_shard = a_full.chunk(ws, dim=dim)[rank].contiguous()
            before = counts()
            got_a, outs = call(a_shard)
            from_cpp = counts()[0] - before[0]
            chk.true(from_cpp == (round_ > 0), f"{case} call {round_}", f"{from_cpp} calls issued from C++")
            chk.equal(got_a, a_full, f"{case} call {round_}: gathered A")
            for i, out in enumerate(outs):
                chk.products_close(out, a_full.double() @ bs[i].double(), f"{case} call {round_}: output {i}")
            if round_ == 0:
                python_a, python_outs = got_a, outs
                again_a, again_outs = call(a_shard)  # the same inputs, issued from C++
                chk.true(torch.equal(again_a, python_a) and again_a.stride() == python_a.stride(),
                         f"{case}: gathered A", "C++ and Python differ")
                for i, (o, p) in enumerate(zip(again_outs, python_outs)):
                    chk.true(torch.equal(o, p) and o.stride() == p.stride(), f"{case}: output {i}",
                             "C++ and Python differ")

    # other signatures and inputs take the Python path
    a = _operand([m, k], d, seed, 600 + rank)
    b = _operand([k, n], d, seed, 700 + rank)
    torch_tdist.ops.all_gather_matmul(a, b)
    for what, args in {"another shape": (_operand([m + 2, k], d, seed, 601 + rank), b),
                       "another dtype": (a.half(), b.half()),
                       "another stride": (a, b.t().contiguous().t())}.items():
        before = counts()
        out = torch_tdist.ops.all_gather_matmul(*args)
        gathered = torch.cat([_operand([m + 2 if what == "another shape" else m, k], d, seed,
                                       (601 if what == "another shape" else 600) + r) for r in range(ws)])
        chk.true(counts() == before, what, f"issued from C++: {before} -> {counts()}")
        chk.products_close(out, gathered.double() @ args[1].double(), what)
    # inputs that need autograd go through the custom op's autograd; below it, C++ issues the call
    a_grad = a.clone().requires_grad_()
    before = counts()
    out = torch_tdist.ops.all_gather_matmul(a_grad, b)
    out.sum().backward()
    chk.true(counts()[0] == before[0] + 1, "autograd", f"issued from C++: {before} -> {counts()}")
    b_sum = sum(_operand([k, n], d, seed, 700 + r).double() for r in range(ws))
    chk.products_close(a_grad.grad, torch.ones(m, n, dtype=torch.float64) @ b_sum.t(), "autograd: grad of A")
    try:
        torch_tdist.ops.all_gather_matmul(a, b.double())
        chk.true(False, "bad input", "no error")
    except TypeError as err:
        chk.true("all_gather_matmul" in str(err) and "float64" in str(err), "bad input", str(err))

    # matmul_reduce_scatter, sum and avg
    for reduce_op in ("sum", "avg"):
        a_parts = {r: _operand([ws * m, k], d, seed, 800 + r) for r in range(ws)}
        b_parts = {r: _operand([k, n], d, seed, 900 + r) for r in range(ws)}
        want = sum(a_parts[r].double() @ b_parts[r].double() for r in range(ws))
        want = (want / ws if reduce_op == "avg" else want).chunk(ws)[rank]
        results = []
        for round_ in range(3):
            before = counts()
            out = torch_tdist.ops.matmul_reduce_scatter(a_parts[rank], b_parts[rank], reduce_op=reduce_op)
            from_cpp = counts()[1] - before[1]
            chk.true(from_cpp == (round_ > 0), f"{reduce_op} call {round_}", f"{from_cpp} calls issued from C++")
            chk.products_close(out, want, f"matmul_reduce_scatter {reduce_op} call {round_}")
            results.append(out)
        chk.true(all(torch.equal(r, results[0]) for r in results), f"{reduce_op}: C++ and Python",
                 "results differ on the same inputs")
    chk.done()
