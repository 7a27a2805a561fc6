"""Host microseconds per call of one torch_tdist.ops.matmul_reduce_scatter (pipelined, replayed
from a CUDA graph; through autograd and without) and of the layers of one 4 KB all_reduce
(tdist's and NCCL's), outermost first, with one small torch op for scale; each rank prints its
own. Where the host time of a call nears its GPU time, the call is host-bound.

    TDIST_OVERLAP=pipelined torchrun --nproc-per-node 2 benchmarks/host_time.py

(benchmarks/results/host_time_NVIDIA_H200-x4.log has a run's figures.)
"""
import statistics
import time

import torch
import torch.distributed as dist

import torch_tdist
from timing import start_job  # (importing it sets the NVLink-multicast safety variables)


def per_call(fn, n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return round(us, 1)


def all_reduce_layers(group, device, rounds: int = 7, calls: int = 400) -> dict:
    """A synchronous 4 KB all_reduce's host time: through torch.distributed's Python function,
    through the process group's C++ dispatch (no Python checks), and the backend's own call, for
    tdist and NCCL; a one-kernel torch op for scale. Every layer is timed in each of ``rounds``
    rounds, the layers in turn (a slow moment of the host, or the first loop, counts against each
    alike); the median round."""
    x = torch.randn(1024, device=device)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # (what dist.all_reduce passes: the call runs on the caller's stream)

    def synchronous(call):
        work = call()  # (no Work for a synchronous call from tdist, nor from NCCL since torch 2.8)
        if work is not None:
            work.wait()

    layers = {}
    for name, pg in (("tdist", group), ("nccl", dist.distributed_c10d._get_default_group())):
        backend = pg._get_backend(device)
        layers[f"{name}: dist.all_reduce"] = lambda pg=pg: dist.all_reduce(x, group=pg)
        layers[f"{name}: group.allreduce"] = lambda pg=pg: synchronous(lambda: pg.allreduce([x], opts))
        layers[f"{name}: backend.allreduce"] = lambda b=backend: synchronous(lambda: b.allreduce([x], opts))
    layers["x.add_(1)"] = lambda: x.add_(1)
    times = {name: [] for name in layers}
    for _ in range(rounds):
        for name, fn in layers.items():
            times[name].append(per_call(fn, calls))
    return {name: round(statistics.median(t), 1) for name, t in times.items()}


def main():
    rank, world, device = start_job()
    group = dist.new_group(backend="tdist")
    a = torch.randn(2048, 1024, device=device, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    op = lambda: torch_tdist.ops.matmul_reduce_scatter(a, b, group=group)  # noqa: E731
    for _ in range(10):  # recorded, then captured
        op()
    torch.cuda.synchronize()
    dist.barrier()
    rows = {"whole call": per_call(op, 200)}
    with torch.inference_mode():
        rows["no autograd (inference_mode)"] = per_call(op, 200)
    print(f"{rank} matmul_reduce_scatter {rows}", flush=True)  # (one write a line: ranks' lines stay whole)
    print(f"{rank} all_reduce {all_reduce_layers(group, device)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
