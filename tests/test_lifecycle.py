"""Creating and destroying tdist subgroups again and again leaks neither mappings nor memory."""

import os

import pytest

from tests import jobs_lifecycle as J
from tests.helpers import ws_param


@pytest.mark.tdist_only
@ws_param([2, 3])
def test_subgroup_create_destroy_cycles(pool, seed):
    before = set(os.listdir("/dev/shm"))
    results = pool.run(J.subgroup_cycles, 100, seed, timeout=240)
    for rank, r in enumerate(results):
        assert r["maps"] == 0, f"rank {rank}: {r['maps']} heap mappings outlived their groups"
        assert r["rss_growth_mb"] < 64, f"rank {rank}: memory grew by {r['rss_growth_mb']:.0f} MB over 90 cycles"
    assert not (set(os.listdir("/dev/shm")) - before), "segments left in /dev/shm"


def _reinit_rank(rank, world, tmp, results):
    import torch
    import torch.distributed as dist

    import torch_tdist  # noqa: F401

    sums = []
    for i in range(3):
        dist.init_process_group("tdist", store=dist.FileStore(os.path.join(tmp, f"store{i}"), world),
                                rank=rank, world_size=world)
        x = torch.full((1000,), float(rank + i))
        dist.all_reduce(x)
        sums.append(x[0].item())
        dist.destroy_process_group()
    from torch_tdist.transports.shm import mapped_segments

    results.put((rank, sums, mapped_segments()))  # (heap segments only: not files under a tdist-* folder)


@pytest.mark.tdist_only
def test_destroy_and_init_again_in_one_process():
    import multiprocessing as mp
    import tempfile

    world = 2
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_reinit_rank, args=(r, world, tmp, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive and all(p.exitcode == 0 for p in procs), "a rank hung or failed"
    reports = [results.get() for _ in range(world)]
    for rank, sums, maps in reports:
        assert sums == [sum(range(world)) + world * i for i in range(3)], f"rank {rank}: {sums}"
        assert maps == 0, f"rank {rank}: {maps} heap mappings outlived the destroyed groups"


@pytest.mark.tdist_only
@pytest.mark.parametrize("world_size", [2])
def test_abort_ends_a_waiting_call_and_the_group_refuses_work(world_size):
    """ProcessGroupTDist.abort() sets the group's abort word: a call waiting for a peer that
    never comes gives up at once (not after the 60 s timeout), and every later call raises,
    whether tdist, the fallback or an overlapped op of torch_tdist.ops would serve it."""
    from tests.multiproc import RankPool, backend_under_test

    pool = RankPool(world_size, backend_under_test(), name="RankPool(abort)", env={"TDIST_TEST_POOL": "abort"})
    try:
        first, waited, later, fallback, fused = pool.run(J.abort_unblocks_a_waiting_call, timeout=60)[0]
    finally:
        pool.shutdown()
    assert "aborted" in first and "all_reduce" in first, first
    assert 0.5 < waited < 10, f"the aborted call waited {waited:.1f} s"
    for message in (later, fallback):
        assert "this group was aborted (abort() was called)" in message and "all_reduce" in message, message
    assert "tdist all_gather_matmul: this group was aborted (abort() was called)" in fused, fused
