"""Host microseconds per call, layer by layer: torch_tdist.ops (all_gather_matmul and
matmul_reduce_scatter, each way) and a 4 KB all_reduce, against NCCL (+ torch.matmul) in the
same run; each rank prints its own line, rank 0 writes ``host_time_<machine>.json``.

    torchrun --nproc-per-node 4 benchmarks/host_time.py [--out DIR]

A fused call's layers, outermost first: ``torch_tdist.ops.*`` (what users call: C++ issues a
signature's later calls), the custom op ``torch.ops.tdist.*`` (the dispatcher's path, which
torch.compile's graphs take), the backend's C++ entry point alone, and their parts: the group's
collective from Python (``dist.all_gather_single``) and ``torch.matmul``. Then synchronous 4 KB
collectives, layer by layer (``all_reduce_layers``, ``small_collective_layers``). Shapes: M = 256 total
rows, K = 4096, N = 6144 (all_gather_matmul) and 4096 (matmul_reduce_scatter), bf16, on groups
whose policy is ``sequential`` and ``pipelined`` (the pipelined way's later calls replay a CUDA
graph). Each figure: ``--calls`` calls back to back (issue only, no synchronisation inside),
every layer in turn in each of ``--rounds`` rounds, the median round.
"""

import argparse
import statistics

import torch
import torch.distributed as dist

import torch_tdist
from torch_tdist.backend import _tdist_backend
from torch_tdist.compat import all_gather_single, reduce_scatter_single
from timing import fused_call_counts, host_us_in_rounds, start_job, symm_mem_all_reduces, symm_mem_group, write_result


def issued_counts(groups: dict):
    """A probe of how fused calls ran: per group, ``fused_call_counts``."""
    return lambda: tuple(n for group in groups.values() for n in fused_call_counts(group))


def fused_layers(groups: dict, world: int, device) -> dict:
    m, k, n = 256, 4096, 6144
    a = torch.randn(m // world, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n // world, device=device, dtype=torch.bfloat16)
    rs_a = torch.randn(m, k // world, device=device, dtype=torch.bfloat16)
    rs_b = torch.randn(k // world, 4096, device=device, dtype=torch.bfloat16)
    gathered = torch.empty(m, k, device=device, dtype=torch.bfloat16)
    scattered = torch.empty(m // world, 4096, device=device, dtype=torch.bfloat16)
    product = rs_a @ rs_b
    layers = {}
    for label, group in groups.items():
        backend = _tdist_backend(group)
        layers.update({
            f"{label}: ops.all_gather_matmul": lambda g=group: torch_tdist.ops.all_gather_matmul(a, b, group=g),
            f"{label}: torch.ops.tdist.all_gather_matmul": lambda g=group: torch.ops.tdist.all_gather_matmul(
                a, [b], g.group_name, 0, False),
            f"{label}: backend.fused_all_gather_matmul": lambda be=backend: be.fused_all_gather_matmul(a, [b], 0, False),
            f"{label}: ops.matmul_reduce_scatter": lambda g=group: torch_tdist.ops.matmul_reduce_scatter(rs_a, rs_b, group=g),
            f"{label}: torch.ops.tdist.matmul_reduce_scatter": lambda g=group: torch.ops.tdist.matmul_reduce_scatter(
                rs_a, rs_b, g.group_name, 0, "sum"),
        })
    tdist_group = next(iter(groups.values()))
    layers.update({
        "tdist: dist.all_gather_single": lambda: all_gather_single(gathered, a, group=tdist_group),
        "tdist: dist.reduce_scatter_single": lambda: reduce_scatter_single(scattered, product, group=tdist_group),
        "nccl: dist.all_gather_single + matmul": lambda: (all_gather_single(gathered, a), gathered @ b),
        "nccl: matmul + dist.reduce_scatter_single": lambda: reduce_scatter_single(scattered, rs_a @ rs_b),
        "torch.matmul (all_gather_matmul's)": lambda: gathered @ b,
    })
    for fn in layers.values():  # (first calls: tuning, recording, CUDA-graph captures)
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    return layers


def all_reduce_layers(group, idle_group, device) -> dict:
    """A synchronous 4 KB all_reduce: through torch.distributed's Python function, the process
    group's C++ dispatch (no Python checks) and the backend's own call, tdist's and NCCL's;
    tdist's bookkeeping alone (``idle_group``, whose calls launch nothing: checks, stream order,
    the end event, the watchdog's entry), also under torch.distributed's function; torch
    symm_mem's one-shot and two-shot all-reduces; a one-kernel torch op for scale."""
    x = torch.randn(1024, device=device)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # (what dist.all_reduce passes: the call runs on the caller's stream)

    layers = {}
    for name, pg in (("tdist", group), ("nccl", dist.distributed_c10d._get_default_group())):
        backend = pg._get_backend(device)
        layers[f"{name}: dist.all_reduce"] = lambda pg=pg: dist.all_reduce(x, group=pg)
        layers[f"{name}: group.allreduce"] = lambda pg=pg: _wait(pg.allreduce([x], opts))
        layers[f"{name}: backend.allreduce"] = lambda b=backend: _wait(b.allreduce([x], opts))
    idle = idle_group._get_backend(device)
    # (torch.distributed's layers over a backend whose own cost is only bookkeeping: the least
    # host time any backend's dist.all_reduce can take, to set against symm_mem's whole call)
    layers["tdist, launching nothing: dist.all_reduce"] = lambda: dist.all_reduce(x, group=idle_group)
    layers["tdist, launching nothing: backend.allreduce"] = lambda: _wait(idle.allreduce([x], opts))
    symm = symm_mem_all_reduces(x, symm_mem_group())
    if symm:
        layers["symm_mem: one_shot_all_reduce"] = symm["symm_mem_one_shot"]
        layers["symm_mem: two_shot_all_reduce_"] = symm["symm_mem_two_shot"]
    layers["x.add_(1)"] = lambda: x.add_(1)
    return layers


def small_collective_layers(group, idle_group, world, device) -> dict:
    """The other synchronous small collectives, 4 KB per rank, on tdist: torch.distributed's
    Python function, the backend's own call, and the backend's call on ``idle_group`` (launching
    nothing): where each op's host time goes, as ``all_reduce_layers`` shows for all_reduce."""
    x, gathered, scattered = (torch.randn(n, device=device) for n in (1024, 1024 * world, 1024 // world))
    out = torch.empty_like(x)

    def options(kind):
        opts = kind()
        opts.asyncOp = False  # (what torch.distributed's functions pass)
        return opts
    ops = {  # name: (torch.distributed's call, the backend method's name, its arguments)
        "broadcast": (lambda: dist.broadcast(x, 0, group=group), "broadcast",
                      ([x], options(dist.BroadcastOptions))),
        "all_to_all_single": (lambda: dist.all_to_all_single(out, x, group=group), "alltoall_base",
                              (out, x, [], [], options(dist.AllToAllOptions))),
        "all_gather_single": (lambda: all_gather_single(gathered, x, group=group), "_allgather_base",
                              (gathered, x, options(dist.distributed_c10d.AllgatherOptions))),
        "reduce_scatter_single": (lambda: reduce_scatter_single(scattered, x, group=group), "_reduce_scatter_base",
                                  (scattered, x, options(dist.ReduceScatterOptions))),
    }
    layers = {}
    for name, (call, method, args) in ops.items():
        layers[f"tdist: dist.{name}"] = call
        for label, pg in (("backend", group), ("launching nothing: backend", idle_group)):
            bound = getattr(pg._get_backend(device), method)
            layers[f"tdist, {label}.{method}"] = lambda bound=bound, args=args: _wait(bound(*args))
    return layers


def _wait(work):
    if work is not None:
        work.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--no-pin", action="store_true", help="leave the ranks where the scheduler puts them")
    args = parser.parse_args()
    rank, world, device = start_job(pin=not args.no_pin)
    groups = {policy: dist.new_group(backend="tdist", pg_options={"overlap": policy})
              for policy in ("sequential", "pipelined")}
    fused, ways = host_us_in_rounds(fused_layers(groups, world, device), args.rounds, args.calls,
                                    probe=issued_counts(groups))
    idle_group = dist.new_group(backend="tdist", pg_options={"communication": False})
    reduce, _ = host_us_in_rounds({**all_reduce_layers(groups["sequential"], idle_group, device),
                           **small_collective_layers(groups["sequential"], idle_group, world, device)},
                          args.rounds, 200)
    fused, reduce = ({name: round(us, 1) for name, us in t.items()} for t in (fused, reduce))
    print(f"{rank} {fused}", flush=True)  # (one write a line: ranks' lines stay whole)
    print(f"{rank} how the calls ran, per group (sequential, pipelined) x (C++ sequential, C++ program, "
          f"C++ graph, overlapped in Python): {ways}", flush=True)
    print(f"{rank} {reduce}", flush=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, {**fused, **reduce})
    if rank == 0:
        rows = [{"layer": name, "host_us_by_rank": [r[name] for r in everyone],
                 "host_us_median": round(statistics.median(r[name] for r in everyone), 1),
                 **({"rank0_calls_ran": ways[name]} if name in ways else {})} for name in everyone[0]]
        write_result(args.out, "host_time", world,
                     f"host microseconds per call, issue only: {args.calls} calls back to back (all_reduce: 200), "
                     f"every layer in turn in {args.rounds} rounds, the median round"
                     f"{'' if args.no_pin else ', each rank pinned to its share of the CPUs'}; all_gather_matmul "
                     f"M=256 K=4096 N=6144, matmul_reduce_scatter M=256 K=4096 N=4096, bf16", rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
