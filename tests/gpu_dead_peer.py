"""A rank killed (SIGKILL) in the middle of collectives on CUDA tensors: every survivor raises
within the group's timeout + 10 s, no kernel keeps spinning, and its process exits.

Rank TDIST_DEAD_RANK (1 by default: not the last, so that a wrong slot does not name the dead
rank by chance) takes part in one call of every case (on one tdist group per case), then kills
itself. The others then make each call once more: the call's kernel waits for the dead rank, the
group's watchdog aborts the group at its timeout, the kernel gives up (naming the rank it still
lacked), and ``work.wait()`` and any later call raise, naming the dead rank. Started by tests/test_gpu.py as plain processes (torchrun would stop the survivors
as soon as one rank dies); prints one line per op and exits 0 when every check held.

    RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. python -m tests.gpu_dead_peer
"""

import os
import signal
import sys
import time
from datetime import timedelta

os.environ.setdefault("TDIST_GPU_SIZE_LIMITS", "0")
import torch_tdist.launch  # noqa: E402,F401  (importing it sets the NVLink-multicast safety variables)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tdist  # noqa: E402,F401

TIMEOUT_S = 10
VICTIM = int(os.environ.get("TDIST_DEAD_RANK", "1"))  # the rank that kills itself
# name: (op, elements per rank, TDIST_ALGORITHM for its group). The small ones run the one-shot
# kernels; 16 MB of all_reduce the streamed kernel ("streamed" forces it on reduce_scatter); "bulk"
# forces the bulk path: all_gather's pulls (whose barriers wait in a kernel) and the other ops' pushes.
CASES = {
    "all_gather": ("all_gather", 4096, "auto"),
    "reduce_scatter": ("reduce_scatter", 4096, "auto"),
    "all_reduce": ("all_reduce", 4096, "auto"),
    "all_to_all": ("all_to_all", 4096, "auto"),
    "all_gather 64 MB, bulk": ("all_gather", 16 << 20, "bulk"),
    "all_reduce 16 MB": ("all_reduce", 1 << 20, "auto"),
    "reduce_scatter 16 MB, streamed": ("reduce_scatter", 1 << 20, "streamed"),
    "reduce_scatter 4 MB, bulk": ("reduce_scatter", 1 << 20, "bulk"),
    "all_reduce 4 MB, bulk": ("all_reduce", 1 << 20, "bulk"),
}


def _call(case, group, world, device):
    op, n, _ = CASES[case]
    if op == "all_gather":
        x = torch.randn(n, device=device)
        return dist.all_gather_into_tensor(torch.empty(world * n, device=device), x, group=group, async_op=True)
    x = torch.randn(n * world, device=device)
    if op == "reduce_scatter":
        return dist.reduce_scatter_tensor(torch.empty(n, device=device), x, group=group, async_op=True)
    if op == "all_reduce":
        return dist.all_reduce(x, group=group, async_op=True)
    return dist.all_to_all_single(torch.empty_like(x), x, group=group, async_op=True)


def _group(algorithm):
    os.environ["TDIST_ALGORITHM"] = algorithm  # (read once, by the group's executor)
    try:
        return dist.new_group(backend="tdist", timeout=timedelta(seconds=TIMEOUT_S))
    finally:
        del os.environ["TDIST_ALGORITHM"]


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    groups = {case: _group(algorithm) for case, (_, _, algorithm) in CASES.items()}
    for case in CASES:  # heaps made, kernels compiled, while every rank is alive
        _call(case, groups[case], world, device).wait()
    torch.cuda.synchronize()
    dist.barrier()
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1)
    failures = []
    dead = f"rank(s) {VICTIM} did not arrive"
    for case, (op, _, _) in CASES.items():
        start = time.monotonic()
        work = _call(case, groups[case], world, device)
        torch.cuda.synchronize()  # returns once the watchdog aborted the group and the kernel gave up
        try:
            work.wait()
            failures.append(f"{case}: work.wait() did not raise")
            continue
        except Exception as err:
            message = str(err).splitlines()[0]
        elapsed = time.monotonic() - start
        try:
            _call(case, groups[case], world, device)
            failures.append(f"{case}: the aborted group took another call")
        except Exception as err:
            if "aborted" not in str(err) or dead not in str(err):
                failures.append(f"{case}: a later call raised something else: {err}")
        if (elapsed > TIMEOUT_S + 10 or op not in message or "timeout" not in message or dead not in message
                or f"group '{groups[case].group_name}'" not in message):
            failures.append(f"{case}: raised after {elapsed:.1f} s: {message}")
        print(f"rank {rank}: {case} raised after {elapsed:.1f} s: {message}", flush=True)
    print(f"rank {rank}: {'FAILED: ' + '; '.join(failures) if failures else 'every survivor check held'}",
          flush=True)
    sys.stdout.flush()
    os._exit(1 if failures else 0)  # (no teardown: gloo and NCCL would wait for the dead rank)


if __name__ == "__main__":
    main()
