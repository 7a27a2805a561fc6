"""What the benchmark scripts share: GPU timing loops, the slowest rank's figure, and the machine
and versions every results file records."""

import platform
import socket
import statistics

import torch
import torch.distributed as dist

import torch_tdist


def slowest(value: float, cpu_group) -> float:
    """The slowest rank's figure: a rank that finishes early (a broadcast source) proves nothing."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group)
    return t.item()


def time_loop_us(fn, iters: int, cpu_group, reps: int = 5, barrier_group=None) -> float:
    """Microseconds per ``fn()`` when ``iters`` calls are issued back to back, by CUDA events
    (nccl-tests' way: host time hides behind GPU time where it is smaller); the median of
    ``reps`` loops, the slowest rank's."""
    per_call = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier(group=barrier_group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / iters)
    return slowest(statistics.median(per_call), cpu_group)


def machine(world: int) -> str:
    import os

    return os.environ.get("TDIST_MACHINE", f"{torch.cuda.get_device_name()}-x{world}".replace(" ", "_"))


def versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "python": platform.python_version(),
            "tdist": torch_tdist.__version__}


def host() -> str:
    return socket.gethostname()
