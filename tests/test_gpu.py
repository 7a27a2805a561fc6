"""GPU checks against NCCL (tests/gpu_checks.py), one process per GPU: the cuda transport on 2
GPUs (float32 and bfloat16) and on 4 (every dtype); the nvshmem transport on 2 (torch's NVSHMEM
symmetric memory started first) and on 4 (tdist first), with the NVSHMEM calls, the
hierarchical all-gather and the MoE example; the bad-input matrix on CUDA tensors
(tests/gpu_bad_input.py, 2 GPUs); and a rank killed in the middle of collectives
(tests/gpu_dead_peer.py); DTensor styles and compiled async TP (tests/gpu_integrations.py).

Marked ``gpu``; skipped on machines with fewer GPUs. The device script runs them:
``bash benchmarks/device_run.sh test``.
"""

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from torch_tdist.launch import SAFE_ENV

pytestmark = pytest.mark.gpu
DEAD_RANK = 1  # the rank tests/gpu_dead_peer.py kills (not the last: a wrong slot would name it by chance)


RUNS = {  # id: (ranks, transport, extra arguments)
    "2-cuda": (2, "cuda", ["--quick"]),
    "4-cuda": (4, "cuda", []),
    "2-nvshmem-torch-first": (2, "nvshmem", ["--quick", "--symm-mem-first"]),
    "4-nvshmem": (4, "nvshmem", ["--quick"]),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", list(RUNS))
def test_gpu_checks_against_nccl(run):
    nproc, transport, extra = RUNS[run]
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs, this machine has {torch.cuda.device_count()}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **SAFE_ENV, "TDIST_TRANSPORT": transport}
    # Output streams to the terminal (run with -s), so a hang shows where it stopped.
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", "tests.gpu_checks"] + extra, cwd=root, env=env, timeout=900)
    assert proc.returncode == 0, f"GPU checks failed on {nproc} ranks ({transport}); their output is above"


@pytest.mark.timeout(600)
def test_gpu_integrations():
    """torch_tdist.parallel's styles against torch's on NCCL, and a block compiled with
    torch_tdist.async_tp.enable running tdist's fused ops (tests/gpu_integrations.py), bf16."""
    nproc = min(torch.cuda.device_count(), 4)
    if nproc < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **SAFE_ENV, "TDIST_TRANSPORT": "cuda"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", "tests.gpu_integrations"], cwd=root, env=env, timeout=600)
    assert proc.returncode == 0, f"GPU integration checks failed on {nproc} ranks; their output is above"


@pytest.mark.timeout(300)
def test_gpu_bad_input():
    """Every bad-input case on CUDA tensors raises on every rank within seconds (tests/gpu_bad_input.py)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **SAFE_ENV, "TDIST_TRANSPORT": "cuda"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "tests.gpu_bad_input"], cwd=root, env=env, timeout=300)
    assert proc.returncode == 0, "GPU bad-input checks failed; their output is above"


def _dead_peer_ranks(transport: str, env: dict, limit_s: float, capture: bool = False) -> list:
    """tests/gpu_dead_peer.py on 4 GPUs (2 if fewer), plain processes: (exit code, stderr or
    None) of each rank, once all exited; fails the test if one outlives ``limit_s``."""
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = 29500 + os.getpid() % 1000 + 1000 * (transport == "nvshmem") + 2000 * capture
    env = {**os.environ, **SAFE_ENV, "TDIST_TRANSPORT": transport, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "TDIST_DEAD_RANK": str(DEAD_RANK), **env}
    # (stderr to files, not pipes, which could fill while another rank is waited for; no core
    # files from the ranks that abort)
    logs = [tempfile.TemporaryFile(mode="w+") if capture else None for _ in range(world)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.gpu_dead_peer"], cwd=root,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=logs[r],
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
             for r in range(world)]
    start = time.monotonic()
    results = []
    for proc, log in zip(procs, logs):
        try:
            proc.wait(timeout=max(1.0, limit_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a surviving rank did not exit (a kernel kept spinning?)")
        if log is not None:
            log.seek(0)
        results.append((proc.returncode, log.read() if log is not None else None))
    assert results[DEAD_RANK][0] == -9, f"rank {DEAD_RANK} was to kill itself: {results}"
    return [r for rank, r in enumerate(results) if rank != DEAD_RANK]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("transport", ["cuda", "nvshmem"])
def test_gpu_dead_peer(transport):
    """A rank SIGKILLed among 4 (2 if fewer GPUs), TDIST_ASYNC_ERROR_HANDLING=0: the survivors'
    all_gather, reduce_scatter, all_reduce and all_to_all (one-shot kernels, and the bulk path's
    pulls and pushes) and torch_tdist.ops' overlapped ops raise within the timeout + 10 s naming
    the dead rank, their groups are destroyed, and their processes exit; before, abort() failed
    a waiting call (tests/gpu_dead_peer.py)."""
    survivors = [code for code, _ in _dead_peer_ranks(transport, {}, 300)]
    assert survivors == [0] * len(survivors), f"survivors' exit codes {survivors}; their output is above"


@pytest.mark.timeout(180)
def test_gpu_dead_peer_takes_the_process_down():
    """The default (TDIST_ASYNC_ERROR_HANDLING=1), as NCCL's: a survivor's all_reduce that
    waits for the dead rank past the group's timeout ends its process (SIGABRT), saying why,
    while its kernel still waits (the script's synchronize() never returns), so that no later
    work uses the call's output."""
    survivors = _dead_peer_ranks("cuda", {"TDIST_DEAD_TEARDOWN": "1", "TDIST_DEAD_CASES": "all_reduce"}, 150,
                                 capture=True)
    for code, err in survivors:
        assert code == -signal.SIGABRT, f"exit code {code}, stderr:\n{err[-3000:]}"
        for words in ("all_reduce", "did not finish within the group's timeout", "taking this process down"):
            assert words in err, f"{words!r} not in stderr:\n{err[-3000:]}"
