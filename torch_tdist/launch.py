"""Start local ranks on a tdist group (the demo's and the soak's launcher).

``run_local(fn, nproc, *args)`` starts ``nproc`` processes (one GPU each when there are that
many GPUs, the CPU otherwise), initialises the default process group with the "tdist"
backend in each, calls ``fn(rank, world, device, *args)`` and returns each rank's result, or
None for a rank that failed. When one rank fails the others are stopped: they would wait
for it.
"""

import os
import tempfile
import time
from datetime import timedelta

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in SAFE_ENV.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def device_kind(nproc: int) -> str:
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "cpu"


def _rank_main(rank, world, store_path, kind, timeout_s, fn, args, results):
    import torch.distributed as dist

    import torch_tdist  # noqa: F401  (registers the backend)

    if kind == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(kind, rank) if kind == "cuda" else torch.device("cpu")
    dist.init_process_group("tdist", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    results.put((rank, fn(rank, world, device, *args)))
    dist.destroy_process_group()


def run_local(fn, nproc: int, *args, timeout_s: float = 120) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    kind = device_kind(nproc)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, nproc, store, kind, timeout_s, fn, args, results))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
            time.sleep(0.2)
        per_rank = [None] * nproc
        while not results.empty():
            rank, value = results.get()
            per_rank[rank] = value
    return [v if p.exitcode == 0 else None for v, p in zip(per_rank, procs)]
