"""Jobs for test_heap_hygiene.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

SHM = "/dev/shm"


def _shm_mappings():
    """{path: deleted?} for every /dev/shm file mapped into this process."""
    out = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(None, 5)
            if len(parts) < 6:
                continue
            path = parts[5]
            deleted = path.endswith(" (deleted)")
            if deleted:
                path = path[: -len(" (deleted)")]
            if path.startswith(SHM + "/"):
                out[path] = deleted or not os.path.exists(path)
    return out


def shm_mappings_while_group_alive(rank, ws, backend):
    """Make a fresh group, run a collective on it (its heap exists and every peer
    has mapped it), then report this process's /dev/shm mappings that still have
    a name in /dev/shm."""
    g = dist.new_group(list(range(ws)), backend=backend)
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, group=g)
    assert torch.all(t == ws * (ws + 1) / 2), t
    dist.barrier(group=g)
    maps = _shm_mappings()
    dist.barrier(group=g)
    dist.destroy_process_group(g)
    return {"mapped": len(maps), "still_linked": sorted(p for p, gone in maps.items() if not gone)}
