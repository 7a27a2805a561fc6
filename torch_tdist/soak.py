"""Soak: many random collectives, each checked against a reference, with leak accounting.

    python -m torch_tdist.soak --nproc 3 --steps 300 [--max-bytes 4M] [--seed 1]

Every rank draws the same sequence of calls from a shared seed (op, dtype, size from 1 byte
to ``--max-bytes``, the whole group or a subgroup, async or not; half the all-to-alls with
random split sizes, some of them 0), builds every rank's input
from per-rank seeds, runs the call and compares with plain torch ops. At the end it reports
mismatches, and whether heap usage, heap mappings and /dev/shm entries stayed flat. Exit code
0 only if nothing mismatched and nothing grew.
"""

import argparse
import math
import random
import sys
import time

from .launch import device_kind, run_local  # sets the NVLink-multicast safety variables first

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from .compat import all_gather_single, reduce_scatter_single  # noqa: E402
from .config import parse_size  # noqa: E402
from .heap import shm_segment_names  # noqa: E402
from .transports.shm import mapped_segments  # noqa: E402

OPS = ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_reduce",
       "all_to_all_single", "broadcast", "reduce", "scatter", "gather")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _tdist_mappings() -> int:
    return mapped_segments()


def _inputs(seed, ranks, numel, dtype, device):
    """Every rank's input (``numel`` elements, or ``numel[i]`` for the i-th of ``ranks``)."""
    out = []
    for i, r in enumerate(ranks):  # (generated where they are used: the same numbers on every rank)
        g = torch.Generator(device).manual_seed(seed * 7919 + r)
        n = numel[i] if isinstance(numel, list) else numel
        if dtype.is_floating_point:
            out.append(torch.randn(n, generator=g, device=device).to(dtype))
        else:
            high = 100 if dtype == torch.uint8 else 1000
            out.append(torch.randint(0, high, (n,), generator=g, device=device).to(dtype))
    return out


def _random_splits(rng, world, numel):
    """Rows sent between every pair of ranks (``counts[s][d]``: s to d, a fifth of them none) and
    the row length, about ``numel`` elements a rank in all: what MoE routing makes."""
    row = rng.choice((1, 3, 64))
    mean = max(1, numel // row // world)
    counts = [[0 if rng.random() < 0.2 else rng.randint(1, 2 * mean) for _ in range(world)] for _ in range(world)]
    return row, counts


def _reduce(xs, name):
    stacked = torch.stack([x.double() if x.dtype.is_floating_point else x for x in xs])
    result = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[name]
    return result.to(xs[0].dtype)


def _same(got, want, ranks: int) -> bool:
    if got.dtype.is_floating_point and got.dtype != torch.float32:
        # NCCL (which serves large GPU calls) sums half types in the type itself, rounding
        # after each of its steps: allow a rounding per rank
        tol = 2e-2 * max(1, ranks - 1)
        return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    if got.dtype.is_floating_point:
        return torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    return torch.equal(got, want)


def _step(rng, step, seed, groups, rank, device, max_bytes):
    """One random call; returns a description if it mismatched, else None."""
    members, group = rng.choice(groups)
    op = rng.choice(OPS)
    dtype = rng.choice(DTYPES)
    reduce_name = rng.choice(list(REDUCE_OPS))
    if dtype == torch.uint8 and op in ("reduce_scatter_tensor", "all_reduce", "reduce"):
        dtype = torch.int32  # uint8 is served for data movement only
    nbytes = int(math.exp(rng.uniform(0, math.log(max_bytes))))
    world = len(members)
    numel = max(world, nbytes // dtype.itemsize) // world * world
    root = rng.randrange(world)
    use_async = rng.random() < 0.3
    splits = _random_splits(rng, world, numel) if op == "all_to_all_single" and rng.random() < 0.5 else None
    if rank not in members:
        return None
    me = members.index(rank)
    chunk = numel // world
    if splits:
        row, counts = splits
        numel = [sum(sent) * row for sent in counts]
    xs = _inputs(seed * 100003 + step, members, numel, dtype, device)
    x = xs[me]
    global_root = members[root]
    if op == "all_gather_into_tensor":
        got = torch.empty(numel * world, dtype=dtype, device=device)
        work = all_gather_single(got, x, group=group, async_op=use_async)
        want = torch.cat(xs)
    elif op == "all_gather":
        outs = [torch.empty_like(x) for _ in range(world)]
        work = dist.all_gather(outs, x, group=group, async_op=use_async)
        got, want = outs, torch.cat(xs)
    elif op == "reduce_scatter_tensor":
        got = torch.empty(chunk, dtype=dtype, device=device)
        work = reduce_scatter_single(got, x, op=REDUCE_OPS[reduce_name], group=group, async_op=use_async)
        want = _reduce(xs, reduce_name)[me * chunk:(me + 1) * chunk]
    elif op == "all_reduce":
        got = x.clone()
        work = dist.all_reduce(got, op=REDUCE_OPS[reduce_name], group=group, async_op=use_async)
        want = _reduce(xs, reduce_name)
    elif op == "all_to_all_single" and splits:  # split sizes, as MoE dispatch gives them
        received = [counts[s][me] for s in range(world)]
        got = torch.empty(sum(received), row, dtype=dtype, device=device)
        work = dist.all_to_all_single(got, x.view(-1, row), received, counts[me], group=group, async_op=use_async)
        want = torch.cat([xs[s].view(-1, row)[sum(counts[s][:me]):sum(counts[s][:me + 1])] for s in range(world)])
    elif op == "all_to_all_single":
        got = torch.empty_like(x)
        work = dist.all_to_all_single(got, x, group=group, async_op=use_async)
        want = torch.cat([xs[p][me * chunk:(me + 1) * chunk] for p in range(world)])
    elif op == "broadcast":
        got = x.clone()
        work = dist.broadcast(got, global_root, group=group, async_op=use_async)
        want = xs[root]
    elif op == "reduce":
        got = x.clone()
        work = dist.reduce(got, global_root, op=REDUCE_OPS[reduce_name], group=group, async_op=use_async)
        want = _reduce(xs, reduce_name) if me == root else got
    elif op == "scatter":
        got = torch.empty(chunk, dtype=dtype, device=device)
        pieces = list(xs[root].split(chunk)) if me == root else None
        work = dist.scatter(got, pieces, global_root, group=group, async_op=use_async)
        want = xs[root][me * chunk:(me + 1) * chunk]
    else:  # gather
        outs = [torch.empty_like(x) for _ in range(world)] if me == root else None
        work = dist.gather(x, outs, global_root, group=group, async_op=use_async)
        got, want = (outs, torch.cat(xs)) if me == root else (x, x)
    if use_async:
        work.wait()
    if isinstance(got, list):
        got = torch.cat(got)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if _same(got, want, len(members)):
        return None
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    return (f"step {step}: {op} {dtype} {numel} elements on ranks {members} (async={use_async}) "
            f"mismatched, max abs diff {diff:.4g}")


def _soak_rank(rank, world, device, steps, seed, max_bytes):
    import warnings

    import torch_tdist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renaming of *_tensor ops
    groups = [(list(range(world)), None)]
    if world > 2:
        sub = list(range(world - 1))  # new_group is called by every rank, members or not
        groups.append((sub, dist.new_group(sub, backend="tdist")))
    for members, group in groups:  # heaps are created on first use: create them before counting
        if rank in members:
            dist.barrier(group=group)
    heaps = [torch_tdist.get_heap(g) for m, g in groups if rank in m]
    dist.barrier()  # every group's heap is set up (and its segment names gone) on every rank
    start = {"maps": _tdist_mappings(), "shm": len(shm_segment_names()), "heap": [h._top for h in heaps]}
    rng = random.Random(seed)
    mismatches, began = [], time.monotonic()
    for i in range(steps):
        problem = _step(rng, i, seed, groups, rank, device, max_bytes)
        if problem:
            mismatches.append(problem)
        if rank == 0 and (i + 1) % 1000 == 0:
            print(f"  {i + 1} steps, {len(mismatches)} mismatches, {time.monotonic() - began:.0f} s", flush=True)
    dist.barrier()
    return {"mismatches": mismatches,
            "maps_growth": _tdist_mappings() - start["maps"] if device.type == "cpu" else 0,
            "shm_growth": len(shm_segment_names()) - start["shm"],
            "heap_growth": sum(h._top for h in heaps) - sum(start["heap"]),
            "stats": torch_tdist.stats()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-bytes", default="4M")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    print(f"tdist soak: {args.steps} random collectives on {args.nproc} ranks "
          f"({device_kind(args.nproc)}), up to {args.max_bytes} per rank, seed {seed}", flush=True)
    results = run_local(_soak_rank, args.nproc, args.steps, seed, parse_size(args.max_bytes, "--max-bytes"))
    failed = [r for r, res in enumerate(results) if res is None]
    if failed:
        print(f"ranks {failed} failed", file=sys.stderr)
        return 1
    bad = False
    for rank, res in enumerate(results):
        grew = {k: res[k] for k in ("maps_growth", "shm_growth", "heap_growth") if res[k]}
        served = sum(c["tdist"] for c in res["stats"].values())
        fell_back = sum(c["fallback"] for c in res["stats"].values())
        print(f"rank {rank}: {len(res['mismatches'])} mismatches, growth {grew or 'none'}, "
              f"calls served by tdist {served}, by the fallback {fell_back}")
        for line in res["mismatches"][:5]:
            print("  " + line)
        bad |= bool(res["mismatches"] or grew)
    print("soak FAILED" if bad else "soak passed: every result matched, nothing grew")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
