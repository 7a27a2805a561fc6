"""Jobs for test_lifecycle.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from torch_tdist.transports.shm import mapped_segments


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def subgroup_cycles(rank, ws, cycles, seed):
    """Create a tdist subgroup, use it, destroy it, ``cycles`` times; report what stayed."""
    xs = [torch.randn(4096, generator=torch.Generator().manual_seed(seed + r)) for r in range(ws)]
    start_maps, start_rss = mapped_segments(), _rss_mb()
    for i in range(cycles):
        group = dist.new_group(list(range(ws)), backend="tdist")
        x = xs[rank].clone()
        dist.all_reduce(x, group=group)
        assert torch.allclose(x, sum(xs), rtol=1e-5, atol=1e-5), f"cycle {i}: wrong all_reduce"
        dist.destroy_process_group(group)
        if i == 9:
            warm_rss = _rss_mb()  # allocator pools and caches have settled by now
    return {"maps": mapped_segments() - start_maps, "rss_growth_mb": _rss_mb() - warm_rss,
            "start_rss_mb": start_rss}


def abort_unblocks_a_waiting_call(rank, ws):
    """On a fresh subgroup, rank 0 starts an all_reduce the others never join and aborts the
    group from another thread 1 s later. Returns (first call's error, seconds it waited, the
    errors of a later all_reduce, a later fallback call and a later overlapped
    all_gather_matmul) on rank 0, None elsewhere."""
    import threading
    import time

    import torch_tdist.ops
    from torch_tdist.backend import _tdist_backend, get_executor

    g = dist.new_group(backend="tdist")
    x = torch.ones(1000)
    dist.all_reduce(x, group=g)  # the heap exists, the kernel is compiled
    assert x[0].item() == ws
    if rank != 0:
        time.sleep(3)
        return None
    get_executor(g).overlap = "fused"  # (the CPU's default runs the sequential path's collective)
    threading.Timer(1.0, _tdist_backend(g).abort).start()
    errors = []
    start = time.monotonic()
    for call in (lambda: dist.all_reduce(x, group=g),
                 lambda: dist.all_reduce(x, group=g),
                 lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), group=g),  # Gloo's
                 lambda: torch_tdist.ops.all_gather_matmul(torch.randn(4, 8), torch.randn(8, 8), group=g)):
        try:
            call()
            errors.append("no error")
        except Exception as err:  # noqa: BLE001 - the test checks the message
            errors.append(f"{type(err).__name__}: {err}")
        if len(errors) == 1:
            waited = time.monotonic() - start
    return errors[0], waited, errors[1], errors[2], errors[3]
