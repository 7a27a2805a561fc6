"""How a fused op runs: the group's policy (``TDIST_OVERLAP``, read with the group's other
options: ``config.OVERLAPS``), and for "tune" the per-shape choice, timed on every rank on a
shape class's first call."""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
from torch import Tensor

from .. import language
from .fused import GEMM_CONFIGS
from .pipelined import PIPELINE_CHUNKS

TUNE_RUNS = 5  # calls of a way timed together when a shape class is tuned
TUNE_ROUNDS = 3  # rounds over all ways; a way's time is its median round
# untimed calls of a way before each of its timed ones (and one before the first round, which
# compiles): a pipelined way's first call is recorded (ProgramReplay.recorded), many times slower
TUNE_WARMUPS = 2
if language.INTERPRET:  # (one timed call a way: CPU times say nothing of GPUs; CI's time)
    TUNE_RUNS, TUNE_ROUNDS, TUNE_WARMUPS = 1, 1, 0
# GPU cycles the stream sleeps before a way's timed calls, so that the GPU's time alone is
# measured (_seconds_per_call): twice what the host took to issue as many calls of the way, at
# GPU_CYCLES_PER_SECOND (an H200's top SM clock, 1.98 GHz; at a lower clock the sleep lasts
# longer), within [HOLD_CYCLES, MAX_HOLD_CYCLES] (2 ms to 100 ms there)
GPU_CYCLES_PER_SECOND = 2.0e9
HOLD_CYCLES, MAX_HOLD_CYCLES = 4_000_000, 200_000_000
OVERLAP_MARGIN = 0.95  # an overlapped way must take at most this much of the sequential time

# name -> way of the overlapped ops: ("pipelined", chunks) or ("fused", tile config)
WAYS = {**{f"pipelined {c}": ("pipelined", c) for c in PIPELINE_CHUNKS},
        **{f"fused {i}": ("fused", t) for i, t in enumerate(GEMM_CONFIGS)}}


class Tuning:
    """One group's tuned shape classes."""

    def __init__(self):
        self.tuned = {}  # shape class -> the fastest way found ("tune")
        self.tuning_us = {}  # shape class -> {way: its time there, us per call}
        self.uneven_classes = set()  # shape classes whose widths differ between ranks (run)


def rows_class(t: Tensor) -> int:
    """Shapes tuned together: ``t``'s row count (all dimensions but the last) rounded up to a
    power of two."""
    rows = math.prod(t.shape[:-1])
    return 1 << max(rows - 1, 0).bit_length()


def run(group, state, key, sequential, overlapped, width=None):
    """The op's result, computed the way the group's policy says (package docstring), ``state``
    the group's ``OverlapState``. ``key``:
    the shape class (the same on every rank). ``width``: a size that may differ between ranks
    (all_gather_matmul's B columns, matmul_reduce_scatter's share of K), tuned apart (q/k/v and
    an MLP's up projection share rows and K, not the best way) unless the first tuning of
    ``key`` found it differing between ranks (unevenly sharded): then ``key`` is tuned once for
    every width, so that no rank tunes alone. (A rank would still tune alone if one width of a
    class were even and a later one uneven with one rank's width equal to the even one: not met
    in tensor parallelism.)
    ``overlapped(way)``: the op overlapped one of ``WAYS``, None where it cannot run;
    ``overlapped`` None: it cannot for this call. (A tuned call builds nothing it does not run:
    host time, tens of microseconds a call on slow hosts.)"""
    executor = state.executor
    policy = executor.overlap
    if policy == "auto":
        policy = "tune" if executor.heap.device.type == "cuda" else "sequential"
    if overlapped is None or policy == "sequential":
        return sequential()
    if policy in ("pipelined", "fused"):  # the kind's first way
        return _or_sequential(overlapped(next(w for w in WAYS.values() if w[0] == policy)), sequential)
    tuning = state.tuning
    shape_class = key
    if width is not None and shape_class not in tuning.uneven_classes:
        key = (*shape_class, width)
    choice = tuning.tuned.get(key)
    if choice is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return sequential()  # no timing inside a CUDA graph capture; tuned on a later call
        ways = {"sequential": sequential, **{name: (lambda w=w: overlapped(w)) for name, w in WAYS.items()}}
        state.replays.tuning = True
        try:
            choice, widths_differ, times = _fastest(group, executor.heap.device, ways, width or 0)
        finally:
            state.replays.tuning = False
        if widths_differ:
            tuning.uneven_classes.add(shape_class)
            key = shape_class
        tuning.tuned[key], tuning.tuning_us[key] = choice, times
    return sequential() if choice == "sequential" else _or_sequential(overlapped(WAYS[choice]), sequential)


def _or_sequential(result, sequential):
    return sequential() if result is None else result


def _fastest(group, device: torch.device, ways: dict, width: int) -> tuple[str, bool, dict]:
    """(the way with the least time per call, whether ``width`` differs between ranks, every
    runnable way's time in microseconds; ``_seconds_per_call``):
    TUNE_ROUNDS rounds over the ways (so that a slow moment of the machine does not count
    against one way only), each timing TUNE_RUNS calls on every rank after TUNE_WARMUPS, the
    ranks starting together; a way's time is its median round."""
    runnable = [name for name, way in ways.items() if way() is not None]  # (also the warm-up: compiles)
    rounds = {name: [] for name in runnable}
    issue = torch.zeros(1, dtype=torch.float64, device=device)
    for _ in range(TUNE_ROUNDS):
        for name in runnable:
            start = time.perf_counter()
            for _ in range(TUNE_WARMUPS):
                ways[name]()
            # the slowest rank's host seconds per call (the ranks start together after it, and
            # hold their streams alike)
            issue.fill_((time.perf_counter() - start) / max(TUNE_WARMUPS, 1))
            dist.all_reduce(issue, op=dist.ReduceOp.MAX, group=group)
            _synchronize()
            rounds[name].append(_seconds_per_call(ways[name], device, issue.item()))
    slowest = torch.tensor([statistics.median(rounds[n]) if n in rounds else math.inf for n in ways]
                           + [width, -width], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    slowest = slowest.cpu()
    times = {name: round(t * 1e6, 1) for name, t in zip(ways, slowest.tolist()) if name in rounds}
    return _choose(list(ways), slowest[:len(ways)]), bool(slowest[-2] != -slowest[-1]), times


def _seconds_per_call(way, device: torch.device, issue_seconds: float) -> float:
    """Seconds per call of TUNE_RUNS calls of ``way``. On GPUs, the GPU's time: the calls are
    queued behind a sleep longer than the host takes to issue them (``issue_seconds`` a call;
    HOLD_CYCLES), so that the host's issuing is not counted. These calls
    run through Python, later ones are issued from C++ in a fraction of that host time
    (``csrc/fused_calls.cpp``), and in a CUDA graph there is none: wall time here would favour
    the way that is cheapest for Python, not the fastest one."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(TUNE_RUNS):
            way()
        return (time.perf_counter() - start) / TUNE_RUNS
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hold = 2 * TUNE_RUNS * issue_seconds * GPU_CYCLES_PER_SECOND
        torch.cuda._sleep(int(min(max(hold, HOLD_CYCLES), MAX_HOLD_CYCLES)))
        start.record()
        for _ in range(TUNE_RUNS):
            way()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / 1e3 / TUNE_RUNS


def _choose(names: list, slowest) -> str:
    """The way of ``names`` with the least of ``slowest`` (times, the slowest rank's: every rank
    picks the same); another way replaces "sequential" only if it is OVERLAP_MARGIN faster (a
    wrong pick costs every later call)."""
    best = int(torch.argmin(slowest))
    if slowest[best] > OVERLAP_MARGIN * slowest[names.index("sequential")]:
        return "sequential"
    return names[best]


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
