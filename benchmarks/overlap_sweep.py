"""torch_tdist.ops against NCCL + torch.matmul and torch's symm_mem fused ops over Llama-3 layer
shapes and row counts, called back to back (eager) and replayed from CUDA graphs, with the host
time of each call.

    torchrun --nproc-per-node 4 benchmarks/overlap_sweep.py [--ms 256,512,...] [--modes eager,graph]

Shapes (bf16). all_gather_matmul, ``--ag-shapes`` K x N (N in total, each rank has N/ws columns):
Llama-3-8B's fused QKV (4096 x 6144) and gate/up MLP (4096 x 28672), 70B's fused QKV (8192 x
10240) and gate/up MLP (8192 x 57344). matmul_reduce_scatter, ``--rs-shapes`` K x N (K in total,
each rank has K/ws): 8B's output projection (4096 x 4096) and MLP down projection (14336 x 4096),
70B's (8192 x 8192, 28672 x 8192). M is the total row count: all_gather_matmul's A has M/ws rows
per rank, matmul_reduce_scatter's output too.

tdist is what users get: the group's default policy (``tune``: each shape class's first call times
the sequential, pipelined and fused ways and keeps the fastest), issued from C++ after a
signature's first call. ``nccl_mm``: NCCL's all-gather then torch.matmul (or the reverse).
``symm_mem``: ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``.

Timing (``timing.time_loop``): ``--iters`` calls back to back between CUDA events, the slowest
rank's, median of ``--rounds`` loops, the variants of a cell in turn each round. ``*_host_us``:
host microseconds per call over the same loop, issue only (no synchronisation inside it; where it
reaches the GPU time, the call is host-bound). In ``graph`` mode each variant is captured once in a
CUDA graph (after its eager calls, which tune) and the loop replays the graph.

Rank 0 writes ``overlap_sweep_<machine>.json``.
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import torch_tdist
from torch_tdist.compat import all_gather_single, reduce_scatter_single
from timing import fused_call_counts, in_turn, start_job, symm_mem_group, time_loop, write_result

MS = "256,512,1024,2048,4096,8192,16384"
AG_SHAPES = "4096x6144,4096x28672,8192x10240,8192x57344"
RS_SHAPES = "4096x4096,14336x4096,8192x8192,28672x8192"


def _variants(op, m, k, n, world, device, group, symm_name, gen):
    """name -> one call of that variant, on fresh random operands of the cell's shape."""
    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=torch.bfloat16)
    if op == "ag_gemm":
        a, b = rand(m // world, k), rand(k, n // world)
        gathered = torch.empty(m, k, device=device, dtype=a.dtype)

        def nccl_mm():
            all_gather_single(gathered, a)
            return gathered @ b
        return {"tdist": lambda: torch_tdist.ops.all_gather_matmul(a, b, group=group), "nccl_mm": nccl_mm,
                "symm_mem": lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                    a, [b], gather_dim=0, group_name=symm_name)}
    a, b = rand(m, k // world), rand(k // world, n)
    scattered = torch.empty(m // world, n, device=device, dtype=a.dtype)

    def nccl_mm_rs():
        reduce_scatter_single(scattered, a @ b)
        return scattered
    return {"tdist": lambda: torch_tdist.ops.matmul_reduce_scatter(a, b, group=group), "nccl_mm": nccl_mm_rs,
            "symm_mem": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
                a, b, "sum", scatter_dim=0, group_name=symm_name)}


def _counted(timer, group, ran: list):
    """``timer()``, adding to ``ran`` how the fused calls it made ran (``fused_call_counts``)."""
    before = fused_call_counts(group)
    result = timer()
    for i, (b, a) in enumerate(zip(before, fused_call_counts(group))):
        ran[i] += a - b
    return result


def _graphed(fn):
    """``fn`` captured in a CUDA graph: a call replays it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default=MS, help="total rows M")
    parser.add_argument("--ops", default="ag_gemm,gemm_rs")
    parser.add_argument("--ag-shapes", default=AG_SHAPES, help="KxN,... (N in total)")
    parser.add_argument("--rs-shapes", default=RS_SHAPES, help="KxN,... (K in total)")
    parser.add_argument("--modes", default="eager,graph")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    rank, world, device = start_job()
    group = dist.new_group(backend="tdist")
    cpu_group = dist.new_group(backend="gloo")
    symm_name = symm_mem_group()
    gen = torch.Generator(device).manual_seed(4321 + rank)
    rows = []
    for op in args.ops.split(","):
        for shape in (args.ag_shapes if op == "ag_gemm" else args.rs_shapes).split(","):
            k, n = (int(v) for v in shape.split("x"))
            for m in (int(v) for v in args.ms.split(",")):
                variants = _variants(op, m, k, n, world, device, group, symm_name, gen)
                errors = {}
                for name, fn in list(variants.items()):
                    try:
                        for _ in range(args.warmup):
                            fn()
                        torch.cuda.synchronize()
                    except Exception as err:  # noqa: BLE001 - symm_mem may lack a shape; recorded
                        errors[name] = f"{type(err).__name__}: {err}"[:200]
                        del variants[name]
                for mode in args.modes.split(","):
                    calls = variants if mode == "eager" else {}
                    if mode == "graph":
                        for name, fn in variants.items():
                            try:
                                calls[name] = _graphed(fn)
                            except Exception as err:  # noqa: BLE001 - recorded, the others still run
                                errors[f"{name} graph"] = f"{type(err).__name__}: {err}"[:200]
                        torch.cuda.synchronize()
                    timers = {name: (lambda fn=fn: time_loop(fn, args.iters, cpu_group, reps=1)) for name, fn in calls.items()}
                    ran = [0, 0, 0, 0]  # how tdist's timed eager calls ran (fused_call_counts)
                    if mode == "eager" and "tdist" in timers:
                        timers["tdist"] = lambda timer=timers["tdist"]: _counted(timer, group, ran)
                    row = {"op": op, "M": m, "N": n, "K": k, "mode": mode, "world_size": world}
                    for name, loops in in_turn(timers, args.rounds).items():
                        row[f"{name}_us"] = round(statistics.median(gpu for gpu, _ in loops), 1)
                        row[f"{name}_host_us"] = round(statistics.median(host for _, host in loops), 1)
                    for name in ("tdist", "nccl_mm", "symm_mem"):
                        row.setdefault(f"{name}_us", None)
                    if mode == "eager":
                        row["tdist_ran"] = dict(zip(("cpp_sequential", "cpp_program", "cpp_graph", "python"), ran))
                    if errors:
                        row["errors"] = errors
                    if row["tdist_us"] and row["nccl_mm_us"]:
                        row["speedup"] = round(row["nccl_mm_us"] / row["tdist_us"], 3)
                    rows.append(row)
                    if rank == 0:
                        print(f"{op} M={m:<6} K={k:<6} N={n:<6} {mode:<5} tdist {row['tdist_us']} us (host "
                              f"{row.get('tdist_host_us')})  nccl+mm {row['nccl_mm_us']} (host "
                              f"{row.get('nccl_mm_host_us')})  symm_mem {row['symm_mem_us']}  "
                              f"x{row.get('speedup')}", flush=True)
                    del calls, timers
                del variants
                torch.cuda.empty_cache()
    if rank == 0:
        tuned = torch_tdist.overlap.state(group).tuning.tuned
        write_result(args.out, "overlap_sweep", world,
                     f"bf16, slowest rank; {args.iters} calls back to back per loop (CUDA events; host: issue "
                     f"time per call), median of {args.rounds} rounds, variants in turn; tdist: the default "
                     f"policy (tune), chose {len(tuned)} shape classes", rows,
                     tuned={str(key): way for key, way in tuned.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TDIST_HEAP_SIZE", "2G")
    main()
