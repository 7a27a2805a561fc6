"""Bad input on CUDA tensors: every case of the CPU matrix (tests/jobs_bad_input.py) with CUDA
tensors, plus tensors on another GPU than the group's, a message larger than the heap, the
nvshmem transport asked for where its library is missing, and (on a group with
TDIST_CHECK_CALLS=1) arguments that only rank 0 can tell are wrong, which must fail the call on
every rank; and torch_tdist.ops calls that differ in one thing (dtype, shape, device, stride, a
tensor resized or new) from a signature C++ issues: the same errors as a first call, or the right
result by the general path.

    torchrun --nproc-per-node 2 -m tests.gpu_bad_input

On one GPU, the cases that need another GPU or another rank print "not checked". Run by
``tests/test_gpu.py``. The default group is tdist, tensors are made on this rank's GPU. Every
rank makes the same bad call; each must raise on every rank within seconds, with a
ValueError or TypeError whose message says "tdist" and names the op (calls tdist hands to
NCCL may raise NCCL's error instead). Afterwards the group must still compute correctly.
Prints one line per case; exits non-zero if any failed.
"""

import os
import sys
import time

import torch_tdist.launch  # noqa: E402,F401  (importing it sets the NVLink-multicast safety variables)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tdist  # noqa: E402,F401
from torch_tdist.compat import all_gather_single  # noqa: E402
from torch_tdist.overlap.custom_ops import PER_B_MIN_COLUMNS  # noqa: E402
from tests import jobs_bad_input as J  # noqa: E402
from tests.gpu_checks import report_and_exit  # noqa: E402

MAX_SECONDS = 10.0
VALIDATION = (ValueError, TypeError)
# Cases the CPU matrix has that mean nothing here: a meta tensor on the CPU backend; BAND and
# friends go to NCCL on CUDA tensors, which serves them (no error to expect).
NOT_ON_GPU = {"meta_tensor_on_cpu_backend", "band_on_float32", "band_on_bfloat16"}


def _expect_error(name, call, ops, types=VALIDATION):
    """None if ``call`` raised as it should, else what went wrong."""
    print(f"{name} ...", file=sys.stderr, flush=True)  # where a crash happened, if one does
    start = time.perf_counter()
    try:
        call()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001  (inspected below)
        took = time.perf_counter() - start
        msg = str(err).lower()
        if took > MAX_SECONDS:
            return f"{name}: raised after {took:.1f} s"
        if not isinstance(err, types) and not any(t.__name__ in msg for t in types):
            return f"{name}: {type(err).__name__} is not one of {[t.__name__ for t in types]}: {err}"
        if "tdist" not in msg or not any(op in msg for op in ops):
            return f"{name}: message does not say tdist and name one of {ops}: {err}"
        return None
    return f"{name}: returned without raising"


def _fused_after_first_call(group, world, other) -> dict:
    """torch_tdist.ops calls whose signature ran before (so that C++ issues it,
    csrc/fused_calls.cpp) varied in one thing: name -> (call, ops its error names, error types),
    or (check, None): a call that must compute the right result (``check()`` returns what went
    wrong, or None), against a reference made here from every rank's inputs (regenerated from
    their seeds), not reusing the signature's plan, or (the same B twice, whose signature two
    distinct Bs recorded) reusing it with one address in two roles that are only read.
    ``other``: another GPU, or None where there is none."""
    m, k, n = 64 * world, 256, 128

    def inputs(r):
        gen = torch.Generator("cuda").manual_seed(7 + r)
        return (torch.randn(m // world, k, generator=gen).to(torch.bfloat16),
                torch.randn(m, k, generator=gen).to(torch.bfloat16),
                torch.randn(k, n, generator=gen).to(torch.bfloat16))
    everyone = [inputs(r) for r in range(world)]
    rank = dist.get_rank()
    a, rs_a, b = everyone[rank]
    gen = torch.Generator("cuda").manual_seed(70 + rank)  # (wide Bs, multiplied one by one when pipelined)
    wide = [torch.randn(PER_B_MIN_COLUMNS, k, generator=gen).to(torch.bfloat16).t() for _ in range(2)]
    ops = torch_tdist.ops
    for _ in range(3):  # (the first runs in Python, the later ones are issued from C++)
        ops.all_gather_matmul(a, b, group=group)
        ops.matmul_reduce_scatter(rs_a, b, group=group)
        ops.all_gather_matmul(a, wide, group=group)
    issued = torch_tdist.overlap.state(group).issued

    def from_cpp(i):  # calls of op i (all_gather_matmul, matmul_reduce_scatter) C++ issued
        return issued.sequential[i] + issued.program[i] + issued.graph[i]

    for i, op in enumerate(("all_gather_matmul", "matmul_reduce_scatter")):
        if not from_cpp(i):
            raise AssertionError(f"no {op} call was issued from C++: the cases below would test nothing")

    def right(name, got, want):
        err = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        return None if err < 2e-2 else f"{name}: relative error {err:.3g}"

    def gathered(shard):  # every rank's shard(its inputs), stacked in rank order
        return torch.cat([shard(*x).float() for x in everyone])

    def resized():  # the recorded calls' A grown in place (new memory, a new shape); the last case
        want = gathered(lambda x, *_: torch.cat([x, x])) @ b.float()
        rows = a.shape[0]
        first = a.clone()
        a.resize_(2 * rows, k)
        a[:rows], a[rows:] = first, first
        return right("A resized", ops.all_gather_matmul(a, b, group=group), want)

    def new_tensors():  # the recorded call's tensors kept, new ones elsewhere
        a2, b2 = a * 2, b.clone()
        extra = torch.empty(64 << 10)  # (a small block: moves where the small pool's next ones go)
        got = ops.all_gather_matmul(a2, b2, group=group)
        del extra
        return right("new tensors", got, gathered(lambda x, *_: x * 2) @ b.float())

    def same_b_twice():  # the signature of two distinct wide Bs, one B in both places
        before = from_cpp(0)
        got = ops.all_gather_matmul(a, [wide[0], wide[0]], group=group)
        if from_cpp(0) != before + 1:
            return "the same B twice: not issued from C++ (the signature two Bs recorded)"
        want = gathered(lambda x, *_: x) @ wide[0].float()
        return right("the same B twice", got[0], want) or right("the same B twice (second)", got[1], want)

    def strided():  # B column-major: a new stride
        got = ops.matmul_reduce_scatter(rs_a, b.t().contiguous().t(), group=group)
        total = sum(x.float() @ w.float() for _, x, w in everyone)
        return right("B column-major", got, total.chunk(world)[rank])

    cases = {
        "A float64": (lambda: ops.all_gather_matmul(a.double(), b, group=group), ["all_gather_matmul"]),
        "B float16": (lambda: ops.matmul_reduce_scatter(rs_a, b.half(), group=group), ["matmul_reduce_scatter"]),
        "B with another K": (lambda: ops.all_gather_matmul(a, b[:-8], group=group), ["all_gather_matmul"]),
        "rows the group does not divide": (lambda: ops.matmul_reduce_scatter(rs_a[:-1], b, group=group),
                                           ["matmul_reduce_scatter"]),
        "A on another GPU": (lambda: ops.all_gather_matmul(a.to(other), b.to(other), group=group),
                             ["all_gather_matmul", "all_gather_into_tensor"]),
        "new tensors": (new_tensors, None),
        "the same B twice": (same_b_twice, None),
        "B column-major": (strided, None),
        "A resized in place": (resized, None),  # (last: it changes A)
    }
    if other is None:
        del cases["A on another GPU"]
    if world == 1:  # (every row count divides)
        del cases["rows the group does not divide"]
        print(f"rank {rank}: rows the group does not divide: not checked (one rank)", flush=True)
    return cases


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("tdist")
    torch.set_default_device(device)
    dist.all_reduce(torch.ones(4))  # the heap now lives on this rank's GPU
    from tests.test_bad_input import EXPECT

    failures, checked = [], 0
    for case, (ops, types, sizes) in EXPECT.items():
        if case in NOT_ON_GPU:
            continue
        if world not in sizes:
            print(f"rank {rank}: {case:<32} not checked ({world} ranks)", flush=True)
            continue
        checked += 1
        problem = _expect_error(case, lambda: J.CASES[case](world), ops, types)
        failures += [problem] if problem else []
        print(f"rank {rank}: {case:<32} {'ok' if not problem else 'FAILED'}", flush=True)

    other = torch.device("cuda", (local + 1) % torch.cuda.device_count()) if torch.cuda.device_count() > 1 else None
    extra = {} if other is None else {
        "input on another GPU": (lambda: dist.all_reduce(torch.ones(1024, device=other)), ["all_reduce"]),
        "output on another GPU": (lambda: all_gather_single(
            torch.empty(1024 * world, device=other), torch.ones(1024)), ["all_gather_into_tensor"]),
    }
    if other is None:
        print(f"rank {rank}: tensors on another GPU: not checked (one GPU)", flush=True)
    os.environ["TDIST_HEAP_SIZE"] = "1M"
    os.environ["TDIST_ALGORITHM"] = "oneshot"  # no size handed to NCCL
    small = dist.new_group(backend="tdist")
    del os.environ["TDIST_HEAP_SIZE"], os.environ["TDIST_ALGORITHM"]
    splits = [1 << 20] * world  # given, so not even by construction: one launch, no rounds
    extra["all_to_all larger than the heap's mailboxes"] = (
        lambda: dist.all_to_all_single(torch.empty(world << 20), torch.ones(world << 20), splits, splits,
                                       group=small),
        ["all_to_all_single"])
    from torch_tdist.transports import nvshmem

    real_library = nvshmem.host_library
    nvshmem.host_library = lambda: "/nonexistent/libnvshmem_host.so.3"

    def nvshmem_group():  # the transport cannot start: the group's creation raises, naming the wheel
        os.environ["TDIST_TRANSPORT"] = "nvshmem"
        try:
            dist.new_group(backend="tdist")
        finally:
            del os.environ["TDIST_TRANSPORT"]

    extra["nvshmem transport without its library"] = (nvshmem_group, ["nvidia-nvshmem"], (RuntimeError,))
    for name, (call, ops, *types) in extra.items():
        checked += 1
        problem = _expect_error(name, call, ops, *types)
        failures += [problem] if problem else []
        print(f"rank {rank}: {name:<32} {'ok' if not problem else 'FAILED'}", flush=True)

    nvshmem.host_library = real_library

    # Arguments only rank 0 can tell are wrong, on a group that compares calls: every rank raises,
    # the others naming rank 0's rejection, and the group computes right results afterwards.
    from tests.test_bad_input import ONE_RANK

    os.environ["TDIST_CHECK_CALLS"] = "1"
    compared = dist.new_group(backend="tdist")
    del os.environ["TDIST_CHECK_CALLS"]
    if world == 1:
        print(f"rank {rank}: arguments only rank 0 can tell are wrong: not checked (one rank)", flush=True)
    for case in (c for c, expected in ONE_RANK.items() if expected == "rejected" and world > 1):
        checked += 1
        outcome = J.one_rank_rejects_then_recover(rank, world, case, 1234, group=compared)
        problem = None
        if outcome[0] != "raised" or outcome[3] > MAX_SECONDS:
            problem = f"{case} (one rank's): {outcome}"
        elif rank != 0 and "rank 0 rejected its arguments" not in outcome[2]:
            problem = f"{case} (one rank's): rank 0's rejection not named: {outcome[2]}"
        failures += [problem] if problem else []
        print(f"rank {rank}: {case + ' (one rank)':<32} {'ok' if not problem else 'FAILED'}", flush=True)

    for policy in ("sequential", "pipelined"):
        group = dist.new_group(backend="tdist", pg_options={"overlap": policy})
        for name, (call, ops, *types) in _fused_after_first_call(group, world, other).items():
            checked += 1
            problem = _expect_error(f"{policy}: {name}", call, ops, *types) if ops else call()
            failures += [f"{policy}: {problem}"] if problem else []
            print(f"rank {rank}: {policy + ': ' + name:<32} {'ok' if not problem else 'FAILED'}", flush=True)

    xs = [torch.randn(1000, generator=torch.Generator(device).manual_seed(r)) for r in range(world)]
    x = xs[rank].clone()
    dist.all_reduce(x)
    checked += 1
    if not torch.allclose(x, sum(xs), rtol=1e-5, atol=1e-5):
        failures.append("all_reduce after the bad calls: wrong result")
    report_and_exit(rank, checked, failures, "bad-input checks")


if __name__ == "__main__":
    main()
