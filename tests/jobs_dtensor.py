"""Jobs for test_dtensor.py: DTensor on a 1-D CPU mesh over the default group,
and functional collectives.  Each job returns (stats diff of the group, or None
when the backend is not tdist)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_tdist.compat import (funcol_all_gather, funcol_all_gather_coalesced, funcol_reduce_scatter,
                                 funcol_reduce_scatter_coalesced)

from tests.common import Checker, dt, poison, rand, rank_gen, ref_reduce, shared_gen, stats_diff, stats_snapshot


def _chunk(full, ws, rank, dim):
    """torch.chunk semantics (what DTensor's Shard uses), empty for ranks past the end."""
    chunks = list(torch.chunk(full, ws, dim=dim))
    if rank < len(chunks):
        return chunks[rank]
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_empty(shape)


def _local(x):
    """DTensor -> its local tensor as a plain, waited tensor."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    t = x.to_local() if hasattr(x, "to_local") else x
    if isinstance(t, AsyncCollectiveTensor):
        t = t.wait()
    return t


def dtensor_redistribute(rank, ws, dtype, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    chk = Checker(rank, f"dtensor[{dtype}]")
    d = dt(dtype)
    mesh = init_device_mesh("cpu", (ws,))
    group = mesh.get_group()
    before = stats_snapshot(group)

    # distribute_tensor scatters rank 0's tensor (src_data_rank=0): the other ranks
    # pass junk, so a result equal to `full` proves the data travelled.
    full = rand((4 * ws, 2 * ws + 1), d, shared_gen(seed, 1))
    mine = full.clone() if rank == 0 else poison(full.shape, d)
    x = distribute_tensor(mine, mesh, [Shard(0)])
    chk.equal(_local(x), _chunk(full, ws, rank, 0), "distribute_tensor Shard(0)")

    r = x.redistribute(mesh, [Replicate()])
    chk.equal(_local(r), full, "Shard(0) -> Replicate")

    s1 = x.redistribute(mesh, [Shard(1)])  # uneven along dim 1
    chk.equal(_local(s1), _chunk(full, ws, rank, 1), "Shard(0) -> Shard(1)")
    chk.equal(_local(s1.full_tensor()), full, "Shard(1).full_tensor()")
    chk.equal(_local(r.redistribute(mesh, [Shard(0)])), _chunk(full, ws, rank, 0), "Replicate -> Shard(0)")

    # uneven Shard(0) (2*ws + 1 rows)
    full2 = rand((2 * ws + 1, 5), d, shared_gen(seed, 2))
    mine2 = full2.clone() if rank == 0 else poison(full2.shape, d)
    y = distribute_tensor(mine2, mesh, [Shard(0)])
    chk.equal(_local(y), _chunk(full2, ws, rank, 0), "distribute_tensor uneven Shard(0)")
    chk.equal(_local(y.full_tensor()), full2, "uneven Shard(0).full_tensor()")

    # Replicate: broadcast from rank 0
    rep = distribute_tensor(mine2, mesh, [Replicate()])
    chk.equal(_local(rep), full2, "distribute_tensor Replicate")

    # Partial -> Replicate / Shard(0)
    parts = [rand((2 * ws, 6), d, rank_gen(seed, j, 3), "sum") for j in range(ws)]
    total = ref_reduce(parts, "SUM")
    p = DTensor.from_local(parts[rank], mesh, [Partial()])
    chk.close(_local(p.redistribute(mesh, [Replicate()])), total, "Partial(sum) -> Replicate")
    chk.close(_local(p.redistribute(mesh, [Shard(0)])), _chunk(total, ws, rank, 0), "Partial(sum) -> Shard(0)")
    chk.close(_local(p.full_tensor()), total, "Partial(sum).full_tensor()")

    parts = [rand((3, 5), d, rank_gen(seed, j, 4), "minmax") for j in range(ws)]
    pm = DTensor.from_local(parts[rank], mesh, [Partial("max")])
    chk.equal(_local(pm.redistribute(mesh, [Replicate()])), ref_reduce(parts, "MAX"), "Partial(max) -> Replicate")

    # a little compute on DTensors: sharded matmul against a replicated weight
    w = rand((2 * ws + 1, 3), d, shared_gen(seed, 5))
    wd = distribute_tensor(w.clone(), mesh, [Replicate()])
    out = torch.mm(x, wd)  # Shard(0) @ Replicate -> Shard(0)
    ref = torch.mm(full.double(), w.double()).to(d)
    chk.close(_local(out.full_tensor()), ref, "Shard(0) @ Replicate, full_tensor()")

    diff = stats_diff(before, stats_snapshot(group))
    chk.done()
    return diff


def functional_collectives(rank, ws, dtype, seed):
    import torch.distributed._functional_collectives as funcol

    chk = Checker(rank, f"functional collectives[{dtype}]")
    d = dt(dtype)
    group = dist.group.WORLD
    before = stats_snapshot(group)

    ins = [rand((3, 5), d, rank_gen(seed, j, 1)) for j in range(ws)]
    chk.equal(_local(funcol_all_gather(ins[rank], 0, group)), torch.cat(ins, 0), "all_gather_tensor dim 0")
    chk.equal(_local(funcol_all_gather(ins[rank], 1, group)), torch.cat(ins, 1), "all_gather_tensor dim 1")

    ins = [rand((2 * ws, 3), d, rank_gen(seed, j, 2), "sum") for j in range(ws)]
    tot = ref_reduce(ins, "SUM")
    chk.close(_local(funcol_reduce_scatter(ins[rank], "sum", 0, group)),
              tot[2 * rank:2 * rank + 2], "reduce_scatter_tensor sum dim 0")
    ins = [rand((3, 2 * ws), d, rank_gen(seed, j, 3), "sum") for j in range(ws)]
    chk.close(_local(funcol_reduce_scatter(ins[rank], "avg", 1, group)),
              ref_reduce(ins, "AVG")[:, 2 * rank:2 * rank + 2], "reduce_scatter_tensor avg dim 1", "AVG")

    ins = [rand((7, 3), d, rank_gen(seed, j, 4), "sum") for j in range(ws)]
    x = ins[rank].clone()
    chk.close(_local(funcol.all_reduce(x, "sum", group)), ref_reduce(ins, "SUM"), "all_reduce sum")
    chk.equal(x, ins[rank], "all_reduce (functional) modified its input")
    ins = [rand((9,), d, rank_gen(seed, j, 5), "minmax") for j in range(ws)]
    chk.equal(_local(funcol.all_reduce(ins[rank], "max", group)), ref_reduce(ins, "MAX"), "all_reduce max")

    g = shared_gen(seed, 6)
    S = torch.randint(0, 4, (ws, ws), generator=g)
    S[0, ws - 1] = 0
    ins = [rand((int(S[j].sum()), 2), d, rank_gen(seed, j, 6)) for j in range(ws)]
    parts = []
    for j in range(ws):
        off = int(S[j][:rank].sum())
        parts.append(ins[j][off:off + int(S[j][rank])])
    out = funcol.all_to_all_single(ins[rank], S[:, rank].tolist(), S[rank].tolist(), group)
    chk.equal(_local(out), torch.cat(parts), f"all_to_all_single uneven {S.tolist()}")
    ins = [rand((2 * ws, 3), d, rank_gen(seed, j, 7)) for j in range(ws)]
    out = funcol.all_to_all_single(ins[rank], None, None, group)
    chk.equal(_local(out), torch.cat([x[2 * rank:2 * rank + 2] for x in ins]), "all_to_all_single even")

    diff = stats_diff(before, stats_snapshot(group))
    chk.done()
    return diff


def coalesced_collectives(rank, ws, dtype, seed):
    """The functional *_coalesced ops (they reach the backend's
    allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced and
    allreduce_coalesced)."""
    import torch.distributed._functional_collectives as funcol

    chk = Checker(rank, f"coalesced[{dtype}]")
    d = dt(dtype)
    group = dist.group.WORLD
    before = stats_snapshot(group)

    shapes = [(3, 5), (7,), (2 * ws, 2)]
    ins = [[rand(s, d, rank_gen(seed, j, 10 + k)) for k, s in enumerate(shapes)] for j in range(ws)]
    outs = funcol_all_gather_coalesced(ins[rank], group)
    for k in range(len(shapes)):
        chk.equal(_local(outs[k]), torch.cat([ins[j][k] for j in range(ws)]), f"functional all_gather coalesced [{k}]")

    ins = [[rand((2 * ws, 3), d, rank_gen(seed, j, 20 + k), "sum") for k in range(2)] for j in range(ws)]
    outs = funcol_reduce_scatter_coalesced(ins[rank], "sum", [0, 0], group)
    for k in range(2):
        tot = ref_reduce([ins[j][k] for j in range(ws)], "SUM")
        chk.close(_local(outs[k]), tot[2 * rank:2 * rank + 2], f"functional reduce_scatter coalesced [{k}]")

    ins = [[rand(s, d, rank_gen(seed, j, 30 + k), "sum") for k, s in enumerate([(5,), (2, 3)])] for j in range(ws)]
    outs = funcol.all_reduce_coalesced([x.clone() for x in ins[rank]], "sum", group)
    for k in range(2):
        chk.close(_local(outs[k]), ref_reduce([ins[j][k] for j in range(ws)], "SUM"), f"functional all_reduce coalesced [{k}]")

    diff = stats_diff(before, stats_snapshot(group))
    chk.done()
    return diff


def fsdp2_step(rank, ws, seed, steps=2):
    """A small MLP under FSDP2 (fully_shard): forward, backward and SGD steps must
    match the same model trained on one process with the whole batch."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    chk = Checker(rank, "fsdp2")
    torch.manual_seed(seed)
    dims = [6, 10, 5, 3]  # odd sizes: uneven parameter shards

    def make():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(dims[0], dims[1]), nn.Tanh(), nn.Linear(dims[1], dims[2]), nn.Tanh(),
                             nn.Linear(dims[2], dims[3])).double()

    ref = make()
    model = make()
    mesh = init_device_mesh("cpu", (ws,))
    group = mesh.get_group()
    before = stats_snapshot(group)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = shared_gen(seed, 1)
    for step in range(steps):
        x = torch.randn(4 * ws, dims[0], generator=g, dtype=torch.float64)
        y = torch.randn(4 * ws, dims[-1], generator=g, dtype=torch.float64)
        # reference: the whole batch, mean loss
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        # FSDP: each rank its quarter of the batch; gradients are averaged over ranks
        opt.zero_grad()
        xs, ys = x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        chk.true(torch.allclose(_local(full).detach(), rp.detach(), rtol=1e-9, atol=1e-11), name,
                 f"parameter after {steps} steps differs from the single-process reference: "
                 f"max err {(_local(full).detach() - rp.detach()).abs().max().item():.3g}")
    diff = stats_diff(before, stats_snapshot(group))
    chk.done()
    return diff
