"""The main job: every collective through tdist, checked against an independent reference.

    python -m torch_tdist.demo --nproc 2

Starts ``--nproc`` local ranks (one GPU each when there are enough GPUs, the CPU otherwise),
runs each torch.distributed collective on a tdist group, compares every result with the same
computation done by plain torch ops on one process, and prints a table. Exit code 0 only if
every result matches.
"""

import argparse
import statistics
import sys
import time

from .launch import device_kind, run_local  # sets the NVLink-multicast safety variables first

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from .compat import all_gather_single, reduce_scatter_single  # noqa: E402

SIZES = (1000, 65536)
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
REPEATS = 5


def _inputs(seed, world, shape, dtype, device):
    """Every rank's input, generated identically on every rank (so each can compute references)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype).to(device))
        else:
            out.append(torch.randint(-1000, 1000, shape, generator=g).to(dtype).to(device))
    return out


def _close(a, b, dtype):
    if not dtype.is_floating_point:
        return torch.equal(a, b)
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _cases(rank, world, n, dtype, device, seed):
    """(op name, run(), expected, actual) for each collective at this size and dtype."""
    xs = _inputs(seed, world, (n,), dtype, device)
    x = xs[rank]
    chunk = n // world
    cases = []

    out = torch.empty(n * world, dtype=dtype, device=device)
    cases.append(("all_gather_into_tensor", lambda: all_gather_single(out, x),
                  torch.cat(xs), out))

    rs = torch.empty(chunk, dtype=dtype, device=device)
    cases.append(("reduce_scatter_tensor", lambda: reduce_scatter_single(rs, x[:chunk * world]),
                  sum(t[:chunk * world] for t in xs)[rank * chunk:(rank + 1) * chunk], rs))

    ar = x.clone()
    ar_ref = sum(xs[1:], xs[0].clone())
    cases.append(("all_reduce", lambda: (ar.copy_(x), dist.all_reduce(ar)), ar_ref, ar))

    splits = [[(i + 2 * j) % 3 * chunk // 2 for j in range(world)] for i in range(world)]
    a2a_in = xs[rank][:sum(splits[rank])]
    a2a_out = torch.empty(sum(splits[j][rank] for j in range(world)), dtype=dtype, device=device)
    a2a_ref = torch.cat([xs[j][sum(splits[j][:rank]):sum(splits[j][:rank + 1])] for j in range(world)])
    cases.append(("all_to_all_single", lambda: dist.all_to_all_single(
        a2a_out, a2a_in, [splits[j][rank] for j in range(world)], splits[rank]), a2a_ref, a2a_out))

    src = world - 1
    bc = x.clone()
    cases.append(("broadcast", lambda: (bc.copy_(x), dist.broadcast(bc, src)), xs[src], bc))

    red = x.clone()
    # only the destination's result is defined
    cases.append(("reduce", lambda: (red.copy_(x), dist.reduce(red, 0, op=dist.ReduceOp.MAX)),
                  torch.stack(xs).amax(0) if rank == 0 else red, red))

    scat = torch.empty(chunk, dtype=dtype, device=device)
    scat_in = [t[:chunk] for t in xs] if rank == src else None
    cases.append(("scatter", lambda: dist.scatter(scat, scat_in, src=src), xs[rank][:chunk], scat))

    gath = [torch.empty(n, dtype=dtype, device=device) for _ in range(world)] if rank == 0 else None
    cases.append(("gather", lambda: dist.gather(x, gath, dst=0),
                  torch.cat(xs) if rank == 0 else x, (lambda: torch.cat(gath) if rank == 0 else x)))
    return cases


def _rank_main(rank, world, device):
    import torch_tdist

    rows = []
    for seed, (n, dtype) in enumerate((n, d) for n in SIZES for d in DTYPES):
        for op, run, expected, actual in _cases(rank, world, n, dtype, device, seed):
            times, ok = [], True
            for _ in range(REPEATS):
                dist.barrier()
                start = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                got = actual() if callable(actual) else actual
                ok = ok and _close(got, expected, dtype)
            rows.append((op, str(dtype).replace("torch.", ""), n * dtype.itemsize, ok,
                         statistics.median(times) * 1e3))
    start = time.perf_counter()
    dist.barrier()
    rows.append(("barrier", "-", 0, True, (time.perf_counter() - start) * 1e3))
    return rows, torch_tdist.stats()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="number of local ranks")
    args = parser.parse_args(argv)
    world = args.nproc
    print(f"tdist demo: starting {world} ranks on {device_kind(world)}", flush=True)
    results = run_local(_rank_main, world)
    failed = [r for r, res in enumerate(results) if res is None]
    if failed:
        print(f"ranks {failed} failed", file=sys.stderr)
        return 1
    per_rank = [rows for rows, _ in results]
    stats = [s for _, s in results]
    print(f"{'op':<24}{'dtype':<10}{'bytes/rank':>12}  {'result':<8}{'ms (median)':>12}")
    all_ok = True
    for i, (op, dtype, nbytes, _, ms) in enumerate(per_rank[0]):
        ok = all(per_rank[r][i][3] for r in range(world))
        all_ok &= ok
        print(f"{op:<24}{dtype:<10}{nbytes:>12}  {'ok' if ok else 'MISMATCH':<8}{ms:>12.2f}")
    served = {op: c for op, c in stats[0].items() if c["tdist"] or c["fallback"]}
    print("calls on rank 0 (served by tdist kernels / handed to the fallback):")
    for op, c in served.items():
        print(f"  {op:<24}{c['tdist']:>6} / {c['fallback']}")
    print("all results match the reference" if all_ok else "SOME RESULTS DO NOT MATCH")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
