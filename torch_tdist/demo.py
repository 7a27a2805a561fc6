"""The main job: every collective through tdist, checked against an independent reference.

    python -m torch_tdist.demo --nproc 2

Starts ``--nproc`` local ranks (one GPU each when there are enough GPUs, the CPU otherwise),
runs each torch.distributed collective on a tdist group, compares every result with the same
computation done by plain torch ops on one process, and prints a table. Exit code 0 only if
every result matches.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "TDIST_GPU_KERNELS": "1"}  # the demo runs tdist's own kernels on GPUs too
for _key, _value in SAFE_ENV.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

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
    cases.append(("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, x),
                  torch.cat(xs), out))

    rs = torch.empty(chunk, dtype=dtype, device=device)
    cases.append(("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(rs, x[:chunk * world]),
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


def _rank_main(rank, world, store_path, device_kind, results):
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    import torch_tdist  # noqa: F401  (registers the backend)

    store = dist.FileStore(store_path, world)
    dist.init_process_group("tdist", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    device = torch.device(device_kind, rank) if device_kind == "cuda" else torch.device("cpu")
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
    results.put((rank, (rows, torch_tdist.stats())))
    dist.destroy_process_group()


def _join_or_stop_all(procs):
    """Wait for every rank; once one fails, stop the others (they would wait for it)."""
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
        time.sleep(0.2)
    for p in procs:
        p.join()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="number of local ranks")
    args = parser.parse_args(argv)
    world = args.nproc
    device_kind = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"
    print(f"tdist demo: starting {world} ranks on {device_kind}", flush=True)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, world, store_path, device_kind, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        _join_or_stop_all(procs)
        failed_procs = [r for r, p in enumerate(procs) if p.exitcode != 0]
        per_rank = dict(results.get() for _ in range(world - len(failed_procs)))
        stats = {r: per_rank[r][1] for r in per_rank}
        per_rank = {r: per_rank[r][0] for r in per_rank}
    if failed_procs:
        print(f"ranks {failed_procs} failed", file=sys.stderr)
        return 1
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
