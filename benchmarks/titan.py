"""torchtitan (0.2.2) on 4 GPUs through torch_tdist.titan: tdist against NCCL, one torchrun each.

    python3 benchmarks/titan.py bench [--nproc 4] [--flavor 8B_4L] [--seq 8192] [--steps 20] [--out DIR]
    python3 benchmarks/titan.py loss  [--nproc 4] [--steps 50] [--out DIR]

bench: an 8B-shaped llama3 with fewer layers, TP over every GPU, bf16, compiled, three
configurations one after another: NCCL without async TP, NCCL with torch's async TP, tdist with
async TP. Tokens/s is the TP group's (tokens of a step over the step's time), the median over the
steps after the first WARMUP (compiling, tuning); writes ``titan_<machine>.json``.

loss: the llama3 debug model, TP over every GPU, compile + async TP, the same seed, on NCCL and on
tdist (its overlapped ops forced, TDIST_OVERLAP=pipelined, so the fused regions provably run
them: the ranks print the counts); the loss of every step must agree within LOSS_TOLERANCE
(relative); writes ``titan_loss_<machine>.json``. Exits non-zero if they do not.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import statistics
import subprocess
import sys

from timing import versions, write_result  # (importing it sets the safety variables the jobs inherit)

WARMUP = 5
LOSS_TOLERANCE = 1e-2
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+).*?tps:\s*([\d,]+)")
STATS_LINE = re.compile(r"\[torch_tdist\.titan\] rank 0: (.*)")

BENCH_CONFIGS = {  # name: (backend, async TP)
    "nccl": ("nccl", False),
    "nccl_async_tp": ("nccl", True),
    "tdist_async_tp": ("tdist", True),
}


def run_titan(backend: str, async_tp: bool, flags: list[str], nproc: int, log_path: str, env: dict | None = None):
    """One torchtitan job; returns (steps {step: (loss, tps)}, rank 0's tdist stats line, exit code)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "torch_tdist.titan", "--backend", backend,
               "--parallelism.tensor_parallel_degree", str(nproc), "--parallelism.data_parallel_shard_degree", "1",
               "--compile.enable", "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1",
               "--metrics.disable_color_printing", "--checkpoint.no-enable", "--training.dataset", "synthetic",
               "--debug.seed", "42", "--comm.trace_buf_size", "0", "--job.dump_folder", f"/tmp/titan_{backend}",
               "--parallelism.enable_async_tensor_parallel" if async_tp else "--parallelism.no-enable_async_tensor_parallel",
               *flags]
    full_env = {**os.environ, "TDIST_TITAN_STATS": "1", **(env or {})}
    with open(log_path, "w") as log:
        code = subprocess.run(command, env=full_env, stdout=log, stderr=subprocess.STDOUT, timeout=560).returncode
    steps, stats = {}, None
    for line in open(log_path, errors="replace"):
        found = STEP_LINE.search(line)
        if found:
            steps[int(found[1])] = (float(found[2]), int(found[3].replace(",", "")))
        found = STATS_LINE.search(line)
        if found:
            stats = found[1]
    return steps, stats, code


def _versions() -> dict:
    return {**versions(), "torchtitan": importlib.metadata.version("torchtitan")}


def bench(args):
    flags = ["--model.flavor", args.flavor, "--training.seq_len", str(args.seq), "--training.local_batch_size", "1",
             "--training.steps", str(args.steps), "--training.dtype", "bfloat16", "--optimizer.lr", "1e-4",
             "--lr_scheduler.warmup_steps", "2"]
    rows = []
    for name, (backend, async_tp) in BENCH_CONFIGS.items():
        if args.only and name not in args.only.split(","):
            continue
        steps, stats, code = run_titan(backend, async_tp, flags, args.nproc, os.path.join(args.out, f"titan_{name}.log"))
        timed = [tps for step, (_, tps) in sorted(steps.items()) if step > WARMUP]
        if code or not timed:
            print(f"{name}: exit code {code}, {len(steps)} steps logged; see titan_{name}.log", flush=True)
            rows.append({"config": name, "error": f"exit code {code}"})
            continue
        per_device = statistics.median(timed)  # torchtitan's tps: tokens / (step time x TP degree)
        step_ms = 1e3 * args.seq / (per_device * args.nproc)
        row = {"config": name, "tokens_per_s": round(args.seq / step_ms * 1e3, 1), "step_ms": round(step_ms, 1),
               "final_loss": steps[max(steps)][0], "steps_timed": len(timed), "tdist_stats": stats}
        rows.append(row)
        print(row, flush=True)
    by_name = {r["config"]: r for r in rows if "tokens_per_s" in r}
    ratios = {}
    if "tdist_async_tp" in by_name:
        for base in ("nccl", "nccl_async_tp"):
            if base in by_name:
                ratios[f"tdist_async_tp_over_{base}"] = round(
                    by_name["tdist_async_tp"]["tokens_per_s"] / by_name[base]["tokens_per_s"], 3)
    print("ratios", ratios, flush=True)
    write_result(args.out, "titan", args.nproc, rows=rows, versions=_versions(), ratios=ratios,
                 method=(f"torchtitan 0.2.2 llama3 {args.flavor}, TP={args.nproc}, seq {args.seq}, local batch 1, "
                         f"bf16, compiled, {args.steps} steps; tokens/s of the TP group = seq / median step time "
                         f"over steps after {WARMUP}; configurations run one after another in one device call"))


def loss(args):
    flags = ["--model.flavor", "debugmodel", "--training.seq_len", "2048", "--training.local_batch_size", "8",
             "--training.steps", str(args.steps), "--debug.deterministic", "--debug.deterministic_warn_only"]
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    runs = {}
    for backend, extra in (("nccl", {}), ("tdist", {"TDIST_OVERLAP": "pipelined"})):
        runs[backend] = run_titan(backend, True, flags, args.nproc, os.path.join(args.out, f"titan_loss_{backend}.log"),
                                  {**env, **extra})
        print(f"{backend}: exit code {runs[backend][2]}, {len(runs[backend][0])} steps, tdist: {runs[backend][1]}",
              flush=True)
    (nccl, _, nccl_code), (tdist, stats, tdist_code) = runs["nccl"], runs["tdist"]
    steps = sorted(set(nccl) & set(tdist))
    rows = [{"step": s, "nccl_loss": nccl[s][0], "tdist_loss": tdist[s][0],
             "relative_difference": abs(tdist[s][0] - nccl[s][0]) / abs(nccl[s][0])} for s in steps]
    worst = max((r["relative_difference"] for r in rows), default=float("inf"))
    ok = not nccl_code and not tdist_code and len(steps) == args.steps and worst <= LOSS_TOLERANCE
    print(f"loss curves: {len(steps)} steps compared, largest relative difference {worst:.3g} "
          f"(tolerance {LOSS_TOLERANCE}): {'match' if ok else 'MISMATCH'}", flush=True)
    write_result(args.out, "titan_loss", args.nproc, rows=rows, versions=_versions(),
                 largest_relative_difference=worst, tolerance=LOSS_TOLERANCE, match=ok, tdist_stats=stats,
                 method=(f"torchtitan 0.2.2 llama3 debugmodel, TP={args.nproc}, compile + async TP, seed 42, "
                         f"deterministic, {args.steps} steps, NCCL then tdist (TDIST_OVERLAP=pipelined)"))
    sys.exit(0 if ok else 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("bench", "loss"))
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--flavor", default="8B_4L")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only", default="", help="bench: comma-separated configurations")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    args.steps = args.steps or (20 if args.mode == "bench" else 50)
    os.makedirs(args.out, exist_ok=True)
    (bench if args.mode == "bench" else loss)(args)


if __name__ == "__main__":
    main()
