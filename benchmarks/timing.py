"""What the benchmark scripts share: GPU timing loops, the slowest rank's figure, and the machine
and versions every results file records. Importing it sets the NVLink-multicast safety
variables (``torch_tdist.launch.SAFE_ENV``, where the environment does not set them already)
before any process group starts."""

import json
import os
import platform
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import torch_tdist
from torch_tdist.launch import SAFE_ENV

for _key, _value in SAFE_ENV.items():
    os.environ.setdefault(_key, _value)


def start_job(pin: bool = True):
    """(rank, world size, this rank's GPU) of a torchrun job, with NCCL as the default group;
    with ``pin``, each rank on its own share of the CPUs (``pin_cores``)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if pin:
        pin_cores()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    return rank, world, device


def pin_cores() -> list[int]:
    """Pins this process (and the threads it starts later) to the ``LOCAL_RANK``-th of
    ``LOCAL_WORLD_SIZE`` equal shares of the CPU cores it may run on, a core's hardware threads
    together (so that no two ranks share a core); returns the CPUs. Unpinned, a rank's host time
    per call varied up to 1.5x between ranks and runs with where the scheduler put it; small
    calls and fused calls are host-bound, so that noise was the benchmarks' largest. Every peer
    of a run shares the pinning."""
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    allowed = os.sched_getaffinity(0)
    cores = {}  # a core's hardware threads (its first CPU's list) -> those this process may use
    for cpu in sorted(allowed):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                core = f.read().strip()
        except OSError:
            core = str(cpu)
        cores.setdefault(core, []).append(cpu)
    groups = list(cores.values())
    share = max(len(groups) // local_world, 1)
    mine = [cpu for group in groups[local_rank * share:(local_rank + 1) * share] for cpu in group] or sorted(allowed)
    os.sched_setaffinity(0, mine)
    return mine


def fused_call_counts(group) -> tuple:
    """How a tdist group's fused calls ran so far: (issued from C++ the sequential way, as a
    recorded program, as its CUDA graph; served in Python by an overlapped way). The difference
    of two readings says how the calls between them ran."""
    state = torch_tdist.overlap.state(group)
    issued = (sum(state.issued.sequential), sum(state.issued.program), sum(state.issued.graph))
    return (*issued, sum(state.fused_calls.values()) - issued[1] - issued[2])


def symm_mem_group() -> str:
    """The name of the default group, set up for torch's symmetric-memory ops (the peers of the
    tdist ops they match)."""
    name = dist.group.WORLD.group_name
    try:  # (needed before torch 2.12, a deprecated no-op since)
        from torch.distributed import _symmetric_memory

        with warnings.catch_warnings():  # (its deprecation from torch 2.12 on)
            warnings.simplefilter("ignore", FutureWarning)
            _symmetric_memory.enable_symm_mem_for_group(name)
    except Exception as err:  # noqa: BLE001 - the symm_mem columns record their own errors
        print(f"symm_mem unavailable: {err}")
    return name


def symm_mem_all_reduces(inp: torch.Tensor, symm_name: str) -> dict:
    """torch symm_mem's all-reduces of ``inp``'s size, name -> one call, in place on a symmetric
    buffer holding ``inp``'s values (one-shot into a preallocated output): the peers of a small
    all_reduce. Empty on every rank where symm_mem fails on one (the ranks agree, through the
    default group, so that none times calls the others do not make)."""
    calls = {}
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty(inp.numel(), dtype=inp.dtype, device=inp.device)
        symm_mem.rendezvous(buffer, symm_name)
        buffer.copy_(inp)
        out = torch.empty_like(inp)
        calls = {"symm_mem_one_shot": lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", symm_name, out),
                 "symm_mem_two_shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", symm_name)}
    except Exception as err:  # noqa: BLE001 - the other columns still run
        print(f"symm_mem unavailable: {err}")
    everywhere = torch.tensor([1 if calls else 0], device=inp.device)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    return calls if everywhere.item() else {}


def host_us_in_rounds(calls: dict, rounds: int, n: int, warmup: int = 1, probe=None) -> tuple[dict, dict]:
    """Host microseconds per call of each of ``calls`` (name -> one call) issued ``n`` times back
    to back (issue only: the GPU is synchronised before and after, not inside), after ``warmup``
    calls; every call's loop in turn in each of ``rounds`` rounds (a slow moment of the host
    counts against each alike). Returns (name -> its median round, name -> what ``probe()``, a
    tuple of counters, counted over its loops and their warm-ups: how the calls ran)."""
    times, counted = {name: [] for name in calls}, {}
    for _ in range(rounds):
        for name, call in calls.items():
            before = probe() if probe else ()
            for _ in range(warmup):
                call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                call()
            times[name].append((time.perf_counter() - start) / n * 1e6)
            torch.cuda.synchronize()
            after = probe() if probe else ()
            counted[name] = [sum(x) for x in zip(counted.get(name, [0] * len(after)),
                                                 (a - b for a, b in zip(after, before)))]
    return {name: statistics.median(t) for name, t in times.items()}, counted


def slowest(value: float, cpu_group) -> float:
    """The slowest rank's figure: a rank that finishes early (a broadcast source) proves nothing."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group)
    return t.item()


def time_loop_us(fn, iters: int, cpu_group, reps: int = 5, barrier_group=None) -> float:
    """Microseconds per ``fn()`` when ``iters`` calls are issued back to back, by CUDA events
    (nccl-tests' way: host time hides behind GPU time where it is smaller); the median of
    ``reps`` loops, the slowest rank's."""
    return time_loop(fn, iters, cpu_group, reps, barrier_group)[0]


def time_loop(fn, iters: int, cpu_group, reps: int = 5, barrier_group=None) -> tuple[float, float]:
    """(GPU, host) microseconds per ``fn()`` as ``time_loop_us`` measures them: host time is
    from the first call to the last call's return (a call whose host time exceeds its GPU time
    leaves the GPU idle: host-bound)."""
    per_call, host_per_call = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier(group=barrier_group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host_start = time.perf_counter()
        for _ in range(iters):
            fn()
        host_per_call.append((time.perf_counter() - host_start) * 1e6 / iters)
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / iters)
    return (slowest(statistics.median(per_call), cpu_group),
            slowest(statistics.median(host_per_call), cpu_group))


def in_turn(timers: dict, rounds: int) -> dict:
    """name -> the list of ``timers[name]()``'s results, one per round, every timer in turn in
    each round: a slow moment of the machine (host, clocks, a neighbour) then hits every timer,
    not one, and the ratios between them hold."""
    results = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            results[name].append(timer())
    return results


def machine(world: int) -> str:
    return os.environ.get("TDIST_MACHINE") or f"{torch.cuda.get_device_name()}-x{world}".replace(" ", "_")


def versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "python": platform.python_version(),
            "tdist": torch_tdist.__version__}


def host() -> str:
    return socket.gethostname()


def write_result(out_dir: str, kind: str, world: int, method: str, rows: list, **fields) -> str:
    """``<out_dir>/<kind>_<machine>.json`` with the machine, host, versions, ``method``, any
    other ``fields`` and the ``rows``; returns its path."""
    name = machine(world)
    result = {"machine": name, "host": host(), "versions": versions(), "method": method, **fields, "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{kind}_{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
    return path
