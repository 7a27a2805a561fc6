"""benchmarks/titan.py's profile breakdown on synthetic traces: every tdist collective kernel
(streamed_kernel, twoshot, low-latency, ...) counts as communication, the fused kernels with the
computation, and the exposed communication is what no computation overlaps."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _titan():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import titan
    finally:
        sys.path.pop(0)
    return titan


def _trace(path, events):
    with open(path, "w") as f:
        json.dump({"traceEvents": [{"ph": "X", "ts": ts, "dur": dur, "name": name, "cat": cat}
                                   for ts, dur, name, cat in events]}, f)
    return str(path)


def test_every_tdist_collective_kernel_is_communication():
    comm, fused = _titan().tdist_kernels()
    for name in ("oneshot_kernel", "streamed_kernel", "twoshot_all_reduce_kernel", "lowlatency_kernel",
                 "streamed_all_to_all_v_kernel", "pull_copy_kernel", "hierarchical_all_gather_kernel"):
        assert name in comm, name
    assert {"ag_gemm_kernel", "gemm_rs_kernel"} <= fused and not fused & comm


def test_breakdown_by_kind_and_exposed_communication(tmp_path):
    # rank 0: a matmul 0-100, streamed_kernel 50-250 (100 us of it exposed), the fused kernel
    # 300-400, a peer copy 400-450 (exposed), NCCL 450-500 (exposed); rank 1 starts each
    # communication kernel 10 us later
    rank0 = [(0, 100, "nvjet_tst_gemm", "kernel"), (50, 200, "streamed_kernel", "kernel"),
             (300, 100, "ag_gemm_kernel", "kernel"), (400, 50, "Memcpy PtoP (Device -> Device)", "gpu_memcpy"),
             (450, 50, "ncclDevKernel_AllGather_RING_LL", "kernel")]
    rank1 = [(ts + 10 if cat == "kernel" and name != "nvjet_tst_gemm" else ts, dur, name, cat)
             for ts, dur, name, cat in rank0]
    paths = [_trace(tmp_path / "rank0_trace.json", rank0), _trace(tmp_path / "rank1_trace.json", rank1)]
    got = _titan().kernel_breakdown(paths)
    assert got["kind_ms"] == {"tdist": 0.2, "matmul": 0.1, "fused": 0.1, "copy": 0.05, "nccl": 0.05}, got["kind_ms"]
    assert got["span_ms"] == 0.5
    assert got["comm_ms"] == 0.3  # streamed 50-250, copy 400-450, NCCL 450-500
    assert got["exposed_comm_ms"] == 0.25  # less the matmul's 50-100
    assert got["comm_waiting_for_last_rank_ms"] == 0.02  # 10 us before streamed_kernel and before NCCL
