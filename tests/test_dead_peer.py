"""A rank killed with SIGKILL in the middle of the job: the survivors raise within the group's
timeout (plus slack), name the op and the rank that did not arrive, refuse further work, and
exit; nothing is left in /dev/shm."""

import multiprocessing as mp
import os
import signal
import tempfile
import time
from datetime import timedelta

import pytest

TIMEOUT_S = 4
DEAD_RANK = 1  # not the last rank: a wrong slot would name it by chance
SLACK_S = 10


def _rank(rank, world, store_path, op, results):
    import torch
    import torch.distributed as dist

    import torch_tdist  # noqa: F401
    from torch_tdist.compat import all_gather_single, reduce_scatter_single

    op, _, algorithm = op.partition(" ")  # e.g. "all_reduce streamed": TDIST_ALGORITHM=streamed
    os.environ["TDIST_ALGORITHM"] = algorithm or "auto"
    dist.init_process_group("tdist", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    x = torch.randn(64)
    dist.all_reduce(x)  # the heap is up and every rank is here
    if rank == DEAD_RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    calls = {
        "all_gather": lambda: all_gather_single(torch.empty(64 * world), x),
        "reduce_scatter": lambda: reduce_scatter_single(torch.empty(64 // world * 1), x[: 64 // world * world]),
        "all_reduce": lambda: dist.all_reduce(x),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty(63), x[:63]),
    }
    start = time.monotonic()
    try:
        calls[op]()
        first = ("returned",)
    except Exception as err:  # noqa: BLE001  (the parent inspects it)
        first = ("raised", type(err).__name__, str(err)[:300], time.monotonic() - start)
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        second = ("returned",)
    except Exception as err:  # noqa: BLE001
        second = ("raised", type(err).__name__, str(err)[:300], time.monotonic() - start)
    results.put((rank, first, second))
    os._exit(0)  # no destroy_process_group: the fallback backend would wait for the dead rank


def _run_ranks(target, world, *args):
    """Runs ``target(rank, world, store_path, *args, results)`` in ``world`` processes; returns
    ``{rank: report}`` of the ranks that reported, after checking every process exited."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=target, args=(r, world, os.path.join(tmp, "store"), *args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        for p in procs:
            p.join(max(1, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            p.kill()
        assert not alive, f"ranks {alive} did not exit (a survivor hangs)"
    reports = {}
    while not results.empty():
        rank, *report = results.get()
        reports[rank] = report
    return reports


@pytest.mark.tdist_only
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all",
                                "reduce_scatter streamed", "all_reduce streamed", "all_reduce twoshot"])
def test_survivors_raise_when_a_peer_is_killed(op):
    world = 3
    before = set(os.listdir("/dev/shm"))
    reports = _run_ranks(_rank, world, op)
    assert sorted(reports) == [r for r in range(world) if r != DEAD_RANK], f"survivors that reported: {sorted(reports)}"
    for rank, (first, second) in reports.items():
        assert first[0] == "raised", f"rank {rank}: {op} returned although a peer was dead"
        assert first[1] == "DistBackendError" and "Timed out" in first[2], f"rank {rank}: not in torch's words: {first}"
        assert "tdist" in first[2] and op.split()[0] in first[2], f"rank {rank}: {first}"
        assert "group '" in first[2] and "group '?'" not in first[2], f"rank {rank}: the group not named: {first}"
        assert f"rank(s) {DEAD_RANK} did not arrive" in first[2], f"rank {rank}: the dead rank not named: {first}"
        assert first[3] <= TIMEOUT_S + SLACK_S, f"rank {rank}: raised after {first[3]:.1f} s"
        assert second[0] == "raised" and "stopped" in second[2], f"rank {rank}: next call {second}"
        assert second[3] < 1, f"rank {rank}: the refusal took {second[3]:.1f} s"
    assert not (set(os.listdir("/dev/shm")) - before), "shared-memory segments were left behind"


def _rank_dies_setting_up(rank, world, store_path, results):
    import torch
    import torch.distributed as dist

    import torch_tdist  # noqa: F401
    from torch_tdist import heap

    if rank == world - 1:  # dies with its segment created and named, before the peers mapped it
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        heap._ShmSegment.open = die
    dist.init_process_group("tdist", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    start = time.monotonic()
    try:
        dist.all_reduce(torch.randn(64))  # the first call sets the heap up
        outcome = ("returned",)
    except Exception as err:  # noqa: BLE001  (the parent inspects it)
        outcome = ("raised", type(err).__name__, str(err)[:300], time.monotonic() - start)
    results.put((rank, outcome))
    os._exit(0)


@pytest.mark.tdist_only
def test_a_rank_killed_while_the_heap_is_set_up_leaves_nothing_in_dev_shm():
    world = 3
    before = set(os.listdir("/dev/shm"))
    reports = {rank: outcome for rank, (outcome,) in _run_ranks(_rank_dies_setting_up, world).items()}
    assert sorted(reports) == list(range(world - 1)), f"survivors that reported: {sorted(reports)}"
    for rank, outcome in reports.items():
        assert outcome[0] == "raised", f"rank {rank}: the heap was set up although a peer was dead"
        assert outcome[1] == "DistBackendError" and "Timed out" in outcome[2], f"rank {rank}: {outcome}"
        assert f"rank(s) {world - 1} did not arrive" in outcome[2] and "all_reduce" in outcome[2], f"rank {rank}: {outcome}"
        assert outcome[3] <= TIMEOUT_S + SLACK_S, f"rank {rank}: raised after {outcome[3]:.1f} s"
    assert not (set(os.listdir("/dev/shm")) - before), "the dead rank's segment was left behind"


def test_the_gpu_heap_rendezvous_waits_for_missing_ranks_no_longer_than_the_group_timeout():
    """A CUDA group first asks where every rank runs (to pick a transport): a rank that never
    comes makes the others raise at the group's timeout, not the store's (30 min by default)."""
    import torch.distributed as dist

    from torch_tdist.heap import gpu_hosts
    from torch_tdist.transports import PeersMissing

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    start = time.monotonic()
    with pytest.raises(PeersMissing, match=r"rank\(s\) 1 did not arrive"):
        gpu_hosts(store, "heap", 0, 2, timedelta(seconds=TIMEOUT_S))
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S


def _rank_never_calls(rank, world, store_path, first_call, results):
    import torch
    import torch.distributed as dist

    import torch_tdist  # noqa: F401

    dist.init_process_group("tdist", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    if not first_call:
        dist.all_reduce(torch.randn(64))  # the heap is up and every rank is here
    if rank == DEAD_RANK:  # alive, but never makes the call
        time.sleep(TIMEOUT_S + 2)
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.randn(64))
        outcome = ("returned",)
    except Exception as err:  # noqa: BLE001  (the parent inspects it)
        outcome = ("raised", type(err).__name__, str(err)[:400], time.monotonic() - start)
    results.put((rank, outcome))
    os._exit(0)


@pytest.mark.tdist_only
@pytest.mark.parametrize("first_call", [True, False], ids=["heap set-up", "kernel wait"])
def test_a_peer_that_never_calls_gives_torchs_timeout_error(first_call):
    """As torch's backends report timeouts (DistBackendError, "Timed out"), so elastic agents and
    retry code recognise them: at the heap's set-up by the first call, and in a kernel's wait,
    naming the op, the group, the rank that did not arrive and the timeout."""
    world = 2
    reports = {rank: outcome for rank, (outcome,) in _run_ranks(_rank_never_calls, world, first_call).items()}
    outcome = reports[0]
    assert outcome[0] == "raised", f"rank 0 returned although rank {DEAD_RANK} never called"
    assert outcome[1] == "DistBackendError", outcome
    for words in ("Timed out", f"after {TIMEOUT_S} s", "tdist all_reduce", "group '",
                  f"rank(s) {DEAD_RANK} did not arrive"):
        assert words in outcome[2], f"{words!r} not in {outcome[2]!r}"
    assert TIMEOUT_S - 1 <= outcome[3] <= TIMEOUT_S + SLACK_S, f"raised after {outcome[3]:.1f} s"
