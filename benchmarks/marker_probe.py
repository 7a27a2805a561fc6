"""Host microseconds of the driver calls that could mark the end of a call on a stream (one GPU):
cuEventRecord (what a served call does now), cuStreamWriteValue64 / 32 of a counter in pinned host
memory (which a watchdog could read without a driver call), and cuCtxGetDevice for the cost of a
ctypes call into the driver alone; each interleaved over rounds, the median round.

    python benchmarks/marker_probe.py
"""
import ctypes
import statistics
import time

import torch

from torch_tdist.launch import SAFE_ENV  # noqa: F401  (importing it sets the NVLink-multicast safety variables)

CALLS, ROUNDS = 20000, 7


def main():
    torch.cuda.init()
    cuda = ctypes.CDLL("libcuda.so.1")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    event = ctypes.c_void_p()
    assert cuda.cuEventCreate(ctypes.byref(event), 2) == 0  # CU_EVENT_DISABLE_TIMING
    counter = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    address = ctypes.c_uint64(counter.data_ptr())
    device = ctypes.c_int()
    probes = {
        "cuCtxGetDevice (ctypes call alone)": lambda i: cuda.cuCtxGetDevice(ctypes.byref(device)),
        "cuEventRecord": lambda i: cuda.cuEventRecord(event, stream),
        "cuStreamWriteValue64 (pinned host)": lambda i: cuda.cuStreamWriteValue64_v2(stream, address, ctypes.c_uint64(i), 0),
        "cuStreamWriteValue32 (pinned host)": lambda i: cuda.cuStreamWriteValue32_v2(stream, address, ctypes.c_uint32(i), 0),
        "torch.cuda.Event().record()": None,
    }
    torch_event = torch.cuda.Event()
    probes["torch.cuda.Event().record()"] = lambda i: torch_event.record()
    for name, probe in probes.items():
        rc = probe(1)
        assert rc in (0, None), f"{name}: CUDA error {rc}"
    torch.cuda.synchronize()
    times = {name: [] for name in probes}
    for _ in range(ROUNDS):
        for name, probe in probes.items():
            start = time.perf_counter()
            for i in range(CALLS):
                probe(i)
            times[name].append((time.perf_counter() - start) / CALLS * 1e6)
            torch.cuda.synchronize()
    assert int(counter[0]) == CALLS - 1 or int(counter[0]) & 0xFFFFFFFF == CALLS - 1, int(counter[0])
    for name, t in times.items():
        print(f"{name:<40} {statistics.median(t):6.2f} us  (rounds {', '.join(f'{v:.2f}' for v in t)})")


if __name__ == "__main__":
    main()
