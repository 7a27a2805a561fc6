"""A short soak in CI: 150 random collectives on 3 CPU ranks (the device runs 10,000 on GPUs)."""

import os
import random
import subprocess
import sys

import pytest

from torch_tdist.heap import shm_segment_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.tdist_only
def test_short_soak_matches_and_leaks_nothing():
    seed = int(os.environ.get("TDIST_TEST_SEED") or random.SystemRandom().randrange(1, 2**31))
    before = shm_segment_names()
    proc = subprocess.run([sys.executable, "-m", "torch_tdist.soak", "--nproc", "3", "--steps", "150",
                           "--seed", str(seed)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"seed {seed}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "soak passed" in proc.stdout, proc.stdout
    assert not shm_segment_names() - before, "the soak's processes left segments in /dev/shm"
