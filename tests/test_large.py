"""Messages larger than the symmetric heap's staging area go in several rounds, not errors.

The pool runs with TDIST_HEAP_SIZE=16K (8 KiB of staging per rank), so every op below takes
several rounds (reduce_scatter and scatter stage one piece per rank in each round).
"""

import pytest

from tests import jobs_large as J
from tests.helpers import ws_param
from tests.multiproc import RankPool, backend_under_test

_POOLS = {}


@pytest.fixture
def small_heap_pool(world_size):
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size, backend_under_test(), env={"TDIST_HEAP_SIZE": "16K"},
                                      name=f"RankPool(ws={world_size}, TDIST_HEAP_SIZE=16K)")
    yield _POOLS[world_size]


def teardown_module():
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()


@pytest.mark.tdist_only
@ws_param([2, 3])
@pytest.mark.parametrize("n,dtype", [(5001, "float32"), (9000, "bfloat16")])
def test_every_op_in_rounds(small_heap_pool, n, dtype, seed):
    small_heap_pool.run(J.every_op_in_rounds, n, dtype, seed, timeout=120)
