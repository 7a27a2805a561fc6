"""When does a one-program kernel start if it is launched on another stream while a cuBLAS
matmul fills the GPU? The question behind every design that waits on a flag beside a matmul
(a barrier or a per-chunk wait on a side stream): if the kernel only starts when the matmul
ends, the wait it holds starts that late too.

    python benchmarks/beside_probe.py [--carveouts 0,32] [--out DIR]

On one GPU: stream A stamps the GPU's clock (``%globaltimer``), runs a bf16 matmul, stamps again;
stream B, high or normal priority, stamps once, launched ``--delay-us`` of host time after the
matmul (so that the matmul runs by then). Per shape and priority: the median over ``--repeats``
of B's start after A's first stamp, against the matmul's length (B started promptly if its start
is near the delay, waited for the matmul if near its length), with cuBLAS told to leave
``--carveouts`` SMs free (``torch._C._set_sm_carveout_experimental``; 0: none). Control: the
same with a Triton kernel spinning 1 ms on 64 to 264 programs in place of the matmul. Writes
``beside_probe_<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _stamp(out, index):
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [index], dtype=tl.uint64,
                                    is_pure=False, pack=1)
    tl.store(out + index, now.to(tl.int64))


@triton.jit
def _spin(out, ns):
    start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [ns], dtype=tl.uint64,
                                      is_pure=False, pack=1)
    now = start
    while now - start < ns:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [ns], dtype=tl.uint64,
                                        is_pure=False, pack=1)
    tl.store(out + tl.program_id(0), now.to(tl.int64))


def _rows(work, label: dict, stamps, main_stream, sides, args):
    """A row per side-stream priority: ``work()`` queued on the main stream between two stamps,
    the side stamp ``--delay-us`` later."""
    rows = []
    for priority, side in sides.items():
        starts, lengths = [], []
        for repeat in range(args.repeats + 3):
            torch.cuda.synchronize()
            with torch.cuda.stream(main_stream):
                _stamp[(1,)](stamps, 0)
                work()
                _stamp[(1,)](stamps, 1)
            until = time.perf_counter() + args.delay_us / 1e6
            while time.perf_counter() < until:
                pass
            with torch.cuda.stream(side):
                _stamp[(1,)](stamps, 2)
            torch.cuda.synchronize()
            t0, t1, t2 = stamps.tolist()
            if repeat >= 3:
                starts.append((t2 - t0) / 1000)
                lengths.append((t1 - t0) / 1000)
        row = {**label, "side_priority": priority, "side_start_us": round(statistics.median(starts), 1),
               "main_us": round(statistics.median(lengths), 1), "side_start_us_all": [round(s, 1) for s in starts]}
        rows.append(row)
        print({key: value for key, value in row.items() if key != "side_start_us_all"}, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8192x8192x8192,2048x8192x8192,8192x4096x12288")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--delay-us", type=float, default=200)
    parser.add_argument("--carveouts", default="0,32")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    stamps = torch.zeros(3, dtype=torch.int64, device=dev)
    main_stream = torch.cuda.Stream(dev)
    sides = {"high": torch.cuda.Stream(dev, priority=-1), "normal": torch.cuda.Stream(dev, priority=0)}
    rows = []
    for carveout in (int(c) for c in args.carveouts.split(",")):
        torch._C._set_sm_carveout_experimental(carveout or None)
        for shape in args.shapes.split(","):
            m, n, k = (int(v) for v in shape.split("x"))
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            rows += _rows(lambda: torch.mm(a, b, out=c), {"main": f"matmul {shape}", "sm_carveout": carveout},
                          stamps, main_stream, sides, args)
    torch._C._set_sm_carveout_experimental(None)
    scratch = torch.zeros(1024, dtype=torch.int64, device=dev)
    for programs in (64, 132, 264):
        rows += _rows(lambda: _spin[(programs,)](scratch, 1_000_000), {"main": f"spin 1 ms, {programs} programs"},
                      stamps, main_stream, sides, args)
    machine = torch.cuda.get_device_name(dev).replace(" ", "_")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"beside_probe_{machine}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine, "versions": {"torch": torch.__version__, "triton": triton.__version__},
                   "method": f"median of {args.repeats} after 3 warm-ups; times from the GPU's %globaltimer, "
                             f"relative to a stamp on the matmul's stream just before it; the side stamp launched "
                             f"{args.delay_us} us of host time after the matmul",
                   "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
