"""Every kernel compiles for Hopper (sm_90) on this GPU-less machine, as on the device, and for AMD's
MI300 (gfx942), where no GPU of ours runs them."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILE_ENV = dict(os.environ, TDIST_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")


@pytest.mark.timeout(660)  # a cold Triton cache: 4-5 minutes on 2 cores
def test_kernels_compile_for_sm90():
    proc = subprocess.run([sys.executable, "-m", "tests.compile_kernels", "90"], cwd=ROOT, env=COMPILE_ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled" in proc.stdout


@pytest.mark.timeout(300)
def test_kernels_compile_without_dependent_launch():
    """Where kernels have no programmatic dependent launch (AMD GPUs), wait_prior_kernels and
    start_next_kernel are no-ops that must compile too (they were plain Python functions, which a
    compiled kernel may not call). The one-shot kernel calls both."""
    code = ("import sys; sys.argv[1:] = ['gfx942']; import tests.compile_kernels as ck; "
            "from torch_tdist import language; assert not language.DEPENDENT_LAUNCH; "
            "ck.compile_first('oneshot_kernel', 'gfx942'); print('compiled')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=COMPILE_ENV, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled" in proc.stdout


@pytest.mark.timeout(660)  # a cold Triton cache: 3-4 minutes on 2 cores
def test_kernels_compile_for_amd_mi300():
    proc = subprocess.run([sys.executable, "-m", "tests.compile_kernels", "gfx942"], cwd=ROOT, env=COMPILE_ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled" in proc.stdout and "for gfx942" in proc.stdout
