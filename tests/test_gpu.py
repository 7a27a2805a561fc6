"""GPU checks against NCCL (tests/gpu_checks.py) on 2 GPUs (float32 and bfloat16) and on 4
(every dtype), one process per GPU.

Marked ``gpu``; skipped on machines with fewer GPUs. The device script runs them:
``bash benchmarks/device_run.sh test``.
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [2, 4])
def test_gpu_checks_against_nccl(nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs, this machine has {torch.cuda.device_count()}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **SAFE_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "-m", "tests.gpu_checks"] + (["--quick"] if nproc == 2 else []),
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-20000:], proc.stderr[-5000:])
    assert proc.returncode == 0, f"GPU checks failed on {nproc} ranks:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
