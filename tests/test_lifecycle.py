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
