"""Messages larger than the symmetric heap's staging area go in several rounds, not errors.

The pools run with TDIST_HEAP_SIZE=16K (4 KiB of staging per rank), so every op below takes
several rounds (reduce_scatter and scatter stage one piece per rank in each round). The bulk
path (torch_tdist/bulk.py) serves large messages; TDIST_ALGORITHM=bulk makes it serve these
small ones too (with a 64K heap, still several rounds), and TDIST_ALGORITHM=streamed sends
all_gather, reduce_scatter, all_reduce and even all-to-alls through the streamed kernel (triton_kernels/streamed.py: with a
256K heap, several rounds of several steps). TDIST_ALGORITHM=lowlatency sends calls that fit its
slots through the low-latency kernel (triton_kernels/lowlatency.py), one launch each, and
TDIST_ALGORITHM=twoshot every all_reduce through the two-shot kernel (triton_kernels/twoshot.py).
"""

import pytest
import torch

from tests import jobs_large as J
from tests.helpers import ws_param
from tests.multiproc import RankPool, backend_under_test, shutdown_all

_POOLS = {}


def _pool(world_size, heap_size="16K", options=None, **env):
    """A pool whose ranks have ``env`` and a 16K heap, their default group made with the backend
    ``options``."""
    env = {"TDIST_HEAP_SIZE": heap_size, **env}
    key = (world_size, tuple(sorted(env.items())), tuple(sorted((options or {}).items())))
    if key not in _POOLS:
        _POOLS[key] = RankPool(world_size, backend_under_test(), env=env, pg_options=options,
                               name=f"RankPool(ws={world_size}, {env}, {options or {}})")
    return _POOLS[key]


@pytest.fixture
def small_heap_pool(world_size):
    yield _pool(world_size)


@pytest.fixture(params=["copy_engine", "sm"])
def bulk_pool(world_size, request):
    # 12 KiB of bulk slots after its flags; pushes by copies or by the push kernel
    yield _pool(world_size, "64K", {"bulk_push": request.param}, TDIST_ALGORITHM="bulk")


@pytest.fixture
def streamed_pool(world_size):
    yield _pool(world_size, "256K", TDIST_ALGORITHM="streamed")


@pytest.fixture
def lowlatency_pool(world_size):
    yield _pool(world_size, "1M", TDIST_ALGORITHM="lowlatency")  # 1-2 KB per slot


@pytest.fixture
def twoshot_pool(world_size):
    yield _pool(world_size, "64K", TDIST_ALGORITHM="twoshot")  # 512-1024 bytes a slot: several rounds


def teardown_module():
    shutdown_all(_POOLS.values())
    _POOLS.clear()


@pytest.mark.tdist_only
@pytest.mark.parametrize("world_size,n,dtype", [(2, 9000, "bfloat16"), (3, 5001, "float32")])
def test_every_op_in_rounds(small_heap_pool, n, dtype, seed):
    small_heap_pool.run(J.every_op_in_rounds, n, dtype, seed, timeout=120)


# (CI's time: every size on 2 ranks, a multi-chunk one on 4, the tiny one on 3 and 4)
@pytest.mark.tdist_only
@pytest.mark.parametrize("world_size,n,dtype", [(2, 5001, "float32"), (2, 9000, "bfloat16"), (2, 8, "float32"),
                                                (4, 5001, "float32"), (3, 8, "float32"), (4, 8, "float32")])
def test_bulk_path(bulk_pool, n, dtype, seed):
    bulk_pool.run(J.large_messages, n, dtype, seed, timeout=120)


# (CI's time: every size on 2 ranks, a multi-block size on 3, the tiny one on 3 and 4)
@pytest.mark.tdist_only
@pytest.mark.parametrize("world_size,n,dtype", [(2, 5001, "float32"), (2, 9000, "bfloat16"), (2, 8, "float32"),
                                                (3, 5001, "float32"), (3, 8, "float32"), (4, 8, "float32")])
def test_streamed_kernel(streamed_pool, n, dtype, seed):
    streamed_pool.run(J.large_messages, n, dtype, seed, timeout=120)


@pytest.mark.tdist_only
@pytest.mark.parametrize("world_size,n,dtype", [(2, 250, "float32"), (2, 500, "bfloat16"), (4, 64, "bfloat16")])
def test_lowlatency_kernel(lowlatency_pool, n, dtype, seed):
    lowlatency_pool.run(J.large_messages, n, dtype, seed, timeout=120)


@pytest.mark.tdist_only
@pytest.mark.parametrize("world_size,n,dtype", [(2, 5001, "float32"), (3, 9000, "bfloat16"), (4, 7, "float32")])
def test_twoshot_kernel(twoshot_pool, n, dtype, seed):
    twoshot_pool.run(J.large_messages, n, dtype, seed, timeout=120)


@pytest.mark.tdist_only
@ws_param([2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_all_to_all_with_split_sizes_larger_than_a_mailbox_goes_in_turns(streamed_pool, seed, dtype):
    for rank, (second, right) in enumerate(streamed_pool.run(J.uneven_all_to_all_in_turns, seed, dtype,
                                                             timeout=120)):
        assert right, f"rank {rank}: shares of 1-3 mailboxes and a bit: wrong, or not streamed"
        if rank == 1:  # the receiver whose splits were wrong
            assert "different call" in second and "all_to_all_single" in second, f"rank {rank}: {second}"


@pytest.mark.tdist_only
@ws_param([2])
def test_streamed_all_to_all_with_split_sizes_beside_one_without_raises(streamed_pool, seed):
    # the two kernels share flags and call words but lay blocks out otherwise
    for rank, (first, second) in enumerate(streamed_pool.run(J.all_to_all_with_and_without_split_sizes, seed,
                                                             timeout=60)):
        assert "different call" in first and "all_to_all_single" in first, f"rank {rank}: {first}"
        assert second, f"rank {rank}: the next all_to_all_single was wrong"


@pytest.mark.tdist_only
@ws_param([2, 3])
@pytest.mark.parametrize("kernel", ["streamed", "twoshot"])
@pytest.mark.parametrize("n0,n", [(100, 200), (4096, 8192)])  # the second: fewer rounds (or steps) against more
def test_calls_that_differ_across_ranks_raise_then_the_group_goes_on(request, world_size, kernel, seed, n0, n):
    pool = request.getfixturevalue(f"{kernel}_pool")
    for rank, (first, second) in enumerate(pool.run(J.mismatched_all_reduce_then_one_that_matches,
                                                    seed, n0, n, timeout=60)):
        assert "different call" in first and "all_reduce" in first, f"rank {rank}: {first}"
        assert second == "right", f"rank {rank}: the next all_reduce: {second}"


@pytest.mark.tdist_only
@ws_param([2, 3])
def test_twoshot_beside_oneshot_raises_on_every_rank(twoshot_pool, seed):
    # the two kernels share flags and call words but lay shares out otherwise
    for rank, outcome in enumerate(twoshot_pool.run(J.twoshot_beside_oneshot, seed, timeout=60)):
        assert "different call" in outcome and "TDIST_ALGORITHM" in outcome, f"rank {rank}: {outcome}"


@pytest.mark.tdist_only
@ws_param([2])
def test_every_op_in_rounds_on_bulk_path(bulk_pool, seed):
    bulk_pool.run(J.every_op_in_rounds, 5001, "float32", seed, timeout=120)


@pytest.mark.tdist_only
@ws_param([2, 3])
def test_bulk_calls_that_differ_across_ranks_raise_on_every_rank(world_size):
    # its own pool: the group stops after the error (the peers' flags are out of step)
    pool = _pool(world_size, "128K", TDIST_ALGORITHM="bulk")
    for rank, (first, second) in enumerate(pool.run(J.bulk_mismatched_then_refused, timeout=60)):
        assert "different call" in first[1] and "all_gather_into_tensor" in first[1], f"rank {rank}: {first}"
        assert "stopped" in second[1], f"rank {rank}: the next call was not refused: {second}"


@pytest.mark.tdist_only
@ws_param([3])
def test_all_to_all_too_large_for_a_mailbox_raises_on_its_two_ranks_only(small_heap_pool, seed):
    # 16K heap, 3 ranks: a mailbox holds 128 float32 elements
    results = small_heap_pool.run(J.all_to_all_too_large_for_a_mailbox, seed, 400, timeout=120)
    for rank, (first, right, second) in enumerate(results):
        if rank in (0, 1):
            assert "TDIST_HEAP_SIZE" in first and "all_to_all_single" in first and "400" in first, \
                f"rank {rank}: {first}"
        else:
            assert first == "returned", f"rank {rank}: {first}"
        assert right, f"rank {rank}: the rows of the pairs that fit are wrong"
        assert second, f"rank {rank}: the next all_to_all_single was wrong"


@pytest.mark.parametrize("min_bytes", [16384, 4096, 2048, 16])
def test_gpu_streamed_blocks_spread_a_short_share_over_the_programs(monkeypatch, min_bytes):
    """GPU launches (no interpreter) cut a streamed share into blocks of a power of two bytes, from
    ``min_bytes`` (the backend option streamed_min_block_bytes) to STREAMED_BLOCK_BYTES; a block smaller than
    that leaves no program without one and no more than one to a program."""
    from torch_tdist.collectives import streamed as C

    monkeypatch.setattr(C, "STREAMED_BLOCK", None)
    monkeypatch.setattr(C, "ONESHOT_PROGRAMS", 132)
    for dtype in (torch.bfloat16, torch.float32):
        for share in (4, 4096, 100_000, 128 << 10, (132 << 11) + 4, 1 << 20, 3 << 20, 64 << 20):
            n = share // dtype.itemsize
            nbytes = C.streamed_block(dtype, n, min_bytes) * dtype.itemsize
            assert nbytes & (nbytes - 1) == 0 and min_bytes <= nbytes <= C.STREAMED_BLOCK_BYTES, (share, nbytes)
            blocks = -(-share // nbytes)
            if nbytes < C.STREAMED_BLOCK_BYTES:
                assert blocks <= 132, (share, nbytes, blocks)
            if nbytes > min_bytes:
                assert blocks > 132 // 2, (share, nbytes, blocks)
