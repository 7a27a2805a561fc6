"""What tdist does not serve itself goes to the inner fallback backend (Gloo on
CPU) and is counted under "fallback" in torch_tdist.stats(); what it serves is
counted under "tdist".  The data is checked with every backend; the stats
assertions are tdist-only."""

from __future__ import annotations

import pytest

from tests import jobs_fallback as J
from tests.common import STATS_OPS
from tests.helpers import assert_routed, assert_served_by_tdist, skip_unless_tdist, ws_param


@ws_param([2, 3])
def test_send_recv_fallback(pool, seed):
    diffs = pool.run(J.send_recv, seed)
    skip_unless_tdist("stats() fallback accounting")
    assert_routed(diffs, ["send", "recv"], "fallback", "send/recv")


@ws_param([2, 3])
def test_all_reduce_int8_sum_fallback(pool, seed):
    diffs = pool.run(J.int8_sum, seed)
    skip_unless_tdist("stats() fallback accounting")
    assert_routed(diffs, ["all_reduce"], "fallback", "all_reduce(int8, SUM)")


@ws_param([2, 3])
def test_all_reduce_band_int32_fallback(pool, seed):
    diffs = pool.run(J.band_int32, seed)
    skip_unless_tdist("stats() fallback accounting")
    assert_routed(diffs, ["all_reduce"], "fallback", "all_reduce(int32, BAND)")


COLLECTIVES = [op for op in STATS_OPS if op not in ("send", "recv")]


@ws_param([3])
@pytest.mark.parametrize("op", COLLECTIVES)
def test_float32_collective_served_by_tdist(pool, op, seed):
    diffs = pool.run(J.served_by_tdist, op, seed)
    skip_unless_tdist("stats() accounting of collectives tdist serves")
    assert_served_by_tdist(diffs, [op], f"{op} (float32, SUM)")
