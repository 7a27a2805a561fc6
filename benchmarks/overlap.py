"""torch_tdist.ops against NCCL + torch.matmul and torch's symm_mem fused ops, side by side.

    torchrun --nproc-per-node 4 benchmarks/overlap.py [--shapes 8192x4096x12288,...] [--out DIR]

Shapes are ``MxNxK`` (DESIGN.md's convention). AG-GEMM: A [M, K] row-sharded, B [K, N/ws] per
rank, output [M, N/ws]. GEMM-RS: A [M, K/ws], B [K/ws, N] per rank, output [M/ws, N]. bf16. For
each shape and op, in one job: tdist as users get it (the overlap policy ``tune``; ``path`` is what its
tuning chose: "sequential", "pipelined <chunks>" or "fused <config>", from the times per call in
``tuning_us``), tdist's fused kernels with the first tile config (``fused_us``), the pipelined way
with its default chunks (``pipelined_us``), the sequential path (NCCL collective, then
torch.matmul, or the reverse), ``torch.ops.symm_mem``'s fused op, the matmul alone and the
collective alone.

Timing. Each variant is timed with CUDA events around ``--iters`` calls back to back (the slowest
rank's), after ``--warmup`` calls. 40 calls, because the first call's host time (before the GPU
has work) counts once per loop: at 10 calls it added 15-30 us to each call of tdist's pipelined
ways (150-300 us of host time a call on the H200 machines' hosts, against 3-10 us for NCCL + matmul).

Each timed loop comes right after ``--preheat-ms`` of the same variant's calls. These H200s hold
their 700 W power limit by lowering the SM clock (1980 MHz idle, about 1450 MHz after some 150 ms
of a large matmul), so a short loop's time follows whatever ran before it: 1412 to 1791 us for
one ag_gemm shape by its predecessor. Pre-heated, every variant is
timed in its own sustained state, as in training.

``--rounds`` rounds time every variant in turn (one loop each), so that a slow moment of the
machine hits all of them. ``<name>_us`` is the median round, ``<name>_rounds_us`` every round's
(their spread is the noise), ``<name>_host_us`` the host time per call in the same loops (where it
reaches the GPU time, the call is host-bound). Rank 0 writes ``overlap_<machine>.json``;
``python benchmarks/plot.py <json>`` draws the speedups.
"""

import argparse
import math
import os
import statistics
import time

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tdist  # noqa: E402
from torch_tdist.compat import all_gather_single, reduce_scatter_single  # noqa: E402
from timing import in_turn, slowest, start_job, symm_mem_group, time_loop, write_result  # noqa: E402

# DESIGN.md's seed shapes, then Triton-distributed's LLaMA-3.1-8B, LLaMA-3.1-70B and Qwen2-72B
SHAPES = ("8192x4096x12288,8192x4096x14336,8192x3584x14336,8192x4608x36864,8192x8192x28672,"
          "8192x8192x30720,8192x14336x4096,8192x28672x8192,8192x29568x8192")


def _operands(op, m, n, k, world, device, gen):
    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=torch.bfloat16)
    if op == "ag_gemm":
        return rand(m // world, k), rand(k, n // world)
    return rand(m, k // world), rand(k // world, n)


def _calls(op, a, b, world, tdist_group, fused_group, pipelined_group, symm_group_name):
    """name -> a function making one call of that variant."""
    if op == "ag_gemm":
        gathered = torch.empty(world * a.shape[0], a.shape[1], device=a.device, dtype=a.dtype)

        def collective():
            all_gather_single(gathered, a)

        def sequential():
            collective()
            return gathered @ b
        return {"tdist": lambda: torch_tdist.ops.all_gather_matmul(a, b, group=tdist_group),
                "fused": lambda: torch_tdist.ops.all_gather_matmul(a, b, group=fused_group),
                "pipelined": lambda: torch_tdist.ops.all_gather_matmul(a, b, group=pipelined_group),
                "sequential": sequential, "matmul": lambda: gathered @ b, "collective": collective,
                "symm_mem": lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                    a, [b], gather_dim=0, group_name=symm_group_name)}
    product = a @ b
    scattered = torch.empty(product.shape[0] // world, product.shape[1], device=a.device, dtype=a.dtype)

    def collective():
        reduce_scatter_single(scattered, product)

    def sequential():
        reduce_scatter_single(scattered, a @ b)
        return scattered
    return {"tdist": lambda: torch_tdist.ops.matmul_reduce_scatter(a, b, group=tdist_group),
            "fused": lambda: torch_tdist.ops.matmul_reduce_scatter(a, b, group=fused_group),
            "pipelined": lambda: torch_tdist.ops.matmul_reduce_scatter(a, b, group=pipelined_group),
            "sequential": sequential, "matmul": lambda: a @ b, "collective": collective,
            "symm_mem": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
                a, b, "sum", scatter_dim=0, group_name=symm_group_name)}


def _preheated_loop(fn, preheat: int, iters: int, cpu_group) -> tuple[float, float]:
    for _ in range(preheat):
        fn()
    return time_loop(fn, iters, cpu_group, reps=1)


def _relative_error(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES, help="MxNxK,...")
    parser.add_argument("--ops", default="ag_gemm,gemm_rs")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--preheat-ms", type=float, default=300.0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    rank, world, device = start_job()
    tdist_group = dist.new_group(backend="tdist", pg_options={"overlap": "tune"})
    fused_group = dist.new_group(backend="tdist", pg_options={"overlap": "fused"})
    pipelined_group = dist.new_group(backend="tdist", pg_options={"overlap": "pipelined"})
    cpu_group = dist.new_group(backend="gloo")
    symm_group_name = symm_mem_group()
    tuning = torch_tdist.overlap.state(tdist_group).tuning
    gen = torch.Generator(device).manual_seed(1234 + rank)
    rows = []
    for op in args.ops.split(","):
        for shape in args.shapes.split(","):
            m, n, k = (int(v) for v in shape.split("x"))
            a, b = _operands(op, m, n, k, world, device, gen)
            calls = _calls(op, a, b, world, tdist_group, fused_group, pipelined_group, symm_group_name)
            want = calls["sequential"]().clone()
            fused_out, pipelined_out = calls["fused"](), calls["pipelined"]()
            error = _relative_error(fused_out, want)
            by_shard = [round(_relative_error(f, w), 5) for f, w in zip(fused_out.chunk(world), want.chunk(world))]
            tuned_before = dict(tuning.tuned)
            calls["tdist"]()  # tunes this shape class
            new_key = next((key for key in tuning.tuned if key not in tuned_before), None)
            path = tuning.tuned[new_key] if new_key else "tuned before"
            row = {"op": op, "M": m, "N": n, "K": k, "world_size": world, "path": path,
                   "tuning_us": tuning.tuning_us.get(new_key),
                   "relative_error": round(error, 5), "relative_error_by_shard": by_shard,
                   "pipelined_relative_error": round(_relative_error(pipelined_out, want), 5)}
            timers = {}
            for name, fn in calls.items():
                try:
                    for _ in range(args.warmup):
                        fn()
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    seconds = slowest((time.perf_counter() - started) / 3, cpu_group)
                    preheat = math.ceil(args.preheat_ms / 1e3 / seconds)  # (the same on every rank)
                    timers[name] = lambda fn=fn, preheat=preheat: _preheated_loop(fn, preheat, args.iters, cpu_group)
                except Exception as err:  # noqa: BLE001 - symm_mem may be missing on this build
                    row[f"{name}_us"] = None
                    row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:200]
            for name, loops in in_turn(timers, args.rounds).items():
                row[f"{name}_us"] = round(statistics.median(gpu for gpu, _ in loops), 1)
                row[f"{name}_host_us"] = round(statistics.median(host for _, host in loops), 1)
                row[f"{name}_rounds_us"] = [round(gpu, 1) for gpu, _ in loops]
            rows.append(row)
            if rank == 0:
                ratio = row["sequential_us"] / row["tdist_us"]
                symm = row.get("symm_mem_us")
                print(f"{op} {shape:<18} {path:<10} tdist {row['tdist_us']:>8.1f} us (host {row['tdist_host_us']}) sequential "
                      f"{row['sequential_us']:>8.1f} ({ratio:4.2f}x)  pipelined {row['pipelined_us']} (host "
                      f"{row['pipelined_host_us']})  fused "
                      f"{row['fused_us']}  symm_mem {symm}  matmul "
                      f"{row['matmul_us']:>8.1f}  collective {row['collective_us']:>8.1f}  err {error:.1e} {by_shard}",
                      flush=True)
            del a, b, calls
            torch.cuda.empty_cache()
    if rank == 0:
        write_result(args.out, "overlap", world,
                     f"bf16, slowest rank, tdist's ways chosen by the policy tune; "
                     f"{args.iters} calls back to back per timed loop (CUDA events), {args.warmup} warm-ups, "
                     f"each loop right after {args.preheat_ms:g} ms of the same variant's calls, "
                     f"median of {args.rounds} rounds, each timing every variant in turn; relative_error (by_shard: per rank's rows): "
                     f"tdist's fused kernels, pipelined_relative_error: the pipelined way, against the sequential path", rows, heap_size=os.environ.get("TDIST_HEAP_SIZE"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
