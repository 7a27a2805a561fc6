"""One typed config per process group, and the only place that reads tdist's ``TDIST_*`` variables.

A group's :class:`Config` is built once, when the group is made, from the backend options
(``dist.init_process_group("tdist", pg_options={...})`` or ``dist.new_group(backend="tdist",
pg_options={...})``, a dict) and the environment; an option wins over its variable.

| variable | backend option | default | what it does |
| --- | --- | --- | --- |
| ``TDIST_HEAP_SIZE`` | ``heap_size`` | 64M on the CPU, 1G on GPUs | bytes of each rank's symmetric heap per group (``268435456``, ``256M``, ``1G``) |
| ``TDIST_TRANSPORT`` | ``transport`` | ``auto`` | ``shm`` (CPU), ``cuda`` (CUDA IPC, one node), ``nvshmem``, ``hip`` and ``rocshmem`` (AMD); ``auto``: ``shm`` on the CPU, ``cuda`` (``hip`` on a ROCm torch) on one node, ``nvshmem`` (``rocshmem``) across nodes |
| ``TDIST_ALGORITHM`` | ``algorithm`` | ``auto`` | the collectives' algorithm: ``auto`` chooses by size, a name forces it wherever it serves (``torch_tdist.collectives.registry``) |
| ``TDIST_OVERLAP`` | ``overlap`` | ``auto`` | how ``torch_tdist.ops`` run: ``sequential``, ``pipelined``, ``fused``, ``tune``; ``auto``: ``tune`` on GPUs, ``sequential`` on the CPU |
| ``TDIST_ASYNC_ERROR_HANDLING`` | ``async_error_handling`` | ``1`` | ``1``: a GPU call past the group's timeout takes the process down (as NCCL's); ``0``: the group is aborted and later calls raise |
| ``TDIST_CHECK_CALLS`` | ``check_calls`` | ``0`` (``1`` on the CPU) | ``1``: every GPU call checks that its peers made the same call (reads device memory after each) |
| ``TDIST_GPU_KERNELS`` | ``gpu_kernels`` | ``1`` | ``0``: every CUDA tensor goes to NCCL (counted as fallback in ``stats()``) |
| ``TDIST_INTERPRET`` | | ``1`` without a GPU | ``1``: kernels run under the Triton interpreter; ``0``: compiled even without a GPU (ahead-of-time compile checks). Read once, at import |

Backend options only, for measurements (every rank of a group must give the same):

| option | default | what it does |
| --- | --- | --- |
| ``gpu_size_limits`` | ``True`` | ``False``: tdist's kernels serve GPU messages of every size (by default the sizes where NCCL is faster go to NCCL) |
| ``uneven_all_to_all`` | ``True`` | ``False``: GPU all-to-alls with split sizes go to NCCL |
| ``bulk_push`` | the device's | who pushes on the bulk path: ``copy_engine`` or ``sm`` |
| ``streamed_step_blocks`` | ``1`` | blocks per step and program of the streamed kernel |
| ``streamed_min_block_bytes`` | ``16384`` | the smallest block the streamed kernel cuts a short share into (a power of two) |
| ``dependent_launch`` | ``True`` | ``False``: kernels are launched without programmatic dependent launch (they keep its wait instruction, which then returns at once) |
| ``communication`` | ``True`` | ``False``: every call of the group returns at once, ordered and counted but moving nothing (outputs untouched, so results are wrong), and ``torch_tdist.ops`` run their sequential way: the time of a training step with free communication, the bound overlap aims at (``benchmarks/titan.py``'s ``bound``) |

This module imports nothing of torch_tdist, so that every layer may use it.
"""

from __future__ import annotations

import dataclasses
import os
import re

# How torch_tdist.ops run (TDIST_OVERLAP): "sequential" (the collective, then torch.matmul),
# "pipelined" (copy engines and torch.matmul chunk by chunk), "fused" (the overlapping Triton
# kernels), "tune" (a shape's first call times every way and keeps the fastest), "auto" (tune on
# GPUs, sequential on the CPU).
OVERLAPS = ("auto", "fused", "pipelined", "sequential", "tune")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_OFF_ON = {"0": False, "1": True}


def decide_interpret() -> bool:
    """Whether kernels run under the Triton interpreter (decided once, when
    ``torch_tdist.language`` defines them): TDIST_INTERPRET=1 or 0 says so; else
    TRITON_INTERPRET=1, or no CUDA GPU."""
    forced = os.environ.get("TDIST_INTERPRET")
    if forced in ("0", "1"):  # 0: compile even without a GPU (ahead-of-time compile checks)
        return forced == "1"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    import torch

    return not torch.cuda.is_available()


def parse_size(text: str, what: str = "TDIST_HEAP_SIZE") -> int:
    """Bytes from ``"268435456"``, ``"256M"``, ``"256MiB"``, ``"1g"``..."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not match or int(match.group(1)) <= 0:
        raise ValueError(
            f"tdist: {what}={text!r} is not a heap size; expected a positive number of bytes "
            f"such as 268435456, 256M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


# The keys a group's backend options (pg_options) may hold.
OPTION_KEYS = ("transport", "heap_size", "algorithm", "overlap", "async_error_handling", "check_calls",
               "gpu_kernels", "gpu_size_limits", "uneven_all_to_all", "bulk_push", "streamed_step_blocks",
               "streamed_min_block_bytes", "dependent_launch", "communication")


@dataclasses.dataclass(frozen=True)
class Config:
    """A group's settings (the tables above); build it with :meth:`from_options`."""

    transport: str = "auto"
    heap_bytes: int | None = None  # None: the device's default
    algorithm: str = "auto"
    overlap: str = "auto"
    tear_down_on_timeout: bool = True  # TDIST_ASYNC_ERROR_HANDLING
    check_calls: bool = False  # (the executor checks every call under the interpreter anyway)
    gpu_kernels: bool = True
    gpu_size_limits: bool = True
    uneven_all_to_all: bool = True
    bulk_push: str | None = None  # None: the device's default
    streamed_step_blocks: int = 1
    streamed_min_block_bytes: int = 16384
    dependent_launch: bool = True
    communication: bool = True

    @classmethod
    def from_options(cls, options=None, *, choices: dict) -> "Config":
        """The config of a group made with backend ``options`` (a dict, or None), the environment
        filling in what they leave out. ``choices``: the values each of "transport", "algorithm",
        "overlap" and "bulk_push" may take, and "streamed_min_block_bytes": its (least, most)."""
        options = options or {}
        unknown = sorted(set(options) - set(OPTION_KEYS)) if isinstance(options, dict) else []
        if unknown:  # (a misspelt key would otherwise leave its default in force without a word)
            raise ValueError(
                f"tdist: unknown backend option(s) {', '.join(map(repr, unknown))}; expected keys among "
                f"{', '.join(OPTION_KEYS)} (the TDIST_* variables are read from the environment)")

        def setting(key: str, variable: str | None, default):
            """(value, where it came from: the variable's name or the option's)."""
            if options.get(key) is not None:
                return options[key], f"backend option {key!r}"
            if variable is not None and os.environ.get(variable) is not None:
                return os.environ[variable], variable
            return default, variable or f"backend option {key!r}"

        transport = str(options.get("transport") or os.environ.get("TDIST_TRANSPORT") or "auto").lower()
        if transport not in choices["transport"]:
            raise ValueError(
                f"tdist: unknown transport {transport!r} (TDIST_TRANSPORT or the backend option "
                f"'transport'); expected one of {', '.join(choices['transport'])}")
        size = options.get("heap_size") or os.environ.get("TDIST_HEAP_SIZE")
        heap_bytes = None if size is None else parse_size(size)
        algorithm = _choice(*setting("algorithm", "TDIST_ALGORITHM", "auto"), choices["algorithm"])
        pusher, where = setting("bulk_push", None, None)
        pusher = _choice(pusher, where, choices["bulk_push"]) if pusher else None
        steps, where = setting("streamed_step_blocks", None, 1)
        if not str(steps).isdigit() or int(steps) < 1:  # ranks must agree on it too (they wait per step)
            raise ValueError(f"tdist: {where}={steps!r}; expected a whole number from 1")
        least, where = setting("streamed_min_block_bytes", None, 16384)
        low, high = choices["streamed_min_block_bytes"]
        if not str(least).isdigit() or not low <= int(least) <= high or int(least) & (int(least) - 1):
            raise ValueError(f"tdist: {where}={least!r}; expected a power of two from {low} to {high}")
        overlap = _choice(*setting("overlap", "TDIST_OVERLAP", "auto"), choices["overlap"])
        communication = _flag(*setting("communication", None, True))
        if not communication:  # (the other ways move data themselves, past the backend's calls)
            overlap = "sequential"
        check_calls = _flag(*setting("check_calls", "TDIST_CHECK_CALLS", False), lenient=True)
        gpu_kernels = _flag(*setting("gpu_kernels", "TDIST_GPU_KERNELS", True), lenient=True, on_unless_0=True)
        limits = _flag(*setting("gpu_size_limits", None, True), lenient=True, on_unless_0=True)
        uneven = _flag(*setting("uneven_all_to_all", None, True))  # (every rank must choose the same)
        tear_down = _flag(*setting("async_error_handling", "TDIST_ASYNC_ERROR_HANDLING", True))
        return cls(
            transport=transport,
            heap_bytes=heap_bytes,
            algorithm=algorithm,
            overlap=overlap,
            tear_down_on_timeout=tear_down,
            check_calls=check_calls,
            gpu_kernels=gpu_kernels,
            gpu_size_limits=limits,
            uneven_all_to_all=uneven,
            bulk_push=pusher,
            streamed_step_blocks=int(steps),
            streamed_min_block_bytes=int(least),  # ranks must agree on it (blocks are cut alike)
            dependent_launch=_flag(*setting("dependent_launch", None, True), lenient=True, on_unless_0=True),
            communication=communication,
        )


def _choice(value, where: str, allowed) -> str:
    value = str(value).lower()
    if value not in allowed:
        raise ValueError(f"tdist: {where}={value!r}; expected one of {', '.join(allowed)}")
    return value


def _flag(value, where: str, lenient: bool = False, on_unless_0: bool = False) -> bool:
    """A switch given as True/False, 1/0 or "1"/"0". ``lenient``: any other text is off (or on,
    with ``on_unless_0``), as those variables always read."""
    if isinstance(value, bool):
        return value
    text = str(value)
    if text in _OFF_ON:
        return _OFF_ON[text]
    if lenient:
        return on_unless_0
    raise ValueError(f"tdist: {where}={value!r}; expected 0 or 1")
