"""The flag-free all_reduce (triton_kernels/sentinel.py) on GPUs, call by call, against NCCL:
each case on a new tdist group (TDIST_ALGORITHM=sentinel), its calls in turn, each after a
barrier, with one rank late where the trial says so ("3 late": rank 3 sleeps PROBE_LATE s). A
call that stalls ends at the group's timeout (PROBE_TIMEOUT s); the probe then prints what each
mailbox holds and where the stuck waits polled, and goes on to the next case (the group is
aborted).

    PROBE_CASES=262144:bf16,524288:bf16 PROBE_TRIALS="aligned,3 late,2 late" \
        torchrun --nproc-per-node 4 benchmarks/sentinel_probe.py

Prints a line per rank and call: ok / WRONG (largest error), milliseconds, calls served.
"""
import ctypes
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_tdist
from timing import start_job  # (importing it sets the NVLink-multicast safety variables)
from torch_tdist.backend import get_executor

os.environ["TDIST_ASYNC_ERROR_HANDLING"] = "0"  # a stalled call's process goes on to the next case
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
CASES = [(int(n), DTYPES[t]) for n, t in (case.split(":") for case in os.environ.get(
    "PROBE_CASES", "1001:f32,16389:f32,131072:bf16,262144:bf16,524288:bf16").split(","))]
TRIALS = os.environ.get("PROBE_TRIALS", "first,aligned,0 late,3 late,aligned").split(",")


def mail_summary(ex, dtype):
    mail = ex._mail.view(torch.int16 if dtype.itemsize == 2 else torch.int32).cpu()
    peer = ex._sentinel_peer // dtype.itemsize
    share = ex._sentinel_share // dtype.itemsize
    out = []
    for p in range(ex.world_size):
        blk = mail[p * peer:(p + 1) * peer]
        counts = [int((blk[i * share:(i + 1) * share] != 0).sum()) for i in range(4)]
        lines = blk[4 * share:].view(torch.int64)
        nz = [(i, hex(int(v))) for i, v in enumerate(lines.tolist()) if v]
        out.append(f"peer {p}: in0/in1/out0/out1 nonzero {counts} lines {nz[:4]}{'...' if len(nz) > 4 else ''}")
    return out


def stuck_waits(ex, dtype):
    """Where the waits that were stuck at the abort polled (tdl's stuck records), in the mail."""
    from torch_tdist import language

    base, peer_bytes, share_bytes = ex._mail.data_ptr(), ex._sentinel_peer, ex._sentinel_share
    out = []
    for program in range(language.STUCK_RECORDS.value):
        address = ctypes.c_int64.from_address(ex.abort_word_address + 8 * (language.PAGE_STUCK.value + program)).value
        if not address:
            continue
        offset = address - base
        if not 0 <= offset < ex.world_size * peer_bytes:
            out.append(f"program {program} (mod {language.STUCK_RECORDS.value}): outside the mail ({address:#x})")
            continue
        peer, within = divmod(offset, peer_bytes)
        region, at = divmod(within, share_bytes)
        what = (f"{('inbox', 'outbox')[region // 2]} parity {region % 2} element {at // dtype.itemsize}"
                if region < 4 else f"line {(within - 4 * share_bytes) // 8}")
        out.append(f"program {program} (mod {language.STUCK_RECORDS.value}): peer {peer} {what}")
    return out


def clear_trace(ex):
    from torch_tdist.triton_kernels import sentinel

    ctypes.memset(ex.abort_word_address + 8 * sentinel.TRACE_WORD.value, 0, 8 * 4 * sentinel.TRACE_PROGRAMS.value)


def trace_summary(ex):
    """Where each program of the last call was when (TDIST_SENTINEL_TRACE=1: sentinel.py's stamps):
    per phase, how many programs reached it, the last one's time and the programs that reached it
    more than 50 ms after the first program started (ms from that start)."""
    from torch_tdist.triton_kernels import sentinel

    words = (ctypes.c_int64 * (4 * sentinel.TRACE_PROGRAMS.value)).from_address(
        ex.abort_word_address + 8 * sentinel.TRACE_WORD.value)
    stamps = [[words[4 * p + k] for k in range(4)] for p in range(sentinel.TRACE_PROGRAMS.value)]
    starts = [s[0] for s in stamps if s[0]]
    if not starts:
        return ["no stamps"]
    base = min(starts)
    out = [f"first start at {base / 1e6 % 100000:.3f} ms (GPU clock)"]
    for k, name in enumerate(("started", "lines", "step 2", "step 3")):
        at = [(p, (s[k] - base) / 1e6) for p, s in enumerate(stamps) if s[k]]
        late = [f"{p}@{t:.0f}" for p, t in at if t > 50]
        out.append(f"{name}: {len(at)} programs, last {max((t for _, t in at), default=0):.3f} ms"
                   + (f", late: {' '.join(late[:12])}{' ...' if len(late) > 12 else ''}" if late else ""))
    return out


def main():
    rank, _, device = start_job()
    late = float(os.environ.get("PROBE_LATE", "0.5"))
    tracing = os.environ.get("TDIST_SENTINEL_TRACE") == "1"
    for n, dtype in CASES:
        dist.barrier()  # (a rank still in the last case's stalled call would miss the new group's start)
        os.environ["TDIST_ALGORITHM"] = "sentinel"
        os.environ["TDIST_HEAP_SIZE"] = os.environ.get("PROBE_HEAP", "512M")
        tg = dist.new_group(backend="tdist", timeout=timedelta(seconds=int(os.environ.get("PROBE_TIMEOUT", "20"))))
        del os.environ["TDIST_ALGORITHM"]
        ex = get_executor(tg)
        for trial in TRIALS:
            gen = torch.Generator(device).manual_seed(1000 * rank + n)
            x = torch.randn(n, device=device, generator=gen).to(dtype)
            want = x.float().clone()
            dist.all_reduce(want)
            torch.cuda.synchronize()
            dist.barrier()
            if trial.endswith(" late") and rank == int(trial.split()[0]):
                time.sleep(late)
            y = x.clone()
            if tracing:
                clear_trace(ex)
            start = time.perf_counter()
            try:
                dist.all_reduce(y, group=tg)
                torch.cuda.synchronize()
                err = (y.float() - want).abs().max().item()
                ok = err <= (0.05 if dtype != torch.float32 else 1e-4) * max(1.0, want.abs().max().item())
                print(f"rank {rank}: n={n} {str(dtype)[6:]} {trial}: {'ok' if ok else 'WRONG'} "
                      f"err {err:.3g} {1e3 * (time.perf_counter() - start):.1f} ms "
                      f"served {torch_tdist.stats(tg)['all_reduce']}", flush=True)
                if tracing and (not ok or time.perf_counter() - start > 1.0):
                    for line in trace_summary(ex):
                        print(f"rank {rank}:   trace: {line}", flush=True)
            except Exception as e:
                print(f"rank {rank}: n={n} {str(dtype)[6:]} {trial}: ERROR {type(e).__name__}: {str(e)[:600]}", flush=True)
                try:
                    torch.cuda.synchronize()  # (the stalled kernels have given up)
                    epochs = sorted(set(ex._counter[1:].tolist()))
                    print(f"rank {rank}:   epochs in the counter slots: {epochs}", flush=True)
                    traced = trace_summary(ex) if tracing else []
                    for line in mail_summary(ex, dtype) + stuck_waits(ex, dtype) + [f"trace: {t}" for t in traced]:
                        print(f"rank {rank}:   {line}", flush=True)
                except Exception as e2:
                    print(f"rank {rank}:   (mail unreadable: {e2})", flush=True)
                break
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
