"""DTensor on init_device_mesh("cpu", (ws,)) (the default group, i.e. the backend
under test) and functional collectives, checked against plain tensors.  With
tdist, torch_tdist.stats() must show every call served by tdist kernels."""

from __future__ import annotations

import pytest

from tests import jobs_dtensor as J
from tests.helpers import assert_served_by_tdist, skip_unless_tdist, ws_param

DTYPES = ["float32", "bfloat16"]


@ws_param([2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtensor_redistribute(pool, dtype, seed):
    diffs = pool.run(J.dtensor_redistribute, dtype, seed)
    skip_unless_tdist("DTensor collectives served by tdist kernels")
    # distribute_tensor: scatter (Shard) and broadcast (Replicate); Shard->Replicate,
    # Shard->Shard on CPU and full_tensor: all_gather; Partial->Replicate: all_reduce;
    # Partial->Shard: reduce_scatter.
    assert_served_by_tdist(diffs, ["scatter", "broadcast", "all_gather_into_tensor", "all_reduce",
                                   "reduce_scatter_tensor"], "DTensor")


@ws_param([2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_functional_collectives(pool, dtype, seed):
    diffs = pool.run(J.functional_collectives, dtype, seed)
    skip_unless_tdist("functional collectives served by tdist kernels")
    assert_served_by_tdist(diffs, ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                                   "all_to_all_single"], "functional collectives")


@ws_param([2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_coalesced_collectives(pool, dtype, seed):
    diffs = pool.run(J.coalesced_collectives, dtype, seed)
    skip_unless_tdist("coalesced collectives served by tdist kernels")
    assert_served_by_tdist(diffs, ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"],
                           "coalesced collectives")


@ws_param([2, 3])
def test_fsdp2_training_steps(pool, seed):
    diffs = pool.run(J.fsdp2_step, seed)
    skip_unless_tdist("FSDP2 collectives served by tdist kernels")
    assert_served_by_tdist(diffs, ["all_gather_into_tensor", "reduce_scatter_tensor"], "FSDP2")
