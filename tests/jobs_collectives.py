"""Jobs for test_collectives.py (run inside the rank processes).

Signature of every job: job(rank, world_size, *args).  Each rank derives every
rank's input from the test's seed, computes the expected result with plain torch
ops, runs the collective on the default group, and raises AssertionError (via
Checker) listing every mismatching sub-case.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from torch_tdist.compat import all_gather_single, reduce_scatter_single

from tests.common import (Checker, bits, dt, kind_for, noncontig_empty, noncontig_rand, poison,
                          poison_like, rand, rank_gen, reduce_op, ref_reduce, shared_gen)

MOVE_SHAPES = [(13,), (2, 3, 5), (0,), (0, 3), (2053,)]


def _all_inputs(seed, ws, shape, dtype, salt, kind="move"):
    return [rand(shape, dtype, rank_gen(seed, r, salt), kind) for r in range(ws)]


def _all_nc_inputs(seed, ws, shape, dtype, salt, kind="move"):
    return [noncontig_rand(shape, dtype, rank_gen(seed, r, salt), kind) for r in range(ws)]


# ---------------------------------------------------------------------------
# all_gather_into_tensor / all_gather


def all_gather_into_tensor(rank, ws, dtype, seed):
    chk = Checker(rank, f"all_gather_into_tensor[{dtype}]")
    salt = 0
    for shape in MOVE_SHAPES:
        salt += 1
        ins = _all_inputs(seed, ws, shape, dtype, salt)
        mine = ins[rank].clone()
        expected = torch.cat(ins, 0)
        out = poison_like(expected)
        all_gather_single(out, ins[rank])
        chk.equal(out, expected, f"shape {shape}")
        chk.equal(ins[rank], mine, f"shape {shape}: input modified")

    salt += 1  # non-contiguous (transposed) input
    ins = _all_nc_inputs(seed, ws, (3, 5), dtype, salt)
    expected = torch.cat(ins, 0)
    out = poison_like(expected)
    all_gather_single(out, ins[rank])
    chk.equal(out, expected, "transposed input (3, 5)")

    salt += 1  # strided 1-D input
    bases = _all_inputs(seed, ws, (26,), dtype, salt)
    ins = [b[::2] for b in bases]
    expected = torch.cat(ins, 0)
    out = poison_like(expected)
    all_gather_single(out, ins[rank])
    chk.equal(out, expected, "strided input [::2]")

    salt += 1  # non-contiguous output
    ins = _all_inputs(seed, ws, (3, 5), dtype, salt)
    expected = torch.cat(ins, 0)
    out = noncontig_empty((3 * ws, 5), dt(dtype))
    all_gather_single(out, ins[rank])
    chk.equal(out, expected, "transposed output (3*ws, 5)")
    chk.done()


def all_gather_into_tensor_stacked(rank, ws, dtype, seed):
    """Output in the documented "stack" form: [ws, *input.shape]."""
    chk = Checker(rank, f"all_gather_into_tensor(stacked)[{dtype}]")
    for salt, shape in enumerate([(13,), (2, 3, 5)]):
        ins = _all_inputs(seed, ws, shape, dtype, salt)
        expected = torch.stack(ins, 0)
        out = poison_like(expected)
        all_gather_single(out, ins[rank])
        chk.equal(out, expected, f"input {shape} -> output {tuple(expected.shape)}")
    chk.done()


def all_gather(rank, ws, dtype, seed):
    chk = Checker(rank, f"all_gather[{dtype}]")
    d = dt(dtype)
    salt = 0
    for shape in MOVE_SHAPES:
        salt += 1
        ins = _all_inputs(seed, ws, shape, dtype, salt)
        mine = ins[rank].clone()
        outs = [poison(shape, d, seed=100 + i) for i in range(ws)]
        dist.all_gather(outs, ins[rank])
        for j in range(ws):
            chk.equal(outs[j], ins[j], f"shape {shape}, output[{j}]")
        chk.equal(ins[rank], mine, f"shape {shape}: input modified")

    salt += 1  # outputs are views into one buffer
    ins = _all_inputs(seed, ws, (7, 3), dtype, salt)
    big = poison((7 * ws, 3), d)
    dist.all_gather(list(big.chunk(ws)), ins[rank])
    chk.equal(big, torch.cat(ins), "outputs = chunks of one buffer")

    salt += 1  # non-contiguous input and outputs
    ins = _all_nc_inputs(seed, ws, (3, 5), dtype, salt)
    outs = [noncontig_empty((3, 5), d) for _ in range(ws)]
    dist.all_gather(outs, ins[rank])
    for j in range(ws):
        chk.equal(outs[j], ins[j], f"transposed input and outputs, output[{j}]")
    chk.done()


# ---------------------------------------------------------------------------
# reductions


def _reduce_shapes(op, small, extra):
    return small + (extra if op == "SUM" else [])


def all_reduce(rank, ws, dtype, op, seed):
    """Returns the results' bits, so the test can check every rank got the same bits."""
    chk = Checker(rank, f"all_reduce[{dtype}, {op}]")
    kind = kind_for(op)
    rop = reduce_op(op)
    salt = 0
    results = []
    for shape in _reduce_shapes(op, [(13,), (2, 3, 5)], [(0,), (2053,)]):
        salt += 1
        ins = _all_inputs(seed, ws, shape, dtype, salt, kind)
        expected = ref_reduce(ins, op)
        t = ins[rank].clone()
        dist.all_reduce(t, op=rop)
        chk.close(t, expected, f"shape {shape}", op)
        results.append((shape, bits(t).clone()))
    if op == "SUM":
        salt += 1  # transposed (non-contiguous) tensor, reduced in place
        ins = _all_nc_inputs(seed, ws, (3, 5), dtype, salt, kind)
        expected = ref_reduce(ins, op)
        t = ins[rank]
        dist.all_reduce(t, op=rop)
        chk.true(not t.is_contiguous(), "transposed", "the view became contiguous?")
        chk.close(t, expected, "transposed (3, 5) in place", op)
        results.append(("transposed (3, 5)", bits(t).clone()))
    chk.done()
    return results


def reduce_scatter_tensor(rank, ws, dtype, op, seed):
    chk = Checker(rank, f"reduce_scatter_tensor[{dtype}, {op}]")
    d = dt(dtype)
    kind = kind_for(op)
    rop = reduce_op(op)
    salt = 0
    for out_shape in _reduce_shapes(op, [(7,), (2, 3, 5)], [(0,), (1031,)]):
        salt += 1
        n = out_shape[0]
        in_shape = (ws * n,) + tuple(out_shape[1:])
        ins = _all_inputs(seed, ws, in_shape, dtype, salt, kind)
        mine = ins[rank].clone()
        expected = ref_reduce([x[rank * n:(rank + 1) * n] for x in ins], op)
        out = poison(out_shape, d)
        reduce_scatter_single(out, ins[rank], op=rop)
        chk.close(out, expected, f"output {out_shape}", op)
        chk.equal(ins[rank], mine, f"output {out_shape}: input modified")
    if op == "SUM":
        salt += 1  # transposed input
        ins = _all_nc_inputs(seed, ws, (2 * ws, 5), dtype, salt, kind)
        expected = ref_reduce([x[rank * 2:(rank + 1) * 2] for x in ins], op)
        out = poison((2, 5), d)
        reduce_scatter_single(out, ins[rank], op=rop)
        chk.close(out, expected, "transposed input (2*ws, 5)", op)

        salt += 1  # transposed output
        ins = _all_inputs(seed, ws, (2 * ws, 5), dtype, salt, kind)
        expected = ref_reduce([x[rank * 2:(rank + 1) * 2] for x in ins], op)
        out = noncontig_empty((2, 5), d)
        reduce_scatter_single(out, ins[rank], op=rop)
        chk.close(out, expected, "transposed output (2, 5)", op)
    chk.done()


def reduce_scatter_tensor_stacked(rank, ws, dtype, op, seed):
    """Input in the documented "stack" form: [ws, *output.shape]."""
    chk = Checker(rank, f"reduce_scatter_tensor(stacked)[{dtype}, {op}]")
    kind = kind_for(op)
    ins = _all_inputs(seed, ws, (ws, 2, 3), dtype, 1, kind)
    expected = ref_reduce([x[rank] for x in ins], op)
    out = poison((2, 3), dt(dtype))
    reduce_scatter_single(out, ins[rank], op=reduce_op(op))
    chk.close(out, expected, "input (ws, 2, 3) -> output (2, 3)", op)
    chk.done()


def reduce_scatter(rank, ws, dtype, op, seed):
    chk = Checker(rank, f"reduce_scatter[{dtype}, {op}]")
    d = dt(dtype)
    kind = kind_for(op)
    rop = reduce_op(op)
    salt = 0
    for shape in _reduce_shapes(op, [(2, 3, 5)], [(13,), (0,)]):
        salt += 1
        # rank j's input list: ws tensors of `shape`; rank r gets reduce_j(list_j[r])
        lists = [[rand(shape, d, rank_gen(seed, j, salt * 100 + k), kind) for k in range(ws)]
                 for j in range(ws)]
        expected = ref_reduce([lists[j][rank] for j in range(ws)], op)
        out = poison(shape, d)
        dist.reduce_scatter(out, lists[rank], op=rop)
        chk.close(out, expected, f"shape {shape}", op)
    if op == "SUM":
        salt += 1  # transposed inputs and output
        lists = [[noncontig_rand((3, 4), d, rank_gen(seed, j, salt * 100 + k), kind) for k in range(ws)]
                 for j in range(ws)]
        expected = ref_reduce([lists[j][rank] for j in range(ws)], op)
        out = noncontig_empty((3, 4), d)
        dist.reduce_scatter(out, lists[rank], op=rop)
        chk.close(out, expected, "transposed inputs and output", op)
    chk.done()


def reduce(rank, ws, dtype, op, seed):
    chk = Checker(rank, f"reduce[{dtype}, {op}]")
    kind = kind_for(op)
    rop = reduce_op(op)
    salt = 0
    for dst in sorted({1, ws - 1}):  # never rank 0
        shapes = [(2, 3, 5)] + ([(13,), "nc"] if op == "SUM" and dst == ws - 1 else [])
        for shape in shapes:
            salt += 1
            if shape == "nc":
                ins = _all_nc_inputs(seed, ws, (3, 5), dtype, salt, kind)
            else:
                ins = _all_inputs(seed, ws, shape, dtype, salt, kind)
            expected = ref_reduce(ins, op)
            t = ins[rank].clone() if shape != "nc" else ins[rank]
            dist.reduce(t, dst=dst, op=rop)
            if rank == dst:
                chk.close(t, expected, f"dst {dst}, shape {shape}", op)
    chk.done()


# ---------------------------------------------------------------------------
# all_to_all


def _a2a_reference(ins, S, rank):
    """Rank `rank`'s output of an all_to_all_single where rank j sends S[j][k] rows to k."""
    parts = []
    for j, x in enumerate(ins):
        off = int(S[j][:rank].sum())
        parts.append(x[off:off + int(S[j][rank])])
    return torch.cat(parts, 0)


def all_to_all_single_even(rank, ws, dtype, seed):
    chk = Checker(rank, f"all_to_all_single(even)[{dtype}]")
    d = dt(dtype)
    salt = 0
    for shape in [(2 * ws, 3), (5 * ws,), (ws, 3, 5)]:
        salt += 1
        ins = _all_inputs(seed, ws, shape, dtype, salt)
        mine = ins[rank].clone()
        S = torch.full((ws, ws), shape[0] // ws, dtype=torch.int64)
        expected = _a2a_reference(ins, S, rank)
        out = poison(shape, d)
        dist.all_to_all_single(out, ins[rank])
        chk.equal(out, expected, f"{shape}")
        chk.equal(ins[rank], mine, f"{shape}: input modified")
    chk.done()


def _split_matrix(seed, ws, salt, hi, zero_row=None, zero_col=None):
    g = shared_gen(seed, salt)
    S = torch.randint(0, hi, (ws, ws), generator=g, dtype=torch.int64)
    S[0, ws - 1] = 0  # always at least one empty split
    if zero_row is not None:
        S[zero_row, :] = 0
    if zero_col is not None:
        S[:, zero_col] = 0
    return S


def all_to_all_single_uneven(rank, ws, dtype, seed):
    chk = Checker(rank, f"all_to_all_single(uneven)[{dtype}]")
    d = dt(dtype)
    cases = [
        ("random splits, rows of 3", dict(hi=5), (3,)),
        ("rank 0 sends nothing, rank 1 receives nothing", dict(hi=6, zero_row=0, zero_col=1), ()),
        ("larger random splits, 1-D", dict(hi=400), ()),
    ]
    for salt, (name, kw, trail) in enumerate(cases, start=1):
        S = _split_matrix(seed, ws, salt, **kw)
        ins = [rand((int(S[j].sum()),) + trail, d, rank_gen(seed, j, salt)) for j in range(ws)]
        expected = _a2a_reference(ins, S, rank)
        out = poison(expected.shape, d)
        dist.all_to_all_single(out, ins[rank], output_split_sizes=S[:, rank].tolist(),
                               input_split_sizes=S[rank].tolist())
        chk.equal(out, expected, f"{name}; splits {S.tolist()}")
    chk.done()


def all_to_all_uneven(rank, ws, dtype, seed):
    chk = Checker(rank, f"all_to_all(uneven)[{dtype}]")
    d = dt(dtype)
    for salt, (name, trail, hi) in enumerate([("uneven with empty tensors", (2,), 5),
                                              ("uneven 1-D", (), 40)], start=1):
        S = _split_matrix(seed, ws, salt, hi)
        # rank j sends lists[j][k] (S[j][k] rows) to rank k
        lists = []
        for j in range(ws):
            g = rank_gen(seed, j, salt)
            lists.append([rand((int(S[j][k]),) + trail, d, g) for k in range(ws)])
        outs = [poison((int(S[j][rank]),) + trail, d, seed=200 + j) for j in range(ws)]
        dist.all_to_all(outs, lists[rank])
        for j in range(ws):
            chk.equal(outs[j], lists[j][rank], f"{name}: output[{j}]; splits {S.tolist()}")
    chk.done()


def all_to_all_even(rank, ws, dtype, seed):
    chk = Checker(rank, f"all_to_all(even)[{dtype}]")
    d = dt(dtype)
    for salt, case in enumerate(["(3, 4) chunks", "(13,) chunks", "transposed (3, 4) in/out"], start=1):
        shape = (13,) if case == "(13,) chunks" else (3, 4)
        if case.startswith("transposed"):
            lists = [[noncontig_rand(shape, d, rank_gen(seed, j, salt * 10 + k)) for k in range(ws)]
                     for j in range(ws)]
            outs = [noncontig_empty(shape, d) for _ in range(ws)]
        else:
            lists = [[rand(shape, d, rank_gen(seed, j, salt * 10 + k)) for k in range(ws)]
                     for j in range(ws)]
            outs = [poison(shape, d, seed=200 + j) for j in range(ws)]
        dist.all_to_all(outs, lists[rank])
        for j in range(ws):
            chk.equal(outs[j], lists[j][rank], f"{case}: output[{j}]")
    chk.done()


# ---------------------------------------------------------------------------
# broadcast / scatter / gather / barrier


def broadcast(rank, ws, dtype, seed):
    chk = Checker(rank, f"broadcast[{dtype}]")
    d = dt(dtype)
    salt = 0
    for src in range(ws):
        salt += 1
        data = rand((2, 3, 5), d, rank_gen(seed, src, salt))
        t = data.clone() if rank == src else poison((2, 3, 5), d)
        dist.broadcast(t, src=src)
        chk.equal(t, data, f"src {src}, shape (2, 3, 5)")
    src = ws - 1
    for shape in [(2053,), (0,), "nc"]:
        salt += 1
        if shape == "nc":
            data = noncontig_rand((3, 5), d, rank_gen(seed, src, salt))
            t = data.clone() if rank == src else noncontig_empty((3, 5), d)  # clone keeps the strides
            dist.broadcast(t, src=src)
            chk.equal(t, data, f"src {src}, transposed (3, 5)")
        else:
            data = rand(shape, d, rank_gen(seed, src, salt))
            t = data.clone() if rank == src else poison(shape, d)
            dist.broadcast(t, src=src)
            chk.equal(t, data, f"src {src}, shape {shape}")
    chk.done()


def scatter(rank, ws, dtype, seed):
    chk = Checker(rank, f"scatter[{dtype}]")
    d = dt(dtype)
    salt = 0
    for src in sorted({1, ws - 1}):  # never rank 0
        for shape in [(2, 3, 5), (13,), "nc"]:
            salt += 1
            if shape == "nc":
                chunks = [noncontig_rand((3, 4), d, rank_gen(seed, src, salt * 10 + k)) for k in range(ws)]
                out = noncontig_empty((3, 4), d)
            else:
                chunks = [rand(shape, d, rank_gen(seed, src, salt * 10 + k)) for k in range(ws)]
                out = poison(shape, d)
            dist.scatter(out, chunks if rank == src else None, src=src)
            chk.equal(out, chunks[rank], f"src {src}, shape {shape}")
    chk.done()


def gather(rank, ws, dtype, seed):
    chk = Checker(rank, f"gather[{dtype}]")
    d = dt(dtype)
    salt = 0
    for dst in sorted({1, ws - 1}):  # never rank 0
        for shape in [(2, 3, 5), (13,), "nc"]:
            salt += 1
            if shape == "nc":
                ins = _all_nc_inputs(seed, ws, (3, 4), dtype, salt)
                outs = [noncontig_empty((3, 4), d) for _ in range(ws)] if rank == dst else None
            else:
                ins = _all_inputs(seed, ws, shape, dtype, salt)
                outs = [poison(shape, d, seed=300 + j) for j in range(ws)] if rank == dst else None
            dist.gather(ins[rank], outs, dst=dst)
            if rank == dst:
                for j in range(ws):
                    chk.equal(outs[j], ins[j], f"dst {dst}, shape {shape}, output[{j}]")
    chk.done()


def barrier(rank, ws, seed, rounds=4):
    """Returns [(arrive, leave)] per round; ranks arrive at staggered times."""
    stamps = []
    g = shared_gen(seed)
    for i in range(rounds):
        late = int(torch.randint(0, ws, (1,), generator=g))
        if rank == late:
            time.sleep(0.15)
        arrive = time.time()
        dist.barrier()
        leave = time.time()
        stamps.append((late, arrive, leave))
    return stamps


def noncontig_outputs(rank, ws, dtype, seed):
    """Outputs that are views: in-place collectives on a view with gaps
    (base[:, ::2]) must write the view and leave the elements between untouched;
    all_to_all_single into a transposed output."""
    chk = Checker(rank, f"non-contiguous outputs[{dtype}]")
    d = dt(dtype)
    for salt, op in enumerate(["SUM", "MAX"], start=1):
        bases = _all_inputs(seed, ws, (4, 10), dtype, salt, kind_for(op))
        expected = ref_reduce([b[:, ::2] for b in bases], op)
        base = bases[rank].clone()
        untouched = base[:, 1::2].clone()
        dist.all_reduce(base[:, ::2], op=reduce_op(op))
        chk.close(base[:, ::2], expected, f"all_reduce {op} on base[:, ::2]", op)
        chk.equal(base[:, 1::2], untouched, f"all_reduce {op}: elements outside the view modified")

    src = ws - 1
    base_data = rand((4, 10), d, rank_gen(seed, src, 10))
    base = base_data.clone() if rank == src else poison((4, 10), d)
    untouched = base[:, 1::2].clone()
    dist.broadcast(base[:, ::2], src=src)
    chk.equal(base[:, ::2], base_data[:, ::2], f"broadcast src {src} on base[:, ::2]")
    chk.equal(base[:, 1::2], untouched, f"broadcast src {src}: elements outside the view modified")

    bases = _all_inputs(seed, ws, (6, 4), dtype, 11, "sum")
    expected = ref_reduce([b[1::2] for b in bases], "SUM")
    base = bases[rank].clone()
    untouched = base[0::2].clone()
    dist.reduce(base[1::2], dst=src)
    if rank == src:
        chk.close(base[1::2], expected, f"reduce dst {src} on base[1::2]")
        chk.equal(base[0::2], untouched, f"reduce dst {src}: elements outside the view modified")

    ins = _all_inputs(seed, ws, (2 * ws, 3), dtype, 12)
    S = torch.full((ws, ws), 2, dtype=torch.int64)
    out = noncontig_empty((2 * ws, 3), d)
    dist.all_to_all_single(out, ins[rank])
    chk.equal(out, _a2a_reference(ins, S, rank), "all_to_all_single into a transposed output")
    chk.done()


# ---------------------------------------------------------------------------
# async ops, many back-to-back ops


def async_ops(rank, ws, dtype, seed, mode="wait", ops=None):
    """Several async collectives in flight at once, completed in reverse order
    through work.wait() (mode "wait") or work.get_future().wait() ("future").
    `ops`: the names of the collectives to issue (default: all)."""
    chk = Checker(rank, f"async[{dtype}, {mode}]")
    d = dt(dtype)
    use_future = mode == "future"
    salt = 10 if use_future else 0
    ar_in = _all_inputs(seed, ws, (37,), dtype, salt + 1, "sum")
    ag_in = _all_inputs(seed, ws, (2, 5), dtype, salt + 2)
    rs_in = _all_inputs(seed, ws, (3 * ws, 2), dtype, salt + 3, "sum")
    bc = rand((11,), d, rank_gen(seed, ws - 1, salt + 4))
    a2a_in = _all_inputs(seed, ws, (2 * ws,), dtype, salt + 5)
    agl_in = _all_inputs(seed, ws, (4,), dtype, salt + 6)

    ar = ar_in[rank].clone()
    ag = poison((2 * ws, 5), d)
    rs = poison((3, 2), d)
    bct = bc.clone() if rank == ws - 1 else poison((11,), d)
    a2a = poison((2 * ws,), d)
    agl = [poison((4,), d, seed=400 + j) for j in range(ws)]
    launch = [
        ("all_reduce", lambda: dist.all_reduce(ar, async_op=True), ar),
        ("all_gather_into_tensor", lambda: all_gather_single(ag, ag_in[rank], async_op=True), ag),
        ("reduce_scatter_tensor", lambda: reduce_scatter_single(rs, rs_in[rank], async_op=True), rs),
        ("broadcast", lambda: dist.broadcast(bct, src=ws - 1, async_op=True), bct),
        ("all_to_all_single", lambda: dist.all_to_all_single(a2a, a2a_in[rank], async_op=True), a2a),
        ("all_gather", lambda: dist.all_gather(agl, agl_in[rank], async_op=True), agl[0]),
        ("barrier", lambda: dist.barrier(async_op=True), None),
    ]
    names = [name for name, _, _ in launch] if ops is None else list(ops)
    works = [(name, f(), out) for name, f, out in launch if name in names]
    for name, work, out in reversed(works):
        chk.true(work is not None, name, "async_op=True returned None")
        if work is None:
            continue
        if use_future:
            value = work.get_future().wait()
            if out is not None and isinstance(value, (list, tuple)) and value:
                chk.true(isinstance(value[0], torch.Tensor), name,
                         f"future value is {type(value[0]).__name__}, expected tensors")
                if isinstance(value[0], torch.Tensor) and value[0].shape == out.shape:
                    chk.equal(value[0], out, f"{name}: future value differs from the output tensor")
        else:
            ok = work.wait()
            chk.true(ok is None or ok is True, name, f"wait() returned {ok!r}")
    how = "get_future().wait()" if use_future else "wait()"
    if "all_reduce" in names:
        chk.close(ar, ref_reduce(ar_in, "SUM"), f"all_reduce via {how}")
    if "all_gather_into_tensor" in names:
        chk.equal(ag, torch.cat(ag_in), f"all_gather_into_tensor via {how}")
    if "reduce_scatter_tensor" in names:
        chk.close(rs, ref_reduce([x[3 * rank:3 * rank + 3] for x in rs_in], "SUM"),
                  f"reduce_scatter_tensor via {how}")
    if "broadcast" in names:
        chk.equal(bct, bc, f"broadcast via {how}")
    if "all_to_all_single" in names:
        S = torch.full((ws, ws), 2, dtype=torch.int64)
        chk.equal(a2a, _a2a_reference(a2a_in, S, rank), f"all_to_all_single via {how}")
    if "all_gather" in names:
        for j in range(ws):
            chk.equal(agl[j], agl_in[j], f"all_gather via {how}, output[{j}]")
    chk.done()


def coalescing_manager_calls(rank, ws, seed):
    """torch's ``_coalescing_manager`` (how FSDP batches its collectives) reaches the backend's
    ``*_coalesced`` calls: synchronous ones (no Work back) and asynchronous ones (``cm.wait()``)."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    chk = Checker(rank, "coalescing_manager_calls")
    for async_ops in (False, True):
        case = f"async_ops={async_ops}"
        parts = [_all_inputs(seed, ws, (ws * (3 + k),), "float32", 20 + k + 10 * async_ops, "sum")
                 for k in range(3)]
        gathered = [poison((ws * ws * (3 + k),), dt("float32")) for k in range(3)]
        with _coalescing_manager(async_ops=async_ops) as cm:
            for k in range(3):
                all_gather_single(gathered[k], parts[k][rank])
        if async_ops:
            cm.wait()
        scattered = [poison((3 + k,), dt("float32")) for k in range(3)]
        with _coalescing_manager(async_ops=async_ops) as cm:
            for k in range(3):
                reduce_scatter_single(scattered[k], parts[k][rank])
        if async_ops:
            cm.wait()
        reduced = [parts[k][rank].clone() for k in range(3)]
        with _coalescing_manager(async_ops=async_ops) as cm:
            for k in range(3):
                dist.all_reduce(reduced[k])
        if async_ops:
            cm.wait()
        for k in range(3):
            n = 3 + k
            chk.equal(gathered[k], torch.cat(parts[k]), f"{case}: all_gather_into_tensor [{k}]")
            total = ref_reduce(parts[k], "SUM")
            chk.close(scattered[k], total[rank * n:(rank + 1) * n], f"{case}: reduce_scatter_tensor [{k}]")
            chk.close(reduced[k], total, f"{case}: all_reduce [{k}]")
    chk.done()


def profiled_calls(rank, ws, seed):
    """Calls under torch.profiler show as ``tdist:<op>`` ranges and stay right; the calls
    before and after it, with no profiler on, open none."""
    from torch.profiler import ProfilerActivity, profile

    chk = Checker(rank, "profiled_calls")
    ins = _all_inputs(seed, ws, (37,), "float32", 0, "sum")
    t = ins[rank].clone()
    dist.all_reduce(t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(t)
        out = poison((ws * 37,), dt("float32"))
        all_gather_single(out, ins[rank])
    chk.close(t, ref_reduce(ins, "SUM") * ws, "all_reduce twice, the second under the profiler")
    chk.equal(out, torch.cat(ins), "all_gather_into_tensor under the profiler")
    names = [e.name for e in prof.events()]
    for title in ("tdist:all_reduce", "tdist:all_gather_into_tensor"):
        chk.true(names.count(title) == 1, title, f"{names.count(title)} profiler ranges, expected 1")
    dist.all_reduce(t)
    chk.close(t, ref_reduce(ins, "SUM") * ws * ws, "all_reduce after the profiler")
    chk.done()


def sync_calls_return_no_work(rank, ws, seed):
    """As NCCL's since torch 2.8: a call with asyncOp False returns no Work (torch.distributed
    then skips wait()), its result in place; with asyncOp True, a Work; a barrier keeps its Work
    either way (its wait() holds the host)."""
    from torch._C._distributed_c10d import AllreduceOptions, BarrierOptions

    chk = Checker(rank, "sync_calls_return_no_work")
    pg = dist.group.WORLD
    ins = _all_inputs(seed, ws, (41,), "float32", 0, "sum")
    for async_op in (False, True):
        t = ins[rank].clone()
        opts = AllreduceOptions()
        opts.asyncOp = async_op
        work = pg.allreduce([t], opts)
        chk.true((work is not None) == async_op, f"allreduce asyncOp={async_op}", f"returned {work!r}")
        if work is not None:
            work.wait()
        chk.close(t, ref_reduce(ins, "SUM"), f"allreduce asyncOp={async_op}")
    opts = BarrierOptions()
    opts.asyncOp = False
    work = pg.barrier(opts)
    chk.true(work is not None, "barrier asyncOp=False", "returned no Work")
    if work is not None:
        work.wait()
    chk.done()


def back_to_back(rank, ws, seed, iters=24):
    """Many small collectives in a row with changing sizes, dtypes and roots:
    catches stale signals/epochs and workspace reuse bugs."""
    chk = Checker(rank, "back_to_back")
    g = shared_gen(seed)
    dtypes = ["float32", "bfloat16", "int64", "float16"]
    for i in range(iters):
        dtype = dtypes[i % len(dtypes)]
        d = dt(dtype)
        n = int(torch.randint(1, 300, (1,), generator=g))
        which = i % 5
        if which == 0:
            ins = _all_inputs(seed, ws, (n,), dtype, i, "sum")
            t = ins[rank].clone()
            dist.all_reduce(t)
            chk.close(t, ref_reduce(ins, "SUM"), f"iter {i}: all_reduce n={n} {dtype}")
        elif which == 1:
            ins = _all_inputs(seed, ws, (n,), dtype, i)
            out = poison((ws * n,), d)
            all_gather_single(out, ins[rank])
            chk.equal(out, torch.cat(ins), f"iter {i}: all_gather_into_tensor n={n} {dtype}")
        elif which == 2:
            ins = _all_inputs(seed, ws, (ws * n,), dtype, i, "sum")
            out = poison((n,), d)
            reduce_scatter_single(out, ins[rank])
            chk.close(out, ref_reduce([x[rank * n:(rank + 1) * n] for x in ins], "SUM"),
                      f"iter {i}: reduce_scatter_tensor n={n} {dtype}")
        elif which == 3:
            src = i % ws
            data = rand((n,), d, rank_gen(seed, src, i))
            t = data.clone() if rank == src else poison((n,), d)
            dist.broadcast(t, src=src)
            chk.equal(t, data, f"iter {i}: broadcast src={src} n={n} {dtype}")
        else:
            S = _split_matrix(seed, ws, 1000 + i, hi=20)
            ins = [rand((int(S[j].sum()),), d, rank_gen(seed, j, i)) for j in range(ws)]
            expected = _a2a_reference(ins, S, rank)
            out = poison(expected.shape, d)
            dist.all_to_all_single(out, ins[rank], S[:, rank].tolist(), S[rank].tolist())
            chk.equal(out, expected, f"iter {i}: all_to_all_single {dtype} splits {S.tolist()}")
    chk.done()
