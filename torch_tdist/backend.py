"""Registration of the "tdist" c10d backend and access to a group's backend.

``register()`` makes ``dist.init_process_group("tdist")``, ``"cpu:tdist"`` and
``dist.new_group(backend="tdist")`` build a :class:`torch_tdist._C.ProcessGroupTDist`.
Each one gets an executor (``torch_tdist.collectives.Executor`` unless
:func:`set_executor_factory` chose another) and a fallback backend per device type
(Gloo for "cpu"; NCCL for "cuda" when torch has it and CUDA is available) that serves
what tdist does not.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _C

__all__ = ["register", "stats", "reset_stats", "get_executor", "set_executor_factory", "set_default_options"]

BACKEND_NAME = "tdist"
DEVICES = ["cpu", "cuda"]
_FALLBACK_PREFIX = "tdist_fallback/"

# Called as factory(store, rank, world_size, timeout), plus options=... when the
# group was created with pg_options. None means torch_tdist.collectives.Executor.
_executor_factory: Callable[..., Any] | None = None


def set_executor_factory(factory: Callable[..., Any] | None):
    """Use ``factory`` to build the executor of tdist groups created from now on
    (``None`` restores the default). Returns the previous factory."""
    global _executor_factory
    previous, _executor_factory = _executor_factory, factory
    return previous


def register() -> None:
    """Register the "tdist" backend with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    try:
        dist.Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=True, devices=DEVICES
        )
    except ValueError as err:  # older torch raises when the name exists
        if "already" not in str(err):
            raise


def _make_executor(store, rank: int, size: int, timeout: timedelta, options):
    factory = _executor_factory
    if factory is None:
        from .collectives import Executor as factory
    if options is None:
        executor = factory(store, rank, size, timeout)
    else:
        executor = factory(store, rank, size, timeout, options=options)
    _check_transport(executor)
    return executor


def _check_transport(executor):
    """Raise now, at init_process_group / new_group, when the transport the group's heap will
    use (created at its first collective) cannot start on a device the group serves. A GPU
    group's ranks first tell each other their build of PyTorch and host: a group mixing ROCm and
    CUDA raises here, and ``auto`` is checked as the transport it will pick (one host or several)."""
    from . import heap, transports

    transport = getattr(executor, "transport", None)
    if transport is None:  # (an executor of set_executor_factory's without a heap)
        return
    store, rank, world, timeout = (getattr(executor, name, None) for name in ("store", "rank", "world_size", "timeout"))
    for device_type in getattr(executor, "served_devices", []):
        hosts = []
        if device_type == "cuda" and timeout is not None:  # (an executor of set_executor_factory's may lack them)
            try:
                hosts = heap.gpu_hosts(store, "tdist_group", rank, world, timeout)
            except transports.PeersMissing as err:
                raise dist.DistBackendError(f"tdist: Timed out after {timeout.total_seconds():g} s while "
                                            f"creating the group (rank {rank} of {world}): {err}") from err
        transports.check_available(transport, device_type, getattr(executor, "heap_bytes", None),
                                   spans_nodes=len(set(hosts)) > 1)


def _make_fallbacks(dist_opts, devices: list[str]) -> dict[str, dist.Backend]:
    store = dist.PrefixStore(_FALLBACK_PREFIX, dist_opts.store)
    rank, size, timeout = dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout
    name = f"{dist_opts.group_id}:{_FALLBACK_PREFIX.rstrip('/')}"
    ranks = list(dist_opts.global_ranks_in_group)
    fallbacks = {}
    if "cpu" in devices and dist.is_gloo_available():
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        gloo.options.global_ranks_in_group = ranks
        gloo.options.group_name = name
        fallbacks["cpu"] = gloo
    if "cuda" in devices and dist.is_nccl_available() and torch.cuda.is_available():
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        opts.global_ranks_in_group = ranks
        opts.group_name = name
        fallbacks["cuda"] = dist.ProcessGroupNCCL(store, rank, size, opts)
    return fallbacks


def set_default_options(options: dict | None) -> dict | None:
    """Backend options for the tdist groups created from now on without ``pg_options`` (the
    groups a framework makes itself: torch_tdist.titan's ``--no-communication``). ``None``
    restores none. Returns the previous ones."""
    global _default_options
    previous, _default_options = _default_options, (dict(options) if options else None)
    return previous


_default_options: dict | None = None


def _create_backend(dist_opts, backend_options):
    """The extended-API creator c10d calls once per group."""
    if backend_options is None:
        backend_options = _default_options
    store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout
    devices = list(dist.Backend.backend_capability.get(BACKEND_NAME, DEVICES))
    executor = _make_executor(store, rank, size, timeout, backend_options)
    served = [d for d in getattr(executor, "served_devices", []) if d in devices]
    fallbacks = _make_fallbacks(dist_opts, devices)
    pg = _C.ProcessGroupTDist(store, rank, size, timeout, executor, fallbacks, served, devices)
    for op, (max_bytes, served_from) in getattr(executor, "gpu_size_limits", {}).items():
        pg.set_gpu_size_limit(op, -1 if max_bytes is None else max_bytes, -1 if served_from is None else served_from)
    pg.set_gpu_uneven_all_to_all(getattr(executor, "gpu_uneven_all_to_all", True))
    config = getattr(executor, "config", None)
    pg.set_communication(getattr(config, "communication", True))
    return pg


# TORCH_DISTRIBUTED_DEBUG=DETAIL wraps backends in a _ProcessGroupWrapper.
_WRAPPER = getattr(torch._C._distributed_c10d, "_ProcessGroupWrapper", None)
_DEVICES = [torch.device(d) for d in DEVICES]  # (made once: the overlapped ops look a group up per call)


def _unwrap(backend):
    while _WRAPPER is not None and isinstance(backend, _WRAPPER):
        backend = backend.wrapped_pg
    return backend


def _tdist_backend(group=None) -> _C.ProcessGroupTDist:
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("torch_tdist: this rank is not a member of the group (new_group returned "
                         "GroupMember.NON_GROUP_MEMBER to it)")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    found = []
    for device in _DEVICES:
        try:
            backend = _unwrap(pg._get_backend(device))
        except RuntimeError:
            continue
        if isinstance(backend, _C.ProcessGroupTDist):
            return backend
        found.append(f"{device}:{backend.name()}")
    name = getattr(pg, "group_name", "?")
    raise ValueError(
        f"torch_tdist: process group {name!r} is not a tdist group "
        f"(its backends: {', '.join(found) or 'none'})"
    )


def is_tdist_group(group=None) -> bool:
    """Whether ``group`` (None: the default group) is served by tdist."""
    try:
        _tdist_backend(group)
    except ValueError:
        return False
    return True


def stats(group=None) -> dict[str, dict[str, int]]:
    """How many calls of each op tdist served and how many went to the fallback
    backend: ``{op: {"tdist": n, "fallback": m}}``. ``group=None``: the default group."""
    return _tdist_backend(group).stats()


def reset_stats(group=None) -> None:
    """Zero the counters of :func:`stats`."""
    _tdist_backend(group).reset_stats()


def get_executor(group=None):
    """The executor object that runs a tdist group's collectives."""
    return _tdist_backend(group).executor
