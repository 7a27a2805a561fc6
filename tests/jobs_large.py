"""Jobs for test_large.py: messages larger than the staging area, run in several rounds."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_tdist.compat import all_gather_single, reduce_scatter_single


def _inputs(seed, ws, n, dtype):
    return [torch.randn(n, generator=torch.Generator().manual_seed(seed * 31 + r)).to(dtype) for r in range(ws)]


def _close(got, want, what):
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), f"{what}: wrong result"


def every_op_in_rounds(rank, ws, n, dtype_name, seed):
    """Every chunked op at ``n`` elements per rank (far more than the heap stages at once)."""
    dtype = getattr(torch, dtype_name)
    xs = _inputs(seed, ws, n, dtype)
    x = xs[rank]

    out = torch.full((ws * n,), float("nan"), dtype=dtype)
    all_gather_single(out, x)
    assert torch.equal(out, torch.cat(xs)), "all_gather_into_tensor: wrong result"

    wide = _inputs(seed + 1, ws, ws * n, dtype)
    rs = torch.full((n,), float("nan"), dtype=dtype)
    reduce_scatter_single(rs, wide[rank])
    _close(rs, sum(w.float() for w in wide)[rank * n:(rank + 1) * n], "reduce_scatter_tensor")

    ar = x.clone()
    dist.all_reduce(ar)
    _close(ar, sum(t.float() for t in xs), "all_reduce")

    red = x.clone()
    dist.reduce(red, dst=ws - 1, op=dist.ReduceOp.MAX)
    if rank == ws - 1:
        assert torch.equal(red, torch.stack(xs).amax(0)), "reduce: wrong result"

    bc = x.clone()
    dist.broadcast(bc, src=1)
    assert torch.equal(bc, xs[1]), "broadcast: wrong result"

    sc = torch.full((n,), float("nan"), dtype=dtype)
    dist.scatter(sc, [t.clone() for t in wide[0].view(ws, n)] if rank == 0 else None, src=0)
    assert torch.equal(sc, wide[0].view(ws, n)[rank]), "scatter: wrong result"

    gathered = [torch.full((n,), float("nan"), dtype=dtype) for _ in range(ws)] if rank == 1 else None
    dist.gather(x, gathered, dst=1)
    if rank == 1:
        assert torch.equal(torch.cat(gathered), torch.cat(xs)), "gather: wrong result"


def large_messages(rank, ws, n, dtype_name, seed):
    """all_gather (both forms), reduce_scatter (both forms), all_reduce (in place) and an even
    all_to_all_single on the path the pool's TDIST_ALGORITHM forces, with several reduce ops, in
    several rounds, one-shot broadcasts in between; outputs poisoned first. With
    TDIST_ALGORITHM=streamed, lowlatency or twoshot, checks that that kernel served them (twoshot:
    the all_reduces)."""
    import os

    import torch_tdist

    dtype = getattr(torch, dtype_name)
    before = torch_tdist.stats()
    executor = torch_tdist.get_executor()
    algorithm = os.environ.get("TDIST_ALGORITHM")
    served = []  # the ops the forced kernel (streamed, low-latency or two-shot) served
    if algorithm in ("streamed", "lowlatency", "twoshot"):
        stop_counting = _count_calls(executor.algorithms[algorithm], "run", served)
    xs = _inputs(seed, ws, n, dtype)
    x = xs[rank]

    out = torch.full((ws * n,), float("nan"), dtype=dtype)
    all_gather_single(out, x)
    assert torch.equal(out, torch.cat(xs)), "all_gather_into_tensor: wrong result"
    _broadcast_checked(xs, ws - 1)
    parts = [torch.full((n,), float("nan"), dtype=dtype) for _ in range(ws)]
    dist.all_gather(parts, x)
    assert torch.equal(torch.cat(parts), torch.cat(xs)), "all_gather: wrong result"

    wide = _inputs(seed + 1, ws, ws * n, dtype)
    exchanged = torch.full((ws * n,), float("nan"), dtype=dtype)
    dist.all_to_all_single(exchanged, wide[rank])
    assert torch.equal(exchanged, torch.cat([w.view(ws, n)[rank] for w in wide])), "all_to_all_single: wrong result"
    _uneven_all_to_all_checked(executor, seed, ws, n, dtype, streamed=algorithm == "streamed")

    stacked = torch.stack([w.float() for w in wide])
    for name, want in (("SUM", stacked.sum(0)), ("AVG", stacked.mean(0)), ("MAX", stacked.amax(0)),
                       ("MIN", stacked.amin(0))):
        rs = torch.full((n,), float("nan"), dtype=dtype)
        reduce_scatter_single(rs, wide[rank], op=getattr(dist.ReduceOp, name))
        _close(rs, want[rank * n:(rank + 1) * n], f"reduce_scatter_tensor {name}")
    rs = torch.full((n,), float("nan"), dtype=dtype)
    dist.reduce_scatter(rs, [t.clone() for t in wide[rank].view(ws, n)])
    _close(rs, stacked.sum(0)[rank * n:(rank + 1) * n], "reduce_scatter")
    _broadcast_checked(xs, 0)

    stacked = torch.stack([t.float() for t in xs])
    for name, want in (("SUM", stacked.sum(0)), ("PRODUCT", stacked.prod(0)), ("MAX", stacked.amax(0))):
        ar = x.clone()
        dist.all_reduce(ar, op=getattr(dist.ReduceOp, name))
        _close(ar, want, f"all_reduce {name}")
        everyone = [torch.empty_like(ar) for _ in range(ws)]
        dist.all_gather(everyone, ar)
        assert all(torch.equal(e, ar) for e in everyone), f"all_reduce {name}: ranks disagree"

    after = torch_tdist.stats()
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"):
        assert after[op]["tdist"] > before[op]["tdist"] and after[op]["fallback"] == before[op]["fallback"], op
    if algorithm in ("streamed", "lowlatency", "twoshot"):
        stop_counting()
        missing = ({"all_reduce"} if algorithm == "twoshot" else
                   {"all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter",
                    "all_reduce", "all_to_all_single"}) - set(served)
        assert not missing, f"not served by the {algorithm} kernel: {missing}"


def _count_calls(algorithm, method: str, ops: list):
    """Appends the op of every call ``algorithm.<method>(ctx, call)`` serves to ``ops``; returns
    what stops it."""
    original = getattr(algorithm, method)
    setattr(algorithm, method, lambda ctx, call: (ops.append(call.op), original(ctx, call)))
    return lambda: delattr(algorithm, method)


def _uneven_all_to_all_checked(executor, seed, ws, n, dtype, streamed):
    """An all_to_all_single with split sizes (one pair empty, the others up to a third of a
    mailbox), against the pieces cut by hand; with ``streamed``, checks that the streamed kernel
    for split sizes served it."""
    rank = dist.get_rank()
    unit = max(1, min(n // (3 * ws), executor.mailbox_bytes // dtype.itemsize // 3))

    def count(src, dst):
        return 0 if (src, dst) == (0, ws - 1) else ((src + 2 * dst) % 3 + 1) * unit

    xs = [torch.randn(sum(count(r, d) for d in range(ws)), generator=torch.Generator().manual_seed(seed * 13 + r)).to(dtype)
          for r in range(ws)]
    want = torch.cat([xs[r][sum(count(r, d) for d in range(rank)):][:count(r, rank)] for r in range(ws)])
    got = torch.full_like(want, float("nan"))
    calls = []
    stop_counting = _count_calls(executor.algorithms["streamed"], "all_to_all_v", calls) if streamed else None
    try:
        dist.all_to_all_single(got, xs[rank], [count(r, rank) for r in range(ws)], [count(rank, d) for d in range(ws)])
    finally:
        if stop_counting:
            stop_counting()
    assert torch.equal(got, want), "all_to_all_single with split sizes: wrong result"
    assert calls or not streamed, "all_to_all_single with split sizes: not served by the streamed kernel"


def uneven_all_to_all_in_turns(rank, ws, seed, dtype_name):
    """An all_to_all_single with split sizes whose shares are 1-3 mailbox slots and a bit (one
    pair empty), through the streamed kernel (TDIST_ALGORITHM=streamed), which moves them in
    turns; then one whose splits rank 1 gets wrong (it expects fewer rows from rank 0 than rank 0
    sends, both more than a slot); then the first again. Returns (the second call's error or
    "returned", whether the first and third were right and served by the streamed kernel)."""
    import torch_tdist

    dtype = getattr(torch, dtype_name)
    executor = torch_tdist.get_executor()
    dist.all_reduce(torch.ones(1))  # (the heap, and with it the mailboxes, comes with a first call)
    slot = executor.mailbox_bytes // dtype.itemsize

    def count(src, dst):
        return 0 if (src, dst) == (ws - 1, 0) else ((src + dst) % 3 + 1) * slot + 37 * src + 5 * dst

    def data(src, tag):
        g = torch.Generator().manual_seed(seed * 11 + src * 5 + tag)
        return torch.randn(sum(count(src, d) for d in range(ws)), generator=g).to(dtype)

    served = []
    stop_counting = _count_calls(executor.algorithms["streamed"], "all_to_all_v", served)

    def exchange(tag, expected_from_0):
        want = torch.cat([data(s, tag)[sum(count(s, d) for d in range(rank)):][:count(s, rank)] for s in range(ws)])
        got = torch.full((sum(expected_from_0 if s == 0 and rank == 1 else count(s, rank) for s in range(ws)),),
                         float("nan"), dtype=dtype)
        recv = [expected_from_0 if s == 0 and rank == 1 else count(s, rank) for s in range(ws)]
        dist.all_to_all_single(got, data(rank, tag), recv, [count(rank, d) for d in range(ws)])
        return torch.equal(got, want)

    try:
        first = exchange(0, count(0, 1))
        try:
            exchange(1, count(0, 1) - slot)
            second = "returned"
        except ValueError as err:
            second = str(err)
        third = exchange(2, count(0, 1))
    finally:
        stop_counting()
    return second, first and third and len(served) == 3


def all_to_all_with_and_without_split_sizes(rank, ws, seed):
    """Rank 0 calls all_to_all_single with even split sizes given, the others without; then
    every rank calls it without. Returns (what the first call raised or "returned", whether the
    second was right)."""
    x = torch.randn(ws * 40, generator=torch.Generator().manual_seed(seed + rank))
    out = torch.empty_like(x)
    try:
        dist.all_to_all_single(out, x, *([[40] * ws] * 2 if rank == 0 else []))
        first = "returned"
    except ValueError as err:
        first = str(err)
    dist.all_to_all_single(out, x)
    want = torch.cat([torch.randn(ws * 40, generator=torch.Generator().manual_seed(seed + s))[40 * rank:40 * rank + 40]
                      for s in range(ws)])
    return first, torch.equal(out, want)


def _broadcast_checked(xs, root):
    """A one-shot broadcast between other calls (they share mailboxes, call words and epoch)."""
    got = xs[dist.get_rank()].clone()
    dist.broadcast(got, src=root)
    assert torch.equal(got, xs[root]), "broadcast between other calls: wrong result"


def mismatched_all_reduce_then_one_that_matches(rank, ws, seed, n0, n):
    """Rank 0 all_reduces ``n0`` elements, the others ``n``; then every rank all_reduces 300.
    Returns what the first call raised and whether the second was right."""
    try:
        dist.all_reduce(torch.randn(n0 if rank == 0 else n))
        first = "returned"
    except ValueError as err:
        first = str(err)
    xs = _inputs(seed, ws, 300, torch.float32)
    ar = xs[rank].clone()
    dist.all_reduce(ar)
    return first, "right" if torch.allclose(ar, sum(xs), rtol=1e-5, atol=1e-5) else "wrong"


def twoshot_beside_oneshot(rank, ws, seed):
    """An all_reduce on a new group whose rank 0 serves it two-shot and the others one-shot
    (TDIST_ALGORITHM differs across ranks). Returns what the call raised, or "returned"."""
    from tests.common import new_group_with_env

    group = new_group_with_env("tdist", {"TDIST_ALGORITHM": "twoshot" if rank == 0 else "oneshot"})
    try:
        dist.all_reduce(_inputs(seed, ws, 1000, torch.float32)[rank], group=group)
        return "returned"
    except ValueError as err:
        return str(err)
    finally:
        dist.destroy_process_group(group)


def bulk_mismatched_then_refused(rank, ws):
    """Rank 0 gathers 100 elements, the others 200, on the bulk path; then every rank calls
    again. Returns what each call raised (type and message)."""
    outcomes = []
    for n in (100 if rank == 0 else 200, 8):
        try:
            all_gather_single(torch.empty(ws * n), torch.randn(n))
            outcomes.append(("returned", ""))
        except Exception as err:  # noqa: BLE001  (the test inspects it)
            outcomes.append((type(err).__name__, str(err)))
    return outcomes


def all_to_all_too_large_for_a_mailbox(rank, ws, seed, big):
    """Rank 0 sends rank 1 ``big`` float32 rows of 1 (more than a mailbox holds), every other
    pair 3 + sender + receiver rows; then an all_to_all_single of 5 rows a pair. Returns (what the
    first call raised or "returned", whether the rows it delivered were right, whether the second
    call was right)."""
    def rows(src, dst):
        return big if (src, dst) == (0, 1) else 3 + src + dst

    def data(src, tag):
        g = torch.Generator().manual_seed(seed * 7 + src * 3 + tag)
        return torch.randn(sum(rows(src, d) for d in range(ws)), 1, generator=g)

    x = data(rank, 0)
    out = torch.full((sum(rows(s, rank) for s in range(ws)), 1), float("nan"))
    try:
        dist.all_to_all_single(out, x, [rows(s, rank) for s in range(ws)], [rows(rank, d) for d in range(ws)])
        first = "returned"
    except ValueError as err:
        first = str(err)
    right, start = True, 0
    for s in range(ws):
        n = rows(s, rank)
        begin = sum(rows(s, d) for d in range(rank))
        if (s, rank) != (0, 1):  # the pair too large delivers nothing, the others everything
            right = right and torch.equal(out[start:start + n], data(s, 0)[begin:begin + n])
        start += n
    x = torch.randn(5 * ws, 1, generator=torch.Generator().manual_seed(seed + rank))
    out = torch.empty(5 * ws, 1)
    dist.all_to_all_single(out, x, [5] * ws, [5] * ws)
    want = torch.cat([torch.randn(5 * ws, 1, generator=torch.Generator().manual_seed(seed + s))[5 * rank:5 * rank + 5]
                      for s in range(ws)])
    return first, right, torch.equal(out, want)
