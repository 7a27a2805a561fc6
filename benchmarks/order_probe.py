"""Does an overlap variant's time depend on what the GPU ran just before it? overlap.py times every
variant in one fixed order, so each always follows the same neighbour; if a heavy neighbour leaves
the GPU's clocks lower (its power limit), the variant after it pays. Here each variant's 40-call
loop is timed after each of several predecessors (an idle half second, or a 40-call loop of
another variant), in blocks of 10 calls, with the SM clock and power read by nvidia-smi beside.
With --series S, each variant instead runs for S seconds after an idle half second, timed in
blocks of about 30 ms: how long until its time per call settles, and where.

    torchrun --nproc-per-node 4 benchmarks/order_probe.py --out $OUT [--series 2]

ORDER_POWER_FIELD names nvidia-smi's power field (power.draw, a one-second average on these GPUs,
by default; results/order_probe_clocks_*-series.csv has power.draw.instant).
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

import torch_tdist  # noqa: F401  (registers the "tdist" backend)
from overlap import _calls, _operands
from timing import machine, start_job, versions

POWER = os.environ.get("ORDER_POWER_FIELD", "power.draw")
SHAPES = "ag_gemm:8192x8192x28672,gemm_rs:8192x28672x8192,ag_gemm:8192x4096x12288"


def blocks_us(fn, iters: int, block: int, cpu_group) -> list[float]:
    """Microseconds per call in each block of ``block`` calls of one back-to-back loop (the
    slowest rank's), started as benchmarks/timing.time_loop starts its loops."""
    torch.cuda.synchronize()
    dist.barrier(group=cpu_group)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(iters // block + 1)]
    marks[0].record()
    for i in range(iters):
        fn()
        if (i + 1) % block == 0:
            marks[(i + 1) // block].record()
    marks[-1].synchronize()
    per = torch.tensor([marks[j].elapsed_time(marks[j + 1]) * 1e3 / block for j in range(len(marks) - 1)],
                       dtype=torch.float64)
    dist.all_reduce(per, op=dist.ReduceOp.MAX, group=cpu_group)
    return [round(v, 1) for v in per.tolist()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES, help="op:MxNxK,...")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--series", type=float, default=0.0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rank, world, device = start_job()
    os.environ["TDIST_OVERLAP"] = "tune"
    tdist_group = dist.new_group(backend="tdist")
    cpu_group = dist.new_group(backend="gloo")
    symm_group_name = dist.group.WORLD.group_name
    from torch.distributed import _symmetric_memory
    _symmetric_memory.enable_symm_mem_for_group(symm_group_name)
    smi = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        clocks = os.path.join(args.out, f"order_probe_clocks_{machine(world)}{'-series' if args.series else ''}.csv")
        with open(clocks, "w") as log:  # (nvidia-smi keeps its own copy of the file)
            smi = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu=timestamp,index,clocks.sm,{POWER},temperature.gpu",
                 "--format=csv,noheader", "-lms", "50"], stdout=log, stderr=subprocess.STDOUT)
    gen = torch.Generator(device).manual_seed(99 + rank)
    rows = []
    for item in args.shapes.split(","):
        op, shape = item.split(":")
        m, n, k = (int(v) for v in shape.split("x"))
        a, b = _operands(op, m, n, k, world, device, gen)
        calls = _calls(op, a, b, world, tdist_group, tdist_group, tdist_group, symm_group_name)
        timed = {name: calls[name] for name in ("tdist", "symm_mem", "matmul")}
        for fn in list(timed.values()) + [calls["collective"]]:
            for _ in range(3):
                fn()
        if args.series:
            for name, fn in timed.items():
                torch.cuda.synchronize()
                dist.barrier(group=cpu_group)
                time.sleep(0.5)
                one = blocks_us(fn, 10, 10, cpu_group)[0]
                block = max(1, round(30_000 / one))
                started = time.time()
                series = blocks_us(fn, block * max(1, round(args.series * 1e6 / (one * block))), block, cpu_group)
                rows.append({"op": op, "shape": shape, "variant": name, "started": started, "block_calls": block,
                             "series_us": series})
                if rank == 0:
                    print(f"{op} {shape} {name:<8} blocks of {block}: {series}", flush=True)
            continue
        predecessors = {
            "idle": lambda: time.sleep(0.5),
            "collective": lambda: blocks_us(calls["collective"], 40, 40, cpu_group),
            "matmul": lambda: blocks_us(calls["matmul"], 40, 40, cpu_group),
            "symm_mem": lambda: blocks_us(calls["symm_mem"], 40, 40, cpu_group),
            "tdist": lambda: blocks_us(calls["tdist"], 40, 40, cpu_group),
        }
        for rep in range(args.reps):
            for before, run_before in predecessors.items():
                for name, fn in timed.items():
                    torch.cuda.synchronize()
                    run_before()
                    started = time.time()
                    blocks = blocks_us(fn, 40, 10, cpu_group)
                    rows.append({"op": op, "shape": shape, "rep": rep, "after": before, "variant": name,
                                 "started": started, "blocks_us": blocks, "mean_us": round(statistics.mean(blocks), 1)})
                    if rank == 0:
                        print(f"{op} {shape} rep {rep} after {before:<10} {name:<8} {rows[-1]['mean_us']:>8.1f} us  blocks {blocks}",
                              flush=True)
    if rank == 0:
        smi.terminate()
    if rank == 0 and not args.series:
        summary = {}
        for r in rows:
            summary.setdefault((r["op"], r["shape"], r["variant"], r["after"]), []).append(r["mean_us"])
        print("median over reps, us per call (40-call loop):")
        for (op, shape, variant, after), values in summary.items():
            print(f"  {op} {shape} {variant:<8} after {after:<10} {statistics.median(values):8.1f}  {values}")
    if rank == 0:
        path = os.path.join(args.out, f"order_probe_{machine(world)}{'-series' if args.series else ''}.json")
        with open(path, "w") as f:
            method = (f"each variant run {args.series:g} s after an idle half second, timed in blocks of about 30 ms"
                      if args.series else
                      f"each variant's 40-call loop after each predecessor, in blocks of 10 calls, {args.reps} reps")
            json.dump({"machine": machine(world), "versions": versions(), "method": f"bf16, slowest rank; {method}",
                       "rows": rows}, f, indent=1)
        print("wrote", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
