"""A rank killed (SIGKILL) in the middle of collectives on CUDA tensors: every survivor raises
within the group's timeout + 10 s, no kernel keeps spinning, and its process exits.

The last rank takes part in one call of every op (on one tdist group per op), then kills itself.
The others then call each op once more: the call's kernel waits for the dead rank, the group's
watchdog aborts the group at its timeout, the kernel gives up, and ``work.wait()`` and any later
call raise. Started by tests/test_gpu.py as plain processes (torchrun would stop the survivors
as soon as one rank dies); prints one line per op and exits 0 when every check held.

    RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. python -m tests.gpu_dead_peer
"""

import os
import signal
import sys
import time
from datetime import timedelta

for _key, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1", "TDIST_GPU_SIZE_LIMITS": "0"}.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tdist  # noqa: E402,F401

TIMEOUT_S = 10
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _call(op, group, world, device):
    x = torch.randn(4096 * world, device=device)
    if op == "all_gather":
        return dist.all_gather_into_tensor(torch.empty(world * x.numel(), device=device), x, group=group,
                                           async_op=True)
    if op == "reduce_scatter":
        return dist.reduce_scatter_tensor(torch.empty(4096, device=device), x, group=group, async_op=True)
    if op == "all_reduce":
        return dist.all_reduce(x, group=group, async_op=True)
    return dist.all_to_all_single(torch.empty_like(x), x, group=group, async_op=True)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    groups = {op: dist.new_group(backend="tdist", timeout=timedelta(seconds=TIMEOUT_S)) for op in OPS}
    for op in OPS:  # heaps made, kernels compiled, while every rank is alive
        _call(op, groups[op], world, device).wait()
    torch.cuda.synchronize()
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1)
    failures = []
    for op in OPS:
        start = time.monotonic()
        work = _call(op, groups[op], world, device)
        torch.cuda.synchronize()  # returns once the watchdog aborted the group and the kernel gave up
        try:
            work.wait()
            failures.append(f"{op}: work.wait() did not raise")
            continue
        except Exception as err:
            message = str(err).splitlines()[0]
        elapsed = time.monotonic() - start
        try:
            _call(op, groups[op], world, device)
            failures.append(f"{op}: the aborted group took another call")
        except Exception as err:
            if "aborted" not in str(err):
                failures.append(f"{op}: a later call raised something else: {err}")
        if elapsed > TIMEOUT_S + 10 or op not in message or "timeout" not in message:
            failures.append(f"{op}: raised after {elapsed:.1f} s: {message}")
        print(f"rank {rank}: {op} raised after {elapsed:.1f} s: {message}", flush=True)
    print(f"rank {rank}: {'FAILED: ' + '; '.join(failures) if failures else 'every survivor check held'}",
          flush=True)
    sys.stdout.flush()
    os._exit(1 if failures else 0)  # (no teardown: gloo and NCCL would wait for the dead rank)


if __name__ == "__main__":
    main()
