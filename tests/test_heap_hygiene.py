"""Nothing may stay in /dev/shm: tdist's shm transport unlinks each segment as
soon as every peer has mapped it (DESIGN.md, "The symmetric heap"), so a crash
cannot leak it.  Checked through each rank's /proc/self/maps (immune to other
processes using /dev/shm).  Holds for any backend, so it runs with gloo too."""

from __future__ import annotations

import os

import pytest

from tests import jobs_heap as J


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_shm_segments_are_unlinked_once_mapped(pool3, backend):
    res = pool3.run(J.shm_mappings_while_group_alive, backend)
    for r, x in enumerate(res):
        assert not x["still_linked"], (
            f"rank {r}: mapped /dev/shm segments still have a name (would survive a crash): {x['still_linked']}")
