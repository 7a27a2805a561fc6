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
same with a Triton kernel spinning 1 ms on 64 to 264 programs in place of the matmul. And a wait
that holds no SM: a stream held by ``cuStreamWaitValue64`` on a flag, released by a write from a
third stream ``--delay-us`` into the matmul, then a 1 MB copy (CUDA events: when the flag was
written, when the waiting stream went on, when its copy was done). Writes
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

from torch_tdist.launch import SAFE_ENV  # noqa: F401  (importing it sets the NVLink-multicast safety variables)


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


def _memop_rows(shape, dev, main_stream, args):
    """The stream-memory-op wait beside a matmul of ``shape`` (module docstring)."""
    from cuda.bindings import driver as cu

    m, n, k = (int(v) for v in shape.split("x"))
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    src, dst = torch.ones(1 << 19, device=dev), torch.empty(1 << 19, device=dev)
    waiter, writer = torch.cuda.Stream(dev, priority=-1), torch.cuda.Stream(dev, priority=-1)
    times = {"written_us": [], "released_us": [], "copied_us": [], "matmul_us": []}
    for repeat in range(args.repeats + 3):
        torch.cuda.synchronize()
        flag.zero_()
        dst.zero_()
        torch.cuda.synchronize()
        events = {name: torch.cuda.Event(enable_timing=True) for name in ("start", "mm", "written", "released", "copied")}
        err, = cu.cuStreamWaitValue64(cu.CUstream(waiter.cuda_stream), flag.data_ptr(), 1,
                                      cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)
        assert err == cu.CUresult.CUDA_SUCCESS, f"cuStreamWaitValue64: {err}"
        events["released"].record(waiter)
        with torch.cuda.stream(waiter):
            dst.copy_(src)
        events["copied"].record(waiter)
        events["start"].record(main_stream)
        with torch.cuda.stream(main_stream):
            torch.mm(a, b, out=c)
        events["mm"].record(main_stream)
        until = time.perf_counter() + args.delay_us / 1e6
        while time.perf_counter() < until:
            pass
        err, = cu.cuStreamWriteValue64(cu.CUstream(writer.cuda_stream), flag.data_ptr(), 1, 0)
        assert err == cu.CUresult.CUDA_SUCCESS, f"cuStreamWriteValue64: {err}"
        events["written"].record(writer)
        torch.cuda.synchronize()
        if repeat >= 3:
            for name, event in (("written_us", "written"), ("released_us", "released"), ("copied_us", "copied"),
                                ("matmul_us", "mm")):
                times[name].append(events["start"].elapsed_time(events[event]) * 1000)
    assert dst.eq(1).all(), "the copy after the wait did not happen"
    row = {"main": f"matmul {shape}", "side": "cuStreamWaitValue64, then a 1 MB copy",
           **{name: round(statistics.median(values), 1) for name, values in times.items()}}
    print(row, flush=True)
    return [row]


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
    for shape in args.shapes.split(","):
        rows += _memop_rows(shape, dev, main_stream, args)
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
