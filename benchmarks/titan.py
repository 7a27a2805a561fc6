"""torchtitan (0.2.2) on 4 GPUs through torch_tdist.titan: tdist against NCCL, one torchrun each.

    python3 benchmarks/titan.py bench [--nproc 4] [--flavor 8B_4L] [--seq 8192] [--steps 40] [--repeat 1] [--out DIR]
    python3 benchmarks/titan.py loss  [--nproc 4] [--steps 50] [--out DIR]
    python3 benchmarks/titan.py profile [--nproc 4] [--flavor 8B_4L] [--seq 8192] [--only nccl,...] [--out DIR]
    (bench and profile: --tdist-env K=V sets an environment variable for the tdist runs)

bench: an 8B-shaped llama3 with fewer layers, TP over every GPU, bf16, compiled, the
configurations one after another: NCCL without async TP, NCCL with torch's async TP, tdist
without and with async TP, and ``bound``: tdist with every collective returning at once
(``torch_tdist.titan --no-communication``: the step time with free communication, wrong values).
``recovered``: the part of the gap between NCCL and the bound that tdist's async TP closes,
(NCCL's step time - tdist's) / (NCCL's - the bound's). Tokens/s is the TP group's (tokens of
a step over the step's time), the median over torchtitan's log windows (BENCH_LOG_FREQ steps,
its default: it syncs the host at each logged step) after the first WARMUP steps (compiling,
tuning); writes ``titan_<machine>.json``.

loss: the llama3 debug model, TP over every GPU, compile + async TP, the same seed, on NCCL and on
tdist (its overlapped ops forced, TDIST_OVERLAP=pipelined, so the fused regions provably run
them: the ranks print the counts); the loss of every step must agree within LOSS_TOLERANCE
(relative); writes ``titan_loss_<machine>.json``. Exits non-zero if they do not.

profile: the bench's model, each configuration's step PROFILED_STEP under torch's profiler, broken
down from the ranks' traces (``kernel_breakdown``): where rank 0's GPU time goes, how much of its
communication no computation overlaps, and how much of that is waiting for the last rank rather
than moving data; writes ``titan_profile_<machine>.json``. (The profiler slows the host: the
step times here are not the bench's.)
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

from timing import versions, write_result  # (importing it sets the safety variables the jobs inherit)

WARMUP = 10  # bench: steps left out (compiling, tuning)
BENCH_LOG_FREQ = 10  # bench: torchtitan's default; it syncs the host with the GPU at every logged step
assert WARMUP % BENCH_LOG_FREQ == 0, "a log window must not straddle the warm-up"
LOSS_TOLERANCE = 1e-2
PROFILED_STEP = 10  # profile: the step traced
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+).*?tps:\s*([\d,]+)")
STATS_LINE = re.compile(r"\[torch_tdist\.titan\] rank 0: (.*)")

BENCH_CONFIGS = {  # name: (backend, async TP, the launcher's flags)
    "nccl": ("nccl", False, []),
    "nccl_async_tp": ("nccl", True, []),
    "tdist": ("tdist", False, []),  # (tdist's collectives alone, for diagnosis)
    "tdist_async_tp": ("tdist", True, []),
    "bound": ("tdist", False, ["--no-communication"]),
}


def run_titan(backend: str, async_tp: bool, flags: list[str], nproc: int, log_path: str, env: dict | None = None,
              log_freq: int = 1, launcher_flags: list[str] = ()):
    """One torchtitan job; returns (steps {logged step: (loss, tps over the steps since the last
    logged one)}, rank 0's tdist stats line, exit code)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "torch_tdist.titan", "--backend", backend, "--stats", *launcher_flags,
               "--parallelism.tensor_parallel_degree", str(nproc), "--parallelism.data_parallel_shard_degree", "1",
               "--compile.enable", "--activation_checkpoint.mode", "none", "--metrics.log_freq", str(log_freq),
               "--metrics.disable_color_printing", "--checkpoint.no-enable", "--training.dataset", "synthetic",
               "--debug.seed", "42", "--comm.trace_buf_size", "0", "--job.dump_folder", f"/tmp/titan_{backend}",
               "--parallelism.enable_async_tensor_parallel" if async_tp else "--parallelism.no-enable_async_tensor_parallel",
               *flags]
    full_env = {**os.environ, **(env or {})}
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


def _model_flags(args, steps: int) -> list[str]:
    """The bench's and the profile's model: args.flavor at args.seq, batch 1, bf16."""
    return ["--model.flavor", args.flavor, "--training.seq_len", str(args.seq), "--training.local_batch_size", "1",
            "--training.steps", str(steps), "--training.dtype", "bfloat16", "--optimizer.lr", "1e-4",
            "--lr_scheduler.warmup_steps", "2"]


def _configs(args) -> list[str]:
    """The BENCH_CONFIGS names --only keeps (all without it)."""
    return [n for n in BENCH_CONFIGS if not args.only or n in args.only.split(",")]


def _env(args, name: str) -> dict:
    """The configuration's environment: the --tdist-env settings (K=V), for tdist's runs."""
    backend, _, _ = BENCH_CONFIGS[name]
    return dict(kv.split("=", 1) for kv in args.tdist_env) if backend == "tdist" else {}


def _versions() -> dict:
    return {**versions(), "torchtitan": importlib.metadata.version("torchtitan")}


def bench(args):
    flags = _model_flags(args, args.steps)
    names = _configs(args)
    runs = {name: [] for name in names}  # name -> [(windows' tokens/s of the TP group, final loss, stats)]
    errors = {}
    for repeat in range(args.repeat):  # round robin: a drift of the machine touches every configuration
        for name in names:
            backend, async_tp, launcher_flags = BENCH_CONFIGS[name]
            log = os.path.join(args.out, f"titan_{name}{f'_{repeat}' if args.repeat > 1 else ''}.log")
            steps, stats, code = run_titan(backend, async_tp, flags, args.nproc, log, _env(args, name),
                                           BENCH_LOG_FREQ, launcher_flags)
            # torchtitan's tps: a window's tokens / (its time x TP degree)
            windows = [tps * args.nproc for step, (_, tps) in sorted(steps.items()) if step > WARMUP]
            if code or not windows:
                print(f"{name}: exit code {code}, {len(steps)} steps logged; see {log}", flush=True)
                errors.setdefault(name, []).append(f"run {repeat}: exit code {code}")
                continue
            runs[name].append((windows, steps[max(steps)][0], stats))
            print(f"{name} run {repeat}: windows {windows}", flush=True)
    rows = []
    for name in names:
        if not runs[name]:
            rows.append({"config": name, "error": errors[name]})
            continue
        windows = [w for run_windows, _, _ in runs[name] for w in run_windows]
        tokens_per_s = statistics.median(windows)
        rows.append({"config": name, "flavor": args.flavor, "env": _env(args, name),
                     "tokens_per_s": round(tokens_per_s, 1), "runs": len(runs[name]), "step_ms": round(1e3 * args.seq / tokens_per_s, 1),
                     "final_loss": runs[name][-1][1], "steps_timed": len(windows) * BENCH_LOG_FREQ,
                     "run_tokens_per_s": [round(statistics.median(w), 1) for w, _, _ in runs[name]],
                     "window_tokens_per_s": [w for w, _, _ in runs[name]], "tdist_stats": runs[name][-1][2],
                     **({"failed_runs": errors[name]} if name in errors else {})})
        print({k: v for k, v in rows[-1].items() if k != "window_tokens_per_s"}, flush=True)
    by_name = {r["config"]: r for r in rows if "tokens_per_s" in r}
    ratios = {}
    for base in ("nccl", "nccl_async_tp"):
        if "tdist_async_tp" in by_name and base in by_name:
            ratios[f"tdist_async_tp_over_{base}"] = round(
                by_name["tdist_async_tp"]["tokens_per_s"] / by_name[base]["tokens_per_s"], 3)
    if {"nccl", "tdist_async_tp", "bound"} <= set(by_name):
        nccl, tdist, bound = (by_name[n]["step_ms"] for n in ("nccl", "tdist_async_tp", "bound"))
        ratios["recovered"] = round((nccl - tdist) / (nccl - bound), 3) if nccl != bound else None
    print("ratios", ratios, flush=True)
    write_result(args.out, "titan", args.nproc, rows=rows, versions=_versions(), ratios=ratios,
                 method=(f"torchtitan 0.2.2 llama3 {args.flavor}, TP={args.nproc}, seq {args.seq}, local batch 1, "
                         f"bf16, compiled, {args.steps} steps logged every {BENCH_LOG_FREQ}; tokens/s of the TP group "
                         f"= seq / step time, the median over the log windows after step {WARMUP} (torchtitan's tps: "
                         f"a window's tokens over its time) of {args.repeat} run(s) per configuration, the "
                         f"configurations taken round robin in one job"))


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


def profile(args):
    """Where a step's GPU time goes, per configuration: torchtitan's profiler traces step
    PROFILED_STEP; rank 0's kernels and copies are summed by kind, and the time communication
    runs with no computation beside it (exposed) bounds what overlapping can gain:
    span / (span - exposed)."""
    flags = [*_model_flags(args, PROFILED_STEP), "--profiling.enable_profiling",
             "--profiling.profile_freq", str(PROFILED_STEP)]
    rows = []
    for name in _configs(args):
        backend, async_tp, launcher_flags = BENCH_CONFIGS[name]
        folder = f"/tmp/titan_{backend}"
        shutil.rmtree(os.path.join(folder, "profile_traces"), ignore_errors=True)
        steps, stats, code = run_titan(backend, async_tp, flags, args.nproc,
                                       os.path.join(args.out, f"titan_profile_{name}.log"), _env(args, name),
                                       launcher_flags=launcher_flags)
        traces = sorted(glob.glob(os.path.join(folder, "profile_traces", "iteration_*", "rank*_trace.json")))
        if code or not traces:
            rows.append({"config": name, "error": f"exit code {code}, {len(traces)} traces"})
            print(rows[-1], flush=True)
            continue
        rows.append({"config": name, "env": _env(args, name), **kernel_breakdown(traces), "tdist_stats": stats})
        print({k: v for k, v in rows[-1].items() if k not in ("top", "comm_calls_us")}, flush=True)
    write_result(args.out, "titan_profile", args.nproc, rows=rows, versions=_versions(),
                 method=(f"torchtitan 0.2.2 llama3 {args.flavor}, TP={args.nproc}, seq {args.seq}, local batch 1, "
                         f"bf16, compiled; torch profiler trace of step {PROFILED_STEP}, rank 0's CUDA kernels"))


COMM_KINDS = ("nccl", "tdist", "copy")


def tdist_kernels() -> tuple[set, set]:
    """(communication kernels, fused kernels): every Triton kernel of torch_tdist.triton_kernels by
    name, as traces name them; those of its ``overlap`` module are the fused ones (they compute
    while they communicate), every other one moves data between ranks."""
    import importlib
    import pkgutil

    import torch_tdist.triton_kernels as package

    comm, fused = set(), set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        # (a Triton kernel, compiled or interpreted, has its arguments' names; device functions too,
        # but they do not appear in traces by their own name)
        names = {name for name, value in vars(module).items()
                 if getattr(value, "arg_names", None) is not None
                 and getattr(getattr(value, "fn", None), "__module__", None) == module.__name__}
        (fused if info.name == "overlap" else comm).update(names)
    return comm, fused


def kernel_breakdown(trace_paths: list[str]) -> dict:
    """GPU time of one profiled step from the ranks' chrome traces (rank 0's first): the span
    from rank 0's first kernel or copy to its last, time by kind, the communication time (NCCL's
    and tdist's kernels, peer copies) no computation overlaps (exposed), and, communication
    kernel by kernel, the part rank 0 spent waiting for the last rank to launch the same call
    (skew, not transfer: ``comm_transfer_ms`` is the communication time less that)."""
    def load(path):
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("dur", 0) > 0]
        return events, [(e["ts"], e["ts"] + e["dur"], e["name"], e.get("cat")) for e in events
                        if e.get("cat") in ("kernel", "gpu_memcpy")]

    tdist_comm, tdist_fused = tdist_kernels()
    loaded = [load(p) for p in trace_paths]
    ranks = [gpu for _, gpu in loaded]
    host = collections.defaultdict(list)  # rank 0's host calls that wait for the GPU, and tdist's and c10d's ops
    for e in loaded[0][0]:
        name = e["name"]
        if (e.get("cat") == "cuda_runtime" and ("Synchronize" in name or name in ("cudaMemcpy", "cudaFree"))) \
                or (e.get("cat") == "cpu_op" and any(k in name for k in ("tdist", "symm_mem", "c10d"))):
            host[name[:60]].append(e["dur"])
    work = ranks[0]
    if not work:
        return {"error": "no kernels in the trace"}

    def union(intervals):
        merged = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged

    def covered(intervals):
        return sum(end - start for start, end in intervals)

    def overlap(a, b):  # time both unions cover
        i = j = total = 0
        while i < len(a) and j < len(b):
            total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
            if a[i][1] < b[j][1]:
                i += 1
            else:
                j += 1
        return total

    def kind(name, cat):
        low = name.lower()
        if cat == "gpu_memcpy":
            return "copy" if "ptop" in low else "other"  # (peer copies are tdist's pulls and pushes)
        if "nccl" in low:
            return "nccl"
        if name in tdist_comm:
            return "tdist"
        if name in tdist_fused:
            return "fused"  # (computes while it communicates: counted with the computation)
        if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "matmul", "_mm_")):
            return "matmul"
        if "flash" in low or "fmha" in low or "attention" in low:
            return "attention"
        return "other"

    by_kind, by_name = collections.Counter(), collections.defaultdict(list)
    for start, end, name, cat in work:
        by_kind[kind(name, cat)] += end - start
        by_name[name[:90]].append(end - start)
    comm = union([(s, e) for s, e, n, c in work if kind(n, c) in COMM_KINDS])
    rest = union([(s, e) for s, e, n, c in work if kind(n, c) not in COMM_KINDS])
    span = max(e for _, e, _, _ in work) - min(s for s, _, _, _ in work)
    exposed = covered(comm) - overlap(comm, rest)
    # the n-th call of a communication kernel on every rank is the same collective: rank 0 waited
    # from its own start to the last rank's
    calls, unpaired = [], []
    by_rank = [[(s, e, n) for s, e, n, c in r if kind(n, c) in ("nccl", "tdist")] for r in ranks]
    for name in sorted({n for _, _, n in by_rank[0]}):
        series = [sorted((s, e) for s, e, n in r if n == name) for r in by_rank]
        if len({len(x) for x in series}) != 1:
            unpaired.append(name[:60])  # (the ranks ran it a different number of times: no pairing)
            continue
        for i, (start, end) in enumerate(series[0]):
            wait = max(0, max(x[i][0] for x in series) - start) if len(series) > 1 else 0
            calls.append((start, name[:40], round(end - start, 1), round(min(wait, end - start), 1)))
    calls.sort()
    waited = sum(wait for _, _, _, wait in calls)
    ms = lambda us: round(us / 1e3, 2)  # noqa: E731
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:15]
    return {"span_ms": ms(span), "busy_ms": ms(covered(union([(s, e) for s, e, _, _ in work]))),
            "kind_ms": {k: ms(v) for k, v in by_kind.most_common()},
            "comm_ms": ms(covered(comm)), "exposed_comm_ms": ms(exposed),
            "overlap_bound_speedup": round(span / max(span - exposed, 1e-9), 3),
            "comm_waiting_for_last_rank_ms": ms(waited),
            "comm_transfer_ms": ms(covered(comm) - waited),
            "comm_kernels_not_paired": unpaired,
            "comm_calls_us": [[name, dur, wait] for _, name, dur, wait in calls],
            "host_ms": {name: {"ms": ms(sum(d)), "calls": len(d), "median_us": round(statistics.median(d), 1)}
                        for name, d in sorted(host.items(), key=lambda item: -sum(item[1]))[:15]},
            "top": {name: {"ms": ms(sum(d)), "calls": len(d), "median_us": round(statistics.median(d), 1)}
                    for name, d in top}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("bench", "loss", "profile"))
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--flavor", default="8B_4L")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only", default="", help="bench, profile: comma-separated configurations")
    parser.add_argument("--repeat", type=int, default=1, help="bench: runs per configuration, round robin")
    parser.add_argument("--tdist-env", action="append", default=[], metavar="K=V",
                        help="bench, profile: an environment variable for the tdist runs (e.g. TDIST_OVERLAP=sequential)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    args.steps = args.steps or (40 if args.mode == "bench" else 50)
    os.makedirs(args.out, exist_ok=True)
    {"bench": bench, "loss": loss, "profile": profile}[args.mode](args)


if __name__ == "__main__":
    main()
