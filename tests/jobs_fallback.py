"""Jobs for test_fallback.py.  Each returns the torch_tdist.stats() diff of the
default group around the calls (None when the backend is not tdist)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests import jobs_collectives as JC
from tests.common import (Checker, poison, rand, rank_gen, ref_reduce, stats_diff, stats_snapshot)


def send_recv(rank, ws, seed):
    chk = Checker(rank, "send/recv")
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    before = stats_snapshot()
    # blocking ring: even ranks send first, odd ranks receive first (no deadlock for odd ws)
    data = [rand((2, 7), "float32", rank_gen(seed, r, 1)) for r in range(ws)]
    buf = poison((2, 7), torch.float32)
    if rank % 2 == 0:
        dist.send(data[rank], dst=nxt)
        dist.recv(buf, src=prv)
    else:
        dist.recv(buf, src=prv)
        dist.send(data[rank], dst=nxt)
    chk.equal(buf, data[prv], f"recv from {prv}")
    # non-blocking the other way round
    data = [rand((5,), "int64", rank_gen(seed, r, 2)) for r in range(ws)]
    buf = poison((5,), torch.int64)
    works = [dist.isend(data[rank], dst=prv), dist.irecv(buf, src=nxt)]
    for w in works:
        w.wait()
    chk.equal(buf, data[nxt], f"irecv from {nxt}")
    diff = stats_diff(before, stats_snapshot())
    chk.done()
    return diff


def int8_sum(rank, ws, seed):
    chk = Checker(rank, "all_reduce int8 SUM")
    before = stats_snapshot()
    ins = [rand((23,), "int8", rank_gen(seed, r, 3), "sum") for r in range(ws)]  # |x| <= 20
    t = ins[rank].clone()
    dist.all_reduce(t)
    chk.equal(t, ref_reduce(ins, "SUM"), "int8 SUM")
    diff = stats_diff(before, stats_snapshot())
    chk.done()
    return diff


def band_int32(rank, ws, seed):
    chk = Checker(rank, "all_reduce int32 BAND")
    before = stats_snapshot()
    ins = [rand((19,), "int32", rank_gen(seed, r, 4), "minmax") for r in range(ws)]
    t = ins[rank].clone()
    dist.all_reduce(t, op=dist.ReduceOp.BAND)
    chk.equal(t, ref_reduce(ins, "BAND"), "int32 BAND")
    diff = stats_diff(before, stats_snapshot())
    chk.done()
    return diff


# one float32 call of each collective, for the "served by tdist" checks
def _one_call(op, rank, ws, seed):
    f = {
        "all_gather_into_tensor": lambda: JC.async_ops(rank, ws, "float32", seed, "wait", ["all_gather_into_tensor"]),
        "all_gather": lambda: JC.async_ops(rank, ws, "float32", seed, "wait", ["all_gather"]),
        "reduce_scatter_tensor": lambda: JC.async_ops(rank, ws, "float32", seed, "wait", ["reduce_scatter_tensor"]),
        "all_reduce": lambda: JC.async_ops(rank, ws, "float32", seed, "wait", ["all_reduce"]),
        "all_to_all_single": lambda: JC.async_ops(rank, ws, "float32", seed, "wait", ["all_to_all_single"]),
        "broadcast": lambda: JC.async_ops(rank, ws, "float32", seed, "wait", ["broadcast"]),
        "barrier": lambda: dist.barrier(),
    }.get(op)
    if f is not None:
        f()
        return
    chk = Checker(rank, op)
    ins = [rand((6,), "float32", rank_gen(seed, r, 7), "sum") for r in range(ws)]
    root = ws - 1
    if op == "reduce_scatter":
        lists = [[rand((6,), "float32", rank_gen(seed, r, 10 + k), "sum") for k in range(ws)] for r in range(ws)]
        out = poison((6,), torch.float32)
        dist.reduce_scatter(out, lists[rank])
        chk.close(out, ref_reduce([lists[r][rank] for r in range(ws)], "SUM"), "reduce_scatter")
    elif op == "all_to_all":
        lists = [[rand((4,), "float32", rank_gen(seed, r, 10 + k)) for k in range(ws)] for r in range(ws)]
        outs = [poison((4,), torch.float32) for _ in range(ws)]
        dist.all_to_all(outs, lists[rank])
        for j in range(ws):
            chk.equal(outs[j], lists[j][rank], f"all_to_all output[{j}]")
    elif op == "scatter":
        out = poison((6,), torch.float32)
        dist.scatter(out, ins if rank == root else None, src=root)
        chk.equal(out, ins[rank], "scatter")
    elif op == "gather":
        outs = [poison((6,), torch.float32) for _ in range(ws)] if rank == root else None
        dist.gather(ins[rank], outs, dst=root)
        if rank == root:
            for j in range(ws):
                chk.equal(outs[j], ins[j], f"gather output[{j}]")
    elif op == "reduce":
        t = ins[rank].clone()
        dist.reduce(t, dst=root)
        if rank == root:
            chk.close(t, ref_reduce(ins, "SUM"), "reduce")
    else:
        raise ValueError(op)
    chk.done()


def served_by_tdist(rank, ws, op, seed):
    before = stats_snapshot()
    _one_call(op, rank, ws, seed)
    return stats_diff(before, stats_snapshot())
