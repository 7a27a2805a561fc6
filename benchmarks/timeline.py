"""What one call of torch_tdist.ops does on the GPU, stream by stream (rank 0's, by the torch
profiler): when each kernel, copy and memset started and how long it ran. Used to find out why a
way of overlapping is slower than it should be (copies that serialise, matmuls waiting on them).

    torchrun --nproc-per-node 4 benchmarks/timeline.py [--op ag_gemm|gemm_rs] [--shape MxNxK]
             [--overlap pipelined|fused|sequential|tune] [--chunks N] [--out DIR]

Shapes as in benchmarks/overlap.py; bf16 (``--overlap tune``: the way tuning picks, printed).
Prints the events of two calls after three warm-ups and writes the Chrome trace to
``DIR/timeline_<op>_<overlap>.json`` (chrome://tracing, Perfetto).
With ``--host N`` it profiles instead where the host's time goes in N calls back to back (rank 0,
cProfile, by own time), and prints the host time per call.
"""

import argparse
import cProfile
import json
import os
import pstats
import time

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tdist  # noqa: E402
from overlap import _operands  # noqa: E402
from timing import start_job  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", default="ag_gemm", choices=("ag_gemm", "gemm_rs"))
    parser.add_argument("--shape", default="8192x4096x12288")
    parser.add_argument("--overlap", default="pipelined", choices=("pipelined", "fused", "sequential", "tune"))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--host", type=int, default=0, help="profile the host in this many calls")
    parser.add_argument("--chunks", type=int, default=0, help="--overlap pipelined: chunks per rank's part "
                        "(default: the first of torch_tdist.overlap.pipelined.PIPELINE_CHUNKS)")
    args = parser.parse_args()
    rank, world, device = start_job()
    os.environ["TDIST_OVERLAP"] = args.overlap
    if args.chunks:  # (the policy "pipelined" runs the first pipelined way)
        torch_tdist.overlap.tuning.WAYS = {f"pipelined {args.chunks}": ("pipelined", args.chunks), **torch_tdist.overlap.tuning.WAYS}
    group = dist.new_group(backend="tdist")
    m, n, k = (int(v) for v in args.shape.split("x"))
    a, b = _operands(args.op, m, n, k, world, device, torch.Generator(device).manual_seed(rank))
    op = torch_tdist.ops.all_gather_matmul if args.op == "ag_gemm" else torch_tdist.ops.matmul_reduce_scatter
    for _ in range(3):
        op(a, b, group=group)
    torch.cuda.synchronize()
    dist.barrier()
    if args.host:
        _profile_host(lambda: op(a, b, group=group), args.host, rank)
        dist.destroy_process_group()
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            op(a, b, group=group)
        torch.cuda.synchronize()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"timeline_{args.op}_{args.shape}_{args.overlap}{args.chunks or ''}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"]
                      if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        t0 = min(e["ts"] for e in events)
        chosen = list(torch_tdist.overlap.state(group).tuning.tuned.values()) if args.overlap == "tune" else ""
        print(f"{args.op} {args.shape} {args.overlap} {chosen}, rank 0: stream, start (us), duration (us), what")
        for e in sorted(events, key=lambda e: e["ts"]):
            print(f"  {e['args'].get('stream')!s:>4} {e['ts'] - t0:9.1f} {e['dur']:8.1f}  {e['name'][:80]}")
        print("wrote", path)
    dist.destroy_process_group()


def _profile_host(call, calls: int, rank: int):
    start = time.perf_counter()
    for _ in range(calls):
        call()
    plain_us = (time.perf_counter() - start) * 1e6 / calls
    torch.cuda.synchronize()
    dist.barrier()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    if rank == 0:
        print(f"host time per call: {plain_us:.1f} us (without the profiler)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
