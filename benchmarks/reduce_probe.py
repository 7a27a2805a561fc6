"""The bulk path's reduce kernel alone on one GPU: how fast it sums world parts (flags already up)
for a few grid sizes, block sizes and warps, beside torch's own sum and a plain copy of the same
bytes.

    python benchmarks/reduce_probe.py [--elements N] [--world 4] [--configs P:B:W,...] [--out DIR]

Writes ``reduce_probe_<machine>.json``: per variant (programs P, block bytes B, warps W) the median
over ``--rounds`` rounds, each timing every variant in turn (the median of ``--repeats``
launches, CUDA events, after warm-up), and the bytes moved per microsecond (every part read, one
write).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch
import triton.language as tl

from torch_tdist import language
from torch_tdist.bulk import KMAX
from torch_tdist.launch import SAFE_ENV  # noqa: F401  (importing it sets the NVLink-multicast safety variables)
from torch_tdist.triton_kernels import bulk


def _median_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, default=2048 * 28672)  # a part of gemm_rs 8192x28672x8192 on 4
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--configs", default=None, help="P:B:W,... (default: a grid of 36)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    n, world, me = args.elements, args.world, 1
    dev = torch.device("cuda", 0)
    dtype = torch.bfloat16
    slots = torch.randn(world * n, device=dev).to(dtype)
    own = torch.randn(n, device=dev).to(dtype)
    dst = torch.empty(n, device=dev, dtype=dtype)
    ready = torch.ones(world * KMAX, device=dev, dtype=torch.int64)
    ctx = torch.zeros(language.CTX_BASES.value + world, device=dev, dtype=torch.int64)
    ctx[language.CTX_RANK.value], ctx[language.CTX_WORLD.value] = me, world
    ctx[language.CTX_TIMEOUT_MS.value] = 60_000

    want = slots.view(world, n).float().sum(0) - slots.view(world, n)[me].float() + own.float()

    def launch(programs, block_bytes, warps):
        bulk.reduce_chunks_kernel[(programs,)](
            ctx, own, slots, n, ready, dst, n, n, 1, own, 0, 0, 0, ME=me, WORLD=world, KMAX=KMAX,
            BLOCK=block_bytes // dtype.itemsize, ALIGN=8, OP="sum", ACC=tl.float32, PUSHERS=0, num_warps=warps)

    if args.configs:
        configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    else:
        configs = list(itertools.product((132, 264, 528, 1056), (8192, 16384, 32768), (4, 8, 16)))
    part_bytes = n * dtype.itemsize
    parts = slots.view(world, n)
    variants = {"torch.sum": (lambda: torch.sum(parts, 0, out=dst), world + 1),
                "copy": (lambda: dst.copy_(own), 2)}
    errors = {}
    for config in configs:
        dst.fill_(float("nan"))
        launch(*config)
        errors[config] = ((dst.float() - want).norm() / want.norm()).item()
        variants[config] = (lambda c=config: launch(*c), world + 1)
    times = {key: [] for key in variants}
    for _ in range(args.rounds):
        for key, (fn, _) in variants.items():
            times[key].append(_median_us(fn, args.repeats))
    rows = []
    for config, (_, moved) in variants.items():
        us = statistics.median(times[config])
        row = {"variant": config if isinstance(config, str) else "kernel", "us": round(us, 1),
               "rounds_us": [round(t, 1) for t in times[config]],
               "tb_per_s": round(moved * part_bytes / us / 1e6, 3)}
        if not isinstance(config, str):
            row.update(programs=config[0], block_bytes=config[1], num_warps=config[2], relative_error=errors[config])
        rows.append(row)
        print(row, flush=True)
    machine = torch.cuda.get_device_name(dev).replace(" ", "_")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"reduce_probe_{machine}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine, "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
                   "elements_per_part": n, "world": world, "dtype": str(dtype),
                   "method": f"median over {args.rounds} rounds of every variant in turn, each the median of "
                             f"{args.repeats} launches after 3 warm-ups (CUDA events), one GPU",
                   "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
