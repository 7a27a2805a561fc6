"""Jobs for test_harness.py (the RankPool's own tests)."""

from __future__ import annotations

import os
import time


def echo(rank, ws, *args, **kwargs):
    import torch.distributed as dist

    return {"rank": rank, "ws": ws, "dist_rank": dist.get_rank(), "args": args, "kwargs": kwargs,
            "pid": os.getpid()}


def raise_on(rank, ws, ranks, exc_name="ValueError"):
    if rank in ranks:
        raise {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}[exc_name](
            f"boom from rank {rank}")
    return "fine"


def sleep_on(rank, ws, ranks, seconds):
    if rank in ranks:
        time.sleep(seconds)
    return "awake"


def exit_on(rank, ws, ranks, code):
    if rank in ranks:
        os._exit(code)
    return "alive"


def unpicklable_result(rank, ws):
    return lambda: None


def break_group(rank, ws):
    """Leave the default group in a state where collectives silently do nothing
    (an abandoned coalescing context), then raise."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    _world.pg_coalesce_state.setdefault(dist.group.WORLD, [])
    raise RuntimeError("left the group broken")
