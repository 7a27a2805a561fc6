"""The routing policy: which registered algorithm serves a call, and the size tables it reads.

The rule: walk the registry in order (a forced algorithm first) and take the first algorithm
that serves the call's family on its device and dtype, fits it (``Algorithm.fits``), and is
eligible:

- TDIST_ALGORITHM=<name>: only that one, and the defaults (``Algorithm.default``: one-shot,
  staged) for what it does not serve;
- auto: those whose size table below holds the call's size, and the defaults.

Sizes are bytes of this rank's input (reduce_scatter: its input; all-to-all: all of it), the
low-latency table's bytes per rank pair. The C++ backend hands GPU messages above
GPU_SIZE_LIMITS to NCCL before they reach Python, up to the first size from which a table
serves them again (:func:`gpu_size_limits`, pushed into C++ when the group is made).
"""

from __future__ import annotations

from .base import Call

# GPU messages up to which tdist's kernels serve each op; larger ones go to NCCL (counted as
# fallback), where tdist measured slower than 0.9x NCCL (docs/performance.md).
GPU_SIZE_LIMITS = {
    "all_gather_into_tensor": 1 << 20, "all_gather": 1 << 20,
    "reduce_scatter_tensor": None, "all_reduce": 1 << 20,
    "broadcast": 1 << 20, "all_to_all_single": 1 << 20,
}
# the family of each op in the tables
FAMILY = {"all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce",
          "all_to_all_single": "all_to_all"}
# From these sizes the bulk path serves (None: never): on the CPU it beats the interpreted
# one-shot kernel from a few MB; on GPUs the streamed kernel is faster.
BULK_FROM_BYTES = {
    "cpu": {"all_gather": 4 << 20, "reduce_scatter": 4 << 20, "all_reduce": None},
    "cuda": {"all_gather": None, "reduce_scatter": None, "all_reduce": None},
}
# From these sizes the streamed kernel serves (faster than one-shot there on H200s); all-to-alls with split sizes at every size, since
# ranks' sizes differ and no size test would agree across ranks.
STREAMED_FROM_BYTES = {
    "cpu": {"all_gather": None, "reduce_scatter": None, "all_reduce": None, "all_to_all": None,
            "all_to_all_v": None},
    "cuda": {"all_gather": (1 << 20) + 1, "reduce_scatter": 64 << 20, "all_reduce": (8 << 20) + 1,
             "all_to_all": (1 << 20) + 1, "all_to_all_v": 0},
}
# From these sizes all_reduce takes the two-shot kernel, below the streamed kernel's (768 KB to
# 8 MB: faster there than one-shot and streamed on 4 H200s in CUDA graphs).
TWOSHOT_FROM_BYTES = {"cpu": {"all_reduce": None}, "cuda": {"all_reduce": 768 << 10}}
# Up to these bytes per rank pair the low-latency kernel serves (faster than one-shot on 4
# H200s in CUDA graphs; reduce_scatter was slower, so it stays one-shot).
LOWLATENCY_UP_TO_BYTES = {
    "cpu": {},
    "cuda": {"all_gather": 64 << 10, "all_reduce": 64 << 10, "all_to_all": 16 << 10},
}
FROM_BYTES = {"bulk": BULK_FROM_BYTES, "streamed": STREAMED_FROM_BYTES, "twoshot": TWOSHOT_FROM_BYTES}
UP_TO_BYTES = {"lowlatency": LOWLATENCY_UP_TO_BYTES}


def in_auto_range(name: str, device_type: str, family: str, message_bytes: int, pair_bytes: int) -> bool:
    """Whether ``auto`` gives a call of these sizes to algorithm ``name`` (by its table; an
    algorithm with none: never, unless it is a default)."""
    if name in FROM_BYTES:
        threshold = FROM_BYTES[name][device_type].get(family)
        return threshold is not None and message_bytes >= threshold
    if name in UP_TO_BYTES:
        return pair_bytes <= UP_TO_BYTES[name][device_type].get(family, 0)
    return False


def eligible(algorithm, forced: str, device_type: str, family: str, message_bytes: int, pair_bytes: int) -> bool:
    """Whether ``algorithm`` may serve a call of ``family`` on ``device_type`` (before ``fits``):
    ``forced``: the group's TDIST_ALGORITHM."""
    if family not in algorithm.serves or device_type not in algorithm.devices:
        return False
    if algorithm.default or forced == algorithm.name:
        return True
    return forced == "auto" and in_auto_range(algorithm.name, device_type, family, message_bytes, pair_bytes)


def choose(algorithms, forced: str, ctx, call: Call):
    """The algorithm that serves ``call``: the first of ``algorithms`` (in registry order, the
    forced one first) that is eligible, takes its dtype and fits it."""
    device_type = ctx.device.type
    message_bytes, pair_bytes = call.message_bytes, call.pair_bytes
    algorithms = sorted(algorithms, key=lambda a: a.name != forced)  # (a stable sort)
    for algorithm in algorithms:
        if (eligible(algorithm, forced, device_type, call.family, message_bytes, pair_bytes)
                and (algorithm.dtypes is None or call.dtype in algorithm.dtypes)
                and algorithm.fits(ctx, call)):
            return algorithm
    raise ValueError(f"tdist {call.op}: no registered algorithm serves {call.family} on {device_type}")


def served_from(family: str | None) -> int | None:
    """GPU bytes from which a larger message of ``family`` is served again (by the streamed
    kernel or the bulk path), past GPU_SIZE_LIMITS; None: never."""
    starts = [table["cuda"].get(family) for table in FROM_BYTES.values()]
    starts = [v for v in starts if v is not None]
    return min(starts) if starts else None


def gpu_size_limits(config) -> dict:
    """op -> (most bytes the one-shot kernels serve, bytes from which another algorithm does),
    for C++ (ProcessGroupTDist.set_gpu_size_limit); none when the group lifts the limits or
    forces an algorithm."""
    if not config.gpu_size_limits or config.algorithm != "auto":
        return {}
    return {op: (limit, served_from(FAMILY.get(op))) for op, limit in GPU_SIZE_LIMITS.items()}
