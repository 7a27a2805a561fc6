"""tdist collectives against NCCL, side by side in one job.

    torchrun --nproc-per-node 4 benchmarks/collectives.py [--sizes 8K,1M,64M] [--out DIR]

The default group is NCCL; a tdist group over the same ranks runs the same calls on the same
tensors. Each (op, size) is timed with CUDA events around ``--iters`` calls issued back to back
(median of 5 such loops, after ``--warmup``; the median of ``--rounds`` rounds, tdist and
NCCL in turn in each, so that a slow moment of the host hits both), and also one call at a time
after a barrier. all_reduce rows also time torch symm_mem's one-shot (into a preallocated
output) and two-shot (in place) all-reduces on a symmetric buffer (``symm_mem_one_shot_us``,
``symm_mem_two_shot_us``), the fastest peers at small sizes. ``host_overhead_us``: CPU
microseconds per 4 KB all_reduce issued back to back, each peer's, the slowest rank's. Each rank
runs pinned to its share of the CPUs (``timing.pin_cores``; ``--no-pin``: not).
Rank 0 writes ``<name>_<machine>.json`` (``--name``, ``collectives`` by default; the MoE sweep
``--ops all_to_all_moe --moe-tokens 1,4,...,4096 --graph --name collectives_moe``) and prints a
table of ratios. ``--every-size`` makes tdist's kernels serve every size, including those that
tdist otherwise hands to NCCL (the backend option ``gpu_size_limits``), to measure them.
"""

import argparse
import os
import statistics

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tdist  # noqa: E402
from timing import host_us_in_rounds, in_turn, slowest, start_job, symm_mem_all_reduces, symm_mem_group, time_loop_us, write_result  # noqa: E402
from torch_tdist.config import parse_size  # noqa: E402
from torch_tdist.compat import all_gather_single, reduce_scatter_single  # noqa: E402

_cpu_group = None  # Gloo, to combine timings across ranks
_async_op = False  # --async-op
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all_single", "broadcast", "all_to_all_moe")
# MoE dispatch: 128 tokens per rank (--moe-tokens), hidden 7168 (bf16), each token to its top-8
# of 8 experts per rank
MOE_TOKENS, MOE_HIDDEN, MOE_TOP_K, MOE_EXPERTS_PER_RANK = 128, 7168, 8, 8


def _moe_splits(world, tokens=MOE_TOKENS, seed=0):
    """splits[src][dst]: tokens rank src sends to rank dst (the same table on every rank)."""
    g = torch.Generator().manual_seed(seed)
    experts = world * MOE_EXPERTS_PER_RANK
    splits = torch.zeros(world, world, dtype=torch.int64)
    for src in range(world):
        chosen = torch.rand(tokens, experts, generator=g).topk(MOE_TOP_K, dim=1).indices
        splits[src] = torch.bincount((chosen // MOE_EXPERTS_PER_RANK).flatten(), minlength=world)
    return splits


def _call(op, group, inp, out):
    kw = {"group": group, "async_op": _async_op}
    if op == "all_gather":
        work = all_gather_single(out, inp, **kw)
    elif op == "reduce_scatter":
        work = reduce_scatter_single(out, inp, **kw)
    elif op == "all_reduce":
        work = dist.all_reduce(inp, **kw)
    elif op == "all_to_all_single":
        work = dist.all_to_all_single(out, inp, **kw)
    elif op == "broadcast":
        work = dist.broadcast(inp, 0, **kw)
    elif op == "all_to_all_moe":
        work = dist.all_to_all_single(out[0], inp, out[1], out[2], **kw)
    if work is not None:
        work.wait()


def _buffers(op, nbytes, world, device):
    """(input, output) of one call; all_to_all_moe: ``nbytes`` is the tokens per rank."""
    if op == "all_to_all_moe":
        splits, rank = _moe_splits(world, nbytes), dist.get_rank()
        inp = torch.randn(int(splits[rank].sum()), MOE_HIDDEN, device=device).to(torch.bfloat16)
        out = torch.empty(int(splits[:, rank].sum()), MOE_HIDDEN, device=device, dtype=torch.bfloat16)
        return inp, (out, splits[:, rank].tolist(), splits[rank].tolist())
    n = max(nbytes // 2, world) // world * world  # bf16 elements per rank, divisible by world
    inp = torch.randn(n, device=device).to(torch.bfloat16)
    if op == "all_gather":
        return inp, torch.empty(n * world, dtype=torch.bfloat16, device=device)
    if op == "reduce_scatter":
        return inp, torch.empty(n // world, dtype=torch.bfloat16, device=device)
    return inp, torch.empty_like(inp)


def _bus_factor(op, world):
    """nccl-tests' bus bandwidth factor: bytes each rank moves over its links / message bytes."""
    return {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0}.get(op, (world - 1) / world)


def _time(op, group, inp, out, warmup, iters):
    for _ in range(warmup):
        _call(op, group, inp, out)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier(group=group)
        start.record()
        _call(op, group, inp, out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return slowest(statistics.median(times), _cpu_group)


def _in_turn(timers: dict, rounds: int) -> dict:
    """name -> the median over ``rounds`` rounds of ``timers[name]()`` (microseconds; ``in_turn``)."""
    return {name: statistics.median(t) for name, t in in_turn(timers, rounds).items()}


def _time_loops(calls: dict, iters, rounds):
    """name -> microseconds per call of ``calls[name]``'s back-to-back loops (``_in_turn``)."""
    return _in_turn({name: lambda call=call: time_loop_us(call, iters, _cpu_group) for name, call in calls.items()},
                    rounds)


def _time_graphs(calls: dict, iters, rounds):
    """name -> microseconds per call when ``iters`` calls of ``calls[name]`` captured in one CUDA
    graph are replayed (``_in_turn``, a replay timed as one loop's call): the GPU's own time per
    call, with no host work between calls (how CUDA-graph users, inference engines among them, run
    collectives)."""
    current = torch.cuda.current_stream()
    graphs = {}
    for name, call in calls.items():
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        current.wait_stream(side)
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name], capture_error_mode="thread_local"):
            for _ in range(iters):
                call()
        graphs[name].replay()
    return _in_turn({name: lambda name=name: _time_replay(graphs[name]) / iters for name in calls}, rounds)


def _time_replay(graph, reps=5):
    """Microseconds per replay of ``graph`` issued right behind another replay of it (median of
    ``reps``, the slowest rank's): the first replay's calls line the ranks up, so the timed one
    holds the GPUs' time only, not how far apart the ranks' hosts launched it."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return slowest(statistics.median(times), _cpu_group)


def _host_overhead_us(calls: dict) -> dict:
    """CPU microseconds per call when 200 are issued back to back, per call of ``calls`` (name ->
    one call): ``host_us_in_rounds`` over 9 rounds after 20 warm-up calls, the slowest rank's."""
    medians, _ = host_us_in_rounds(calls, 9, 200, warmup=20)
    return {name: round(slowest(us, _cpu_group), 1) for name, us in medians.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="8K,64K,1M,16M,64M,256M", help="bytes per rank")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--moe-tokens", default=str(MOE_TOKENS), help="all_to_all_moe: tokens per rank")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of loops, tdist and NCCL in turn")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--graph", action="store_true",
                        help="also time the calls captured in a CUDA graph (tdist_graph_us, nccl_graph_us)")
    parser.add_argument("--async-op", action="store_true",
                        help="call with async_op=True, then wait() (as code that overlaps calls does)")
    parser.add_argument("--every-size", action="store_true",
                        help="tdist's kernels serve every size (backend option gpu_size_limits=False)")
    parser.add_argument("--name", default="collectives", help="the result file is <name>_<machine>.json")
    parser.add_argument("--no-pin", action="store_true", help="leave the ranks where the scheduler puts them")
    args = parser.parse_args()
    global _async_op
    _async_op = args.async_op

    rank, world, device = start_job(pin=not args.no_pin)
    tdist_group = dist.new_group(backend="tdist",
                                 pg_options={"gpu_size_limits": False} if args.every_size else None)
    global _cpu_group
    _cpu_group = dist.new_group(backend="gloo")
    symm_name = symm_mem_group()
    small = torch.randn(1024, device=device)
    overhead = _host_overhead_us({"tdist": lambda: dist.all_reduce(small, group=tdist_group),
                                  "nccl": lambda: dist.all_reduce(small),
                                  **symm_mem_all_reduces(small, symm_name)})
    if rank == 0:
        print(f"host overhead per 4 KB all_reduce (us, slowest rank): {overhead}")
    transport = torch_tdist.get_heap(tdist_group).transport
    rows = []
    for op in args.ops.split(","):
        sizes = ([parse_size(s) for s in args.sizes.split(",")] if op != "all_to_all_moe"
                 else [int(t) for t in args.moe_tokens.split(",")])
        for nbytes in sizes:
            inp, out = _buffers(op, nbytes, world, device)
            nccl_us = _time(op, None, inp, out, args.warmup, args.iters)
            before = torch_tdist.stats(tdist_group)
            tdist_us = _time(op, tdist_group, inp, out, args.warmup, args.iters)
            calls = {name: lambda group=group: _call(op, group, inp, out)
                     for name, group in (("tdist", tdist_group), ("nccl", None))}
            if op == "all_reduce" and not _async_op:
                calls.update(symm_mem_all_reduces(inp, symm_name))
            loops = _time_loops(calls, args.iters, args.rounds)
            if args.graph:
                graphs = _time_graphs(calls, args.iters, args.rounds)
            after = torch_tdist.stats(tdist_group)
            tdist_loop_us, nccl_loop_us = loops["tdist"], loops["nccl"]
            name = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
                    "all_to_all_moe": "all_to_all_single"}.get(op, op)
            served = "tdist" if after[name]["fallback"] == before[name]["fallback"] else "fallback"
            msg_bytes = inp.numel() * inp.element_size() * (world if op == "all_gather" else 1)
            if op == "all_to_all_moe":  # what leaves this rank (the slowest rank sets the time)
                splits = _moe_splits(world, nbytes)
                msg_bytes = int(max(splits[r].sum() - splits[r, r]
                                    for r in range(world))) * MOE_HIDDEN * 2 * world / (world - 1)
            factor = _bus_factor(op, world) * msg_bytes / 1e3
            rows.append({"op": op, "bytes_per_rank": inp.numel() * inp.element_size(),
                         "world_size": world, "transport": transport, "served_by": served,
                         "tdist_us": round(tdist_loop_us, 2), "nccl_us": round(nccl_loop_us, 2),
                         "tdist_single_us": round(tdist_us, 2), "nccl_single_us": round(nccl_us, 2),
                         "tdist_busbw_gbs": round(factor / tdist_loop_us, 1),
                         "nccl_busbw_gbs": round(factor / nccl_loop_us, 1)})
            if op == "all_to_all_moe":
                rows[-1].update(tokens_per_rank=nbytes, hidden=MOE_HIDDEN, top_k=MOE_TOP_K)
            for peer in ("symm_mem_one_shot", "symm_mem_two_shot"):
                if peer in loops:
                    rows[-1][f"{peer}_us"] = round(loops[peer], 2)
                    if args.graph:
                        rows[-1][f"{peer}_graph_us"] = round(graphs[peer], 2)
            if args.graph:
                rows[-1].update(tdist_graph_us=round(graphs["tdist"], 2), nccl_graph_us=round(graphs["nccl"], 2))
            if rank == 0:
                r = rows[-1]
                print(f"{op:<18}{r['bytes_per_rank']:>10} {served:<8} tdist {r['tdist_us']:>8.1f} us  "
                      f"nccl {r['nccl_us']:>8.1f} us  nccl/tdist {r['nccl_us'] / r['tdist_us']:5.2f}x  "
                      f"one call: {r['tdist_single_us']:>8.1f} / {r['nccl_single_us']:>8.1f} us" +
                      (f"  graph: {r['tdist_graph_us']:>8.1f} / {r['nccl_graph_us']:>8.1f} us "
                       f"({r['nccl_graph_us'] / r['tdist_graph_us']:4.2f}x)" if args.graph else "") +
                      "".join(f"  {k[:-3]} {v:.1f}" for k, v in r.items() if k.startswith("symm_mem")), flush=True)
    if rank == 0:
        algorithm = os.environ.get("TDIST_ALGORITHM", "auto")
        write_result(args.out, args.name, world,
                     f"bf16, slowest rank. tdist_us/nccl_us (and the bus bandwidths): {args.iters} calls "
                     f"back to back per timed loop (CUDA events), median of 5 loops, after {args.warmup} "
                     f"warm-ups (nccl-tests' way); the median of {args.rounds} rounds, tdist and NCCL in "
                     f"turn in each. *_single_us: one call after a barrier, median of "
                     f"{args.iters}: host launch time and rank skew included, noisy; symm_mem_*: torch symm_mem's "
                     f"all-reduces, timed as tdist_us" + ("" if args.no_pin else "; ranks pinned to their share of the CPUs") +
                     (f". *_graph_us: {args.iters} calls captured in one CUDA graph, per call of a replay "
                      f"issued right behind another (which lines the ranks up; median of 5, median round)" if args.graph else ""), rows,
                     algorithm=algorithm,
                     size_limits=not args.every_size and algorithm == "auto",
                     heap_size=os.environ.get("TDIST_HEAP_SIZE", "the default"),
                     tdist_env={k: v for k, v in sorted(os.environ.items()) if k.startswith("TDIST_")},
                     host_overhead_us=overhead, async_op=args.async_op)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
