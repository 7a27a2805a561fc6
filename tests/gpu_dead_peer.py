"""A rank killed (SIGKILL) in the middle of collectives and overlapped ops on CUDA tensors:
every survivor raises within the group's timeout + 10 s, no kernel keeps spinning, its groups
are destroyed and its process exits.

Rank TDIST_DEAD_RANK (1 by default: not the last, so that a wrong slot does not name the dead
rank by chance) takes part in one call of every case (on one tdist group per case), then kills
itself. The others then make each call once more: the call's kernel waits for the dead rank, the
group's watchdog aborts the group at its timeout, the kernel gives up (naming the rank it still
lacked), and ``work.wait()`` (collectives) and any later call raise, naming the dead rank.
Before that, while every rank lives, rank 0 checks that ``abort()`` fails a call still waiting
for peers (its ``wait()`` raises). Started by tests/test_gpu.py as plain processes (torchrun
would stop the survivors as soon as one rank dies); prints one line per case and exits 0 when
every check held. The groups keep their processes (TDIST_ASYNC_ERROR_HANDLING=0); with
TDIST_DEAD_TEARDOWN=1 they do not (the default), and each survivor's first call after the death
must take its process down (SIGABRT) within the timeout + 10 s.

    RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. python -m tests.gpu_dead_peer
"""

import faulthandler
import os
import signal
import sys
import time
from datetime import timedelta

TEARDOWN = os.environ.get("TDIST_DEAD_TEARDOWN") == "1"
os.environ["TDIST_ASYNC_ERROR_HANDLING"] = "1" if TEARDOWN else "0"
import torch_tdist.launch  # noqa: E402,F401  (importing it sets the NVLink-multicast safety variables)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tdist.ops  # noqa: E402
from torch_tdist.backend import _tdist_backend  # noqa: E402
from torch_tdist.compat import all_gather_single, reduce_scatter_single  # noqa: E402

TIMEOUT_S = 10
VICTIM = int(os.environ.get("TDIST_DEAD_RANK", "1"))  # the rank that kills itself
# name: (op, elements per rank (rows of A per rank for the overlapped ops), its group's backend options).
# The small ones run the one-shot kernels; 4 MB of all_reduce the two-shot kernel, 16 MB the streamed kernel ("streamed"
# forces it on reduce_scatter); "bulk" forces the bulk path: all_gather's pulls (whose barriers
# wait in a kernel) and the other ops' pushes. The overlapped ops (torch_tdist.ops) queue their
# kernels with no c10d Work: the group's watchdog watches them all the same.
CASES = {
    "all_gather": ("all_gather", 4096, {}),
    "reduce_scatter": ("reduce_scatter", 4096, {}),
    "all_reduce": ("all_reduce", 4096, {}),
    "all_to_all": ("all_to_all", 4096, {}),
    "barrier": ("barrier", 0, {}),  # (waits on the host, in work.wait(), while the watchdog aborts)
    "all_gather 64 MB, bulk": ("all_gather", 16 << 20, {"algorithm": "bulk"}),
    "all_reduce 4 MB, two-shot": ("all_reduce", 1 << 18, {}),
    "all_reduce 16 MB": ("all_reduce", 1 << 20, {}),
    "reduce_scatter 16 MB, streamed": ("reduce_scatter", 1 << 20, {"algorithm": "streamed"}),
    "reduce_scatter 4 MB, bulk": ("reduce_scatter", 1 << 20, {"algorithm": "bulk"}),
    "all_reduce 4 MB, bulk": ("all_reduce", 1 << 20, {"algorithm": "bulk"}),
    "all_gather_matmul, fused": ("all_gather_matmul", 256, {"overlap": "fused"}),
    "all_gather_matmul, pipelined": ("all_gather_matmul", 256, {"overlap": "pipelined"}),
    "matmul_reduce_scatter, fused": ("matmul_reduce_scatter", 256, {"overlap": "fused"}),
    "matmul_reduce_scatter, pipelined": ("matmul_reduce_scatter", 256, {"overlap": "pipelined"}),
}
if os.environ.get("TDIST_DEAD_CASES"):  # "|"-separated names: some of the cases (a shorter run)
    CASES = {name: case for name, case in CASES.items() if name in os.environ["TDIST_DEAD_CASES"].split("|")}
K = N = 512  # the overlapped ops' matrices: A [rows, K] @ B [K, N]
DESTROY_S = 60  # a survivor's groups must be destroyed within this


def _call(case, group, world, device):
    """The case's call: its Work (collectives), None (overlapped ops, queued on the stream; the
    barrier, waited for)."""
    op, n, _ = CASES[case]
    if op == "barrier":
        dist.barrier(group=group)
        return None
    if op == "all_gather_matmul":
        torch_tdist.ops.all_gather_matmul(torch.randn(n, K, device=device), torch.randn(K, N, device=device),
                                          group=group)
        return None
    if op == "matmul_reduce_scatter":
        torch_tdist.ops.matmul_reduce_scatter(torch.randn(n * world, K, device=device),
                                              torch.randn(K, N, device=device), group=group)
        return None
    if op == "all_gather":
        x = torch.randn(n, device=device)
        return all_gather_single(torch.empty(world * n, device=device), x, group=group, async_op=True)
    x = torch.randn(n * world, device=device)
    if op == "reduce_scatter":
        return reduce_scatter_single(torch.empty(n, device=device), x, group=group, async_op=True)
    if op == "all_reduce":
        return dist.all_reduce(x, group=group, async_op=True)
    return dist.all_to_all_single(torch.empty_like(x), x, group=group, async_op=True)


def _group(options: dict):
    """A tdist group with the backend ``options`` (its config), every size served by tdist."""
    return dist.new_group(backend="tdist", timeout=timedelta(seconds=TIMEOUT_S),
                          pg_options={"gpu_size_limits": False, **options})


def _abort_fails_a_waiting_call(rank, world, device) -> list[str]:
    """Rank 0 starts an all_reduce the others never join and calls ``abort()``: the call's
    ``wait()`` raises, and its kernel gives up. Returns the failures (rank 0's)."""
    group = _group({})
    x = torch.randn(4096, device=device)
    dist.all_reduce(x, group=group)  # every rank: the heap exists, the kernel is compiled
    torch.cuda.synchronize()
    if rank != 0:
        return []
    work = dist.all_reduce(x, group=group, async_op=True)
    time.sleep(1)
    start = time.monotonic()
    _tdist_backend(group).abort()
    try:
        work.wait()
        failures = ["abort(): the waiting call's wait() did not raise"]
    except Exception as err:
        failures = [] if "abort() was called" in str(err) else [f"abort(): wait() raised {err}"]
    torch.cuda.synchronize()
    print(f"rank {rank}: abort() ended the waiting call in {time.monotonic() - start:.1f} s", flush=True)
    return failures


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    failures = [] if TEARDOWN else _abort_fails_a_waiting_call(rank, world, device)
    groups = {case: _group(options) for case, (_, _, options) in CASES.items()}
    for case in CASES:  # heaps made, kernels compiled (and the overlapped ops' programs recorded)
        for _ in range(2):
            work = _call(case, groups[case], world, device)
            if work is not None:
                work.wait()
    torch.cuda.synchronize()
    dist.barrier()
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1)
    if TEARDOWN:  # the watchdog must end this process in the first case's call
        case = next(iter(CASES))
        start = time.monotonic()
        work = _call(case, groups[case], world, device)
        torch.cuda.synchronize()
        try:
            outcome = "returned" if work is None or work.wait() else "returned False"
        except Exception as err:
            outcome = f"raised {err}"
        print(f"rank {rank}: FAILED: the process was not taken down ({case}: synchronized after "
              f"{time.monotonic() - start:.1f} s; wait() {outcome})", flush=True)
        os._exit(1)
    dead = f"rank(s) {VICTIM} did not arrive"
    for case, (op, _, _) in CASES.items():
        start = time.monotonic()
        message = None
        try:
            work = _call(case, groups[case], world, device)
            torch.cuda.synchronize()  # returns once the watchdog aborted the group and the kernel gave up
            if work is not None:
                work.wait()
                failures.append(f"{case}: work.wait() did not raise")
                continue
        except Exception as err:
            message = str(err).splitlines()[0]
        if op == "barrier" and message is None:
            failures.append(f"{case}: did not raise")
        elapsed = time.monotonic() - start
        try:
            _call(case, groups[case], world, device)
            failures.append(f"{case}: the aborted group took another call")
        except Exception as err:
            if "aborted" not in str(err) or dead not in str(err):
                failures.append(f"{case}: a later call raised something else: {err}")
            message = message or str(err).splitlines()[0]  # (the overlapped ops: the reason it names)
        if (elapsed > TIMEOUT_S + 10 or op not in message or "timeout" not in message or dead not in message
                or f"group '{groups[case].group_name}'" not in message):
            failures.append(f"{case}: raised after {elapsed:.1f} s: {message}")
        print(f"rank {rank}: {case} raised after {elapsed:.1f} s: {message}", flush=True)
    faulthandler.dump_traceback_later(DESTROY_S, exit=True)  # a destroy that hangs fails, with its stack
    start = time.monotonic()
    for group in groups.values():
        dist.destroy_process_group(group)
    faulthandler.cancel_dump_traceback_later()
    print(f"rank {rank}: its {len(groups)} aborted groups destroyed in {time.monotonic() - start:.1f} s", flush=True)
    print(f"rank {rank}: {'FAILED: ' + '; '.join(failures) if failures else 'every survivor check held'}",
          flush=True)
    sys.stdout.flush()
    os._exit(1 if failures else 0)  # (no teardown: gloo would wait for the dead rank)


if __name__ == "__main__":
    main()
