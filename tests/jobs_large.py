"""Jobs for test_large.py: messages larger than the staging area, run in several rounds."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, torch.cat(xs)), "all_gather_into_tensor: wrong result"

    wide = _inputs(seed + 1, ws, ws * n, dtype)
    rs = torch.full((n,), float("nan"), dtype=dtype)
    dist.reduce_scatter_tensor(rs, wide[rank])
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
