"""Every kernel compiles, on this GPU-less machine, for Hopper (sm_90), as on the device, and for
each AMD architecture tdist supports (language.AMD_ARCHS: MI300X, MI355X), where no GPU of ours
runs them; a ROCm GPU of another architecture is refused."""

import os
import subprocess
import sys

import pytest

from torch_tdist.language import AMD_ARCHS, check_amd_arch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILE_ENV = dict(os.environ, TDIST_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")


@pytest.mark.timeout(960)  # a cold Triton cache: 7-8 minutes on 2 cores
def test_kernels_compile_for_sm90_and_amd():
    """One run for every target (NVIDIA's and AMD's at once), so that the cores stay busy to the end."""
    proc = subprocess.run([sys.executable, "-m", "tests.compile_kernels", "90", "amd"], cwd=ROOT, env=COMPILE_ENV,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for target in ("sm_90", *AMD_ARCHS):
        assert f"kernel specialisations for {target}" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_kernels_compile_without_dependent_launch():
    """Where kernels have no programmatic dependent launch (AMD GPUs), wait_prior_kernels and
    start_next_kernel are no-ops that must compile too (they were plain Python functions, which a
    compiled kernel may not call). The one-shot kernel calls both."""
    code = (f"import sys; sys.argv[1:] = ['{AMD_ARCHS[0]}']; import tests.compile_kernels as ck; "
            "from torch_tdist import language; assert not language.DEPENDENT_LAUNCH; "
            f"ck.compile_first('oneshot_kernel', '{AMD_ARCHS[0]}'); print('compiled')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=COMPILE_ENV, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled" in proc.stdout


@pytest.mark.parametrize("arch", AMD_ARCHS + tuple(f"{arch}:sramecc+:xnack-" for arch in AMD_ARCHS))
def test_supported_amd_arch_accepted(arch):
    check_amd_arch(arch)


@pytest.mark.parametrize("arch", ["gfx90a", "gfx90a:sramecc+:xnack-", "gfx1100", "gfx94", "gfx9420", ""])
def test_other_amd_arch_refused_by_name(arch):
    with pytest.raises(ValueError) as raised:
        check_amd_arch(arch)
    message = str(raised.value)
    assert f"this GPU is {arch.split(':')[0] or repr(arch)};" in message
    assert ", ".join(AMD_ARCHS) in message and "language.AMD_ARCHS" in message
