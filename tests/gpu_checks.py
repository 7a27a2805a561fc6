"""tdist on GPUs, checked against NCCL in the same job (one process per GPU).

    torchrun --nproc-per-node 4 -m tests.gpu_checks [--only NAME,...]

Run by ``tests/test_gpu.py`` (pytest -m gpu) on the device. The default group is NCCL; every
check runs the same call on a tdist group and on NCCL with fresh random inputs and compares.
Each call shape runs three times: the first is served by Python's executor, the later ones by
the launch plan it recorded (``csrc/device_path.hpp``). Prints one line per check and exits
non-zero if any failed.
"""

import argparse
import contextlib
import faulthandler
import os
import sys
import time

import torch_tdist.launch  # noqa: E402,F401  (importing it sets the NVLink-multicast safety variables)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tdist  # noqa: E402
from torch_tdist import overlap  # noqa: E402
from torch_tdist.collectives import GPU_SIZE_LIMITS  # noqa: E402
from torch_tdist.compat import all_gather_single, reduce_scatter_single  # noqa: E402
from torch_tdist.overlap import fused, pipelined  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64,
          torch.uint8)
SIZES = (1001, 65536)  # elements per rank: odd (unaligned), and several programs' worth
ALL_REDUCE_OPS_FOR = (torch.float32, torch.bfloat16)  # other dtypes: sum only (compile time)
REPEATS = 3
CHECK_TIMEOUT_S = float(os.environ.get("TDIST_CHECK_TIMEOUT", "240"))  # per check; see main()
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}

_failures = []
_checked = 0


def _rand(n, dtype, device, gen):
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen, device=device).to(dtype)
    high = 4 if dtype == torch.uint8 else 1000
    return torch.randint(0, high, (n,), generator=gen, device=device).to(dtype)


def _same(got, want):
    if got.dtype.is_floating_point:
        tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3}.get(got.dtype, 1e-5)
        return torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    return torch.equal(got, want)


def _check(name, got, want):
    global _checked
    _checked += 1
    if not _same(got, want):
        diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        _failures.append(f"{name}: max abs diff {diff}")


def _pair(fn, tdist_group):
    """fn(group) on the tdist group and on NCCL (the default group)."""
    return fn(tdist_group), fn(None)


def _gathered(x, world):
    """fn(group): ``x`` all-gathered into an output filled with 7s first."""
    def gather(g):
        out = torch.full((x.numel() * world,), 7, dtype=x.dtype, device=x.device)
        all_gather_single(out, x, group=g)
        return out
    return gather


def _all_reduced(x, op):
    """fn(group): a copy of ``x`` all-reduced with ``op``."""
    def reduce_all(g):
        t = x.clone()
        dist.all_reduce(t, op=op, group=g)
        return t
    return reduce_all


def report_and_exit(rank, checked: int, failures: list[str], what: str = "checks"):
    """The last lines of a GPU check script: the first failures and the count; exits non-zero
    if any failed."""
    for line in failures[:20]:
        print(f"rank {rank}: {line}", flush=True)
    print(f"rank {rank}: {checked} {what}, {len(failures)} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


def every_op(tg, rank, world, device, gen):
    handed_before = torch_tdist.stats(tg)["all_to_all_single"]["fallback"]
    for dtype in DTYPES:
        for n in SIZES:
            for trial in range(REPEATS):
                tag = f"{str(dtype)[6:]} n={n} #{trial}"
                x = _rand(n, dtype, device, gen)

                _check(f"all_gather {tag}", *_pair(_gathered(x, world), tg))

                def bcast(g, root=world - 1):
                    t = x.clone()
                    dist.broadcast(t, root, group=g)
                    return t
                _check(f"broadcast {tag}", *_pair(bcast, tg))

                def a2a(g):
                    src = _rand(n * world, dtype, device, torch.Generator(device).manual_seed(rank * 7 + trial))
                    out = torch.full_like(src, 7)
                    dist.all_to_all_single(out, src, group=g)
                    return out
                _check(f"all_to_all_single {tag}", *_pair(a2a, tg))

                for name, rop in REDUCE_OPS.items():
                    if name == "avg" and not dtype.is_floating_point or dtype == torch.uint8:
                        continue
                    if name != "sum" and dtype not in ALL_REDUCE_OPS_FOR:
                        continue
                    y = x if name != "product" else 1 + x / 64 if dtype.is_floating_point else x % 3

                    _check(f"all_reduce {name} {tag}", *_pair(_all_reduced(y, rop), tg))

                    def reduce_scatter(g):
                        src = torch.cat([y] * world) + rank if name != "product" else torch.cat([y] * world)
                        out = torch.full_like(y, 7)
                        reduce_scatter_single(out, src, op=rop, group=g)
                        return out
                    _check(f"reduce_scatter {name} {tag}", *_pair(reduce_scatter, tg))
    handed = torch_tdist.stats(tg)["all_to_all_single"]["fallback"] - handed_before
    if handed:  # even all-to-alls are tdist's at every size
        _failures.append(f"all_to_all_single: {handed} even calls handed to NCCL")


def uneven_all_to_all(tg, rank, world, device, gen):
    """all_to_all_single with split sizes through tdist's kernel (uneven_all_to_all; by
    default NCCL serves it): uneven splits with empty pairs, a rank that sends nothing, even
    splits given explicitly, rows whose offsets break 16-byte accesses (fp32 rows of 7), each
    kind twice or more, so later calls replay the launch plan with a table C++ wrote; four
    replays back to back with their own splits, every other one async; then a CUDA graph of an
    uneven call whose splits no call had before, replayed on fresh inputs; then a rank pair too
    large for its mailbox."""
    kg = _tdist_group({"uneven_all_to_all": "1"})
    calls = 0

    def a2a_pair(group, splits, row, dtype, label):
        src = torch.randn(int(splits[rank].sum()), row, device=device, generator=gen).to(dtype)

        def a2a(grp):
            out = torch.full((int(splits[:, rank].sum()), row), 7, dtype=src.dtype, device=device)
            dist.all_to_all_single(out, src, splits[:, rank].tolist(), splits[rank].tolist(), group=grp)
            return out
        _check(f"all_to_all_single {label}", *_pair(a2a, group))

    for trial in range(6):
        g = torch.Generator().manual_seed(100 + trial)  # the same split table on every rank
        splits = torch.randint(0, 300, (world, world), generator=g)  # splits[src][dst] rows
        splits[splits < 40] = 0
        label = "uneven"
        if trial == 1:
            splits[:] = 2
            label = "even splits given"
        elif trial == 2:
            splits[world - 1] = 0
            label = f"uneven, rank {world - 1} sends nothing"
        a2a_pair(kg, splits, 7168 // 16, torch.bfloat16, f"{label} #{trial}")
        if trial % 2:
            a2a_pair(kg, splits, 7, torch.float32, f"{label}, fp32 rows of 7 #{trial}")
            calls += 1
        calls += 1

    # replays back to back, each with its own splits and no host synchronisation between them,
    # every other one async_op=True (on the group's stream), then each against NCCL
    row = 512
    pending = []
    for trial in range(4):
        splits = torch.randint(0, 60, (world, world), generator=torch.Generator().manual_seed(300 + trial))
        x = torch.randn(int(splits[rank].sum()), row, device=device, generator=gen).to(torch.bfloat16)
        out = torch.full((int(splits[:, rank].sum()), row), 7, dtype=x.dtype, device=device)
        work = dist.all_to_all_single(out, x, splits[:, rank].tolist(), splits[rank].tolist(), group=kg,
                                      async_op=bool(trial % 2))
        pending.append((splits, x, out, work))
        calls += 1
    for trial, (splits, x, out, work) in enumerate(pending):
        if work is not None:
            work.wait()
        want = torch.empty_like(out)
        dist.all_to_all_single(want, x, splits[:, rank].tolist(), splits[rank].tolist())
        _check(f"all_to_all_single uneven, back to back #{trial}", out, want)

    g = torch.Generator().manual_seed(200)
    splits = torch.randint(1, 50, (world, world), generator=g)
    static_in = torch.zeros(int(splits[rank].sum()), row, device=device, dtype=torch.bfloat16)
    static_out = torch.zeros(int(splits[:, rank].sum()), row, device=device, dtype=torch.bfloat16)
    graph = _captured(lambda: dist.all_to_all_single(static_out, static_in, splits[:, rank].tolist(),
                                                     splits[rank].tolist(), group=kg), warmups=0)
    calls += 1  # the capture
    for replay in range(3):
        x = torch.randn(static_in.shape, device=device, generator=gen).to(torch.bfloat16)
        static_in.copy_(x)
        static_out.fill_(7)
        graph.replay()
        want = torch.empty_like(static_out)
        dist.all_to_all_single(want, x, splits[:, rank].tolist(), splits[rank].tolist())
        _check(f"all_to_all_single uneven, captured with new splits #{replay}", static_out, want)
    served = torch_tdist.stats(kg)["all_to_all_single"]
    global _checked
    _checked += 1
    if served["tdist"] != calls or served["fallback"]:
        _failures.append(f"all_to_all_single: {calls} calls, but stats {served}")

    # a pair too large for its mailbox (64M / (8 x world) on a 64M heap): its two ranks raise,
    # the other pairs arrive, and the group goes on (a pair of ranks: two or more)
    if world < 2:
        print(f"rank {rank}: uneven_all_to_all: the mailbox-overflow case needs 2 ranks; not checked", flush=True)
        return
    small = _tdist_group({"uneven_all_to_all": "1", "heap_size": "64M"})
    splits = torch.full((world, world), 3)
    a2a_pair(small, splits, 512, torch.bfloat16, "on a 64M heap")  # (which makes the heap)
    big = torch_tdist.get_executor(small).mailbox_bytes // 2 // 512 + 1
    splits[0, 1] = big
    src = torch.randn(int(splits[rank].sum()), 512, device=device, generator=gen).to(torch.bfloat16)
    got = torch.full((int(splits[:, rank].sum()), 512), 7, dtype=src.dtype, device=device)
    try:
        dist.all_to_all_single(got, src, splits[:, rank].tolist(), splits[rank].tolist(), group=small)
        raised = ""
    except ValueError as err:
        raised = str(err)
    want = torch.empty_like(got)
    dist.all_to_all_single(want, src, splits[:, rank].tolist(), splits[rank].tolist())
    _checked += 1
    if (rank in (0, 1)) != ("TDIST_HEAP_SIZE" in raised):
        _failures.append(f"all_to_all_single with a pair too large for a mailbox: rank {rank} raised {raised!r}")
    keep = torch.ones(got.shape[0], dtype=torch.bool, device=device)
    if rank == 1:
        keep[:big] = False  # rank 0's rows: not delivered
    _check("all_to_all_single, the pairs that fit beside one too large", got[keep], want[keep])
    splits[0, 1] = 3
    a2a_pair(small, splits, 512, torch.bfloat16, "after a call too large for a mailbox")


def uneven_all_to_all_in_turns(tg, rank, world, device, gen):
    """all_to_all_single with split sizes whose shares are larger than a mailbox slot, which the
    streamed kernel moves in turns (the default: uneven_all_to_all unset): on the default
    heap (32 MB slots with 4 ranks) and on a 256M one (a ring of 3 steps per program and slot
    with 4 ranks, so turns come every third step), three times each (the later calls replay
    C++'s plan, the second is async); two CUDA graphs of such a call replayed in turn on fresh inputs; then a call whose splits
    rank 1 gets wrong (it expects fewer rows from rank 0 than rank 0 sends): no rank waits in
    vain, the group goes on, and with TDIST_CHECK_CALLS=1 rank 1 raises."""
    if world < 2:
        print(f"rank {rank}: uneven_all_to_all_in_turns needs 2 ranks; not checked", flush=True)
        return
    row = 7168

    def splits_for(seed, most_rows):
        splits = torch.randint(0, most_rows, (world, world), generator=torch.Generator().manual_seed(seed))
        splits[0, 1] = most_rows  # at least one share larger than a slot
        splits[world - 1, 0] = 0
        return splits

    def a2a(group, splits, x, recv=None, async_op=False):
        recv = splits[:, rank].tolist() if recv is None else recv
        out = torch.full((sum(recv), row), 7, dtype=x.dtype, device=device)
        work = dist.all_to_all_single(out, x, recv, splits[rank].tolist(), group=group, async_op=async_op)
        if work is not None:
            work.wait()
        return out

    for label, env in (("default heap", {}), ("256M heap", {"heap_size": "256M"})):
        group = _tdist_group(env)
        dist.all_reduce(torch.ones(1, device=device), group=group)  # (the heap comes with a first call)
        slot_rows = torch_tdist.get_executor(group).mailbox_bytes // 2 // row
        for trial in range(3):
            splits = splits_for(400 + trial, 2 * slot_rows + 5)
            x = torch.randn(int(splits[rank].sum()), row, device=device, generator=gen).to(torch.bfloat16)
            _check(f"all_to_all_single in turns, {label} #{trial}", a2a(group, splits, x, async_op=trial == 1),
                   a2a(None, splits, x))
        served = torch_tdist.stats(group)["all_to_all_single"]
        global _checked
        _checked += 1
        if served["tdist"] != 3 or served["fallback"]:
            _failures.append(f"all_to_all_single in turns, {label}: 3 calls, but stats {served}")

    splits = splits_for(500, 2 * slot_rows + 5)  # (the 256M group's)
    static_in = torch.zeros(int(splits[rank].sum()), row, device=device, dtype=torch.bfloat16)
    static_out = torch.zeros(int(splits[:, rank].sum()), row, device=device, dtype=torch.bfloat16)
    # two graphs of the same call (they share its captured table), replayed in turn
    graphs = [_captured(lambda: dist.all_to_all_single(static_out, static_in, splits[:, rank].tolist(),
                                                       splits[rank].tolist(), group=group), warmups=0)
              for _ in range(2)]
    for replay in range(4):
        x = torch.randn(static_in.shape, device=device, generator=gen).to(torch.bfloat16)
        static_in.copy_(x)
        static_out.fill_(7)
        graphs[replay % 2].replay()
        _check(f"all_to_all_single in turns, graph {replay % 2} replay #{replay // 2}", static_out,
               a2a(None, splits, x))

    # wrong splits: on the group above (C++ replays, which raise nothing on GPUs), and on one with
    # TDIST_CHECK_CALLS=1, where rank 1 raises
    checked = _tdist_group({"heap_size": "256M", "check_calls": "1"})
    for grp, label in ((group, "replayed"), (checked, "TDIST_CHECK_CALLS=1")):
        x = torch.randn(int(splits[rank].sum()), row, device=device, generator=gen).to(torch.bfloat16)
        recv = splits[:, rank].tolist()
        if rank == 1:
            recv[0] -= slot_rows
        try:
            a2a(grp, splits, x, recv=recv)
            raised = ""
        except ValueError as err:
            raised = str(err)
        _checked += 1
        if (rank == 1 and grp is checked) != ("different call" in raised):
            _failures.append(f"all_to_all_single in turns with splits rank 1 got wrong, {label}: rank {rank} "
                             f"raised {raised!r}")
        x = torch.randn(int(splits[rank].sum()), row, device=device, generator=gen).to(torch.bfloat16)
        _check(f"all_to_all_single in turns, after a call with wrong splits, {label}", a2a(grp, splits, x),
               a2a(None, splits, x))


def subgroups(tg, rank, world, device, gen):
    if world < 4:
        print(f"rank {rank}: subgroups needs 4 ranks; not checked", flush=True)
        return
    halves = [dist.new_group([0, 1], backend="tdist"), dist.new_group([2, 3], backend="tdist")]
    mine = halves[rank // 2]
    if NVSHMEM:  # NVSHMEM's PEs are the whole job: a subgroup gets a clear error
        global _checked
        _checked += 1
        try:
            dist.all_reduce(torch.ones(8, device=device), group=mine)
            _failures.append("subgroup on the nvshmem transport: no error")
        except Exception as err:
            if "TDIST_TRANSPORT=cuda for subgroups" not in str(err):
                _failures.append(f"subgroup on the nvshmem transport: unclear error {err}")
        return
    for trial in range(REPEATS):
        x = torch.randn(5000, device=device, generator=gen)
        everyone = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(everyone, x)  # NCCL: the reference
        got = x.clone()
        dist.all_reduce(got, group=mine)
        base = rank // 2 * 2
        _check(f"subgroup all_reduce #{trial}", got, everyone[base] + everyone[base + 1])


def dtensor(tg, rank, world, device, gen):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(tg, "cuda")
    full = torch.randn(world * 64, 96, device=device, generator=torch.Generator(device).manual_seed(5))
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    _check("dtensor Shard(0) -> Replicate", sharded.redistribute(mesh, [Replicate()]).to_local(), full)
    local = torch.randn(32, 32, device=device, generator=gen)
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    w = torch.randn(32, 32, device=device, generator=torch.Generator(device).manual_seed(6))

    partial = DTensor.from_local(local @ w, mesh, [Partial()])
    _check("dtensor Partial -> Replicate", partial.redistribute(mesh, [Replicate()]).to_local(),
           sum(e @ w for e in everyone))


def async_overlap(tg, rank, world, device, gen):
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16, generator=gen)
    x = torch.randn(256 << 10, device=device, generator=gen).to(torch.bfloat16)  # tdist-served
    want = x.clone()
    dist.all_reduce(want)

    def timed(fn):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    def compute():
        for _ in range(4):
            a @ a

    got = x.clone()
    dist.all_reduce(got, group=tg)  # warm: the plan exists
    compute()  # warm: cuBLAS
    t_compute = timed(compute)
    t_comm = timed(lambda: dist.all_reduce(x.clone(), group=tg))

    def both():
        nonlocal got
        got = x.clone()
        work = dist.all_reduce(got, group=tg, async_op=True)
        compute()
        work.wait()
        got.mul_(1)  # a kernel on the caller's stream after wait(): must see the result

    served = torch_tdist.stats(tg)["all_reduce"]["tdist"]
    t_both = timed(both)
    _check("async all_reduce during matmuls", got, want)
    _check("async all_reduce served by tdist", torch.tensor(torch_tdist.stats(tg)["all_reduce"]["tdist"]),
           torch.tensor(served + 1))
    if rank == 0:
        print(f"async overlap: compute {t_compute:.2f} ms, all_reduce {t_comm:.2f} ms, "
              f"both {t_both:.2f} ms (serial would be {t_compute + t_comm:.2f})", flush=True)


def stream_changes(tg, rank, world, device, gen):
    """Calls of one group on three streams with no user synchronisation between the group's
    calls: an async all_reduce on the group's stream held back by matmuls on the caller's, then
    a synchronous all_gather on a second stream that does not wait for the caller's, then a
    synchronous reduce_scatter on the caller's stream, then a synchronous all_reduce on the
    second stream held back by matmuls there, then an async all_reduce from the caller's. The
    group orders each call after the previous one (its kernels' signals rely on that order), so
    every result matches NCCL's."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16, generator=gen)
    side = torch.cuda.Stream(device)
    served = {op: torch_tdist.stats(tg)[op]["tdist"] for op in ("all_reduce", "all_gather_into_tensor",
                                                                 "reduce_scatter_tensor")}
    rounds = 20
    for trial in range(rounds):
        x, v, w = (torch.randn(65536, device=device, generator=gen) for _ in range(3))
        y = torch.randn(4096, device=device, generator=gen)
        z = torch.randn(4096 * world, device=device, generator=gen)
        want_x, want_v, want_w = x.clone(), v.clone(), w.clone()
        want_y, want_z = torch.empty(4096 * world, device=device), torch.empty(4096, device=device)
        for t in (want_x, want_v, want_w):
            dist.all_reduce(t)
        all_gather_single(want_y, y)
        reduce_scatter_single(want_z, z)
        got_y, got_z = torch.full_like(want_y, 7), torch.full_like(want_z, 7)
        _calls_across_streams(tg, a, side, x, v, w, y, z, got_y, got_z)
        _check(f"async all_reduce before a call on another stream #{trial}", x, want_x)
        _check(f"all_gather on a side stream #{trial}", got_y, want_y)
        _check(f"reduce_scatter back on the caller's stream #{trial}", got_z, want_z)
        _check(f"all_reduce on the side stream after matmuls there #{trial}", w, want_w)
        _check(f"async all_reduce from the caller's stream after it #{trial}", v, want_v)
    for op, calls in (("all_reduce", 3 * rounds), ("all_gather_into_tensor", rounds), ("reduce_scatter_tensor", rounds)):
        _check(f"{op} served by tdist on every stream", torch.tensor(torch_tdist.stats(tg)[op]["tdist"]),
               torch.tensor(served[op] + calls))


def _calls_across_streams(tg, a, side, x, v, w, y, z, got_y, got_z):
    """stream_changes' calls: all_reduce(x) async behind matmuls, all_gather(y) on ``side``,
    reduce_scatter(z) on the caller's stream, all_reduce(w) on ``side`` behind matmuls there,
    all_reduce(v) async; then the caller's stream waits for all of them."""
    side.wait_stream(torch.cuda.current_stream())  # the inputs are ready on both streams
    for _ in range(4):
        a @ a
    work = dist.all_reduce(x, group=tg, async_op=True)
    with torch.cuda.stream(side):
        all_gather_single(got_y, y, group=tg)
    reduce_scatter_single(got_z, z, group=tg)
    with torch.cuda.stream(side):
        for _ in range(4):
            a @ a
        dist.all_reduce(w, group=tg)
    work_v = dist.all_reduce(v, group=tg, async_op=True)
    work.wait()
    work_v.wait()
    torch.cuda.current_stream().wait_stream(side)


def captured_stream_changes(tg, rank, world, device, gen):
    """stream_changes' calls captured in one CUDA graph (the second stream joins the capture),
    replayed on fresh inputs: inside a capture the group orders its calls across streams as it
    does outside one (synchronous calls on the caller's stream, one kernel after another)."""
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16, generator=gen)
    side = torch.cuda.Stream(device)
    x, v, w = (torch.zeros(65536, device=device) for _ in range(3))
    y, z = torch.zeros(4096, device=device), torch.zeros(4096 * world, device=device)
    got_y, got_z = torch.empty(4096 * world, device=device), torch.empty(4096, device=device)

    graph = _captured(lambda: _calls_across_streams(tg, a, side, x, v, w, y, z, got_y, got_z), warmups=2)
    for replay in range(10):
        fresh = [torch.randn(t.numel(), device=device, generator=gen) for t in (x, v, w, y, z)]
        for t, f in zip((x, v, w, y, z), fresh):
            t.copy_(f)
        got_y.fill_(7)
        got_z.fill_(7)
        graph.replay()
        want_x, want_v, want_w = (f.clone() for f in fresh[:3])
        for t in (want_x, want_v, want_w):
            dist.all_reduce(t)
        want_y, want_z = torch.empty_like(got_y), torch.empty_like(got_z)
        all_gather_single(want_y, fresh[3])
        reduce_scatter_single(want_z, fresh[4])
        _check(f"captured async all_reduce #{replay}", x, want_x)
        _check(f"captured all_gather on a side stream #{replay}", got_y, want_y)
        _check(f"captured reduce_scatter on the caller's stream #{replay}", got_z, want_z)
        _check(f"captured all_reduce on the side stream after matmuls #{replay}", w, want_w)
        _check(f"captured async all_reduce from the caller's stream #{replay}", v, want_v)


def _captured(calls, warmups):
    """A CUDA graph of ``calls()``, after ``warmups`` runs on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph


def graph_replay(tg, rank, world, device, gen):
    _graph_replays(tg, "", 65536, 4096, torch.bfloat16, 100, warmups=3, device=device, gen=gen)


def _graph_replays(group, label, n, ag_n, ag_dtype, replays, warmups, device, gen):
    """A CUDA graph of an all_reduce (``n`` fp32) and an all_gather (``ag_n`` of ``ag_dtype``)
    on ``group``, replayed on fresh inputs, each replay against NCCL. The warm-ups compile the
    kernels and record the launch plans before the capture."""
    world = dist.get_world_size()
    static_x = torch.zeros(n, device=device)
    static_ag_in = torch.zeros(ag_n, device=device, dtype=ag_dtype)
    static_ag = torch.zeros(ag_n * world, device=device, dtype=ag_dtype)

    def calls():
        dist.all_reduce(static_x, group=group)
        all_gather_single(static_ag, static_ag_in, group=group)
    graph = _captured(calls, warmups)
    for i in range(replays):
        x = torch.randn(n, device=device, generator=gen)
        y = torch.randn(ag_n, device=device, generator=gen).to(ag_dtype)
        static_x.copy_(x)
        static_ag_in.copy_(y)
        graph.replay()
        want_x, want_ag = x.clone(), torch.empty_like(static_ag)
        dist.all_reduce(want_x)
        all_gather_single(want_ag, y)
        _check(f"{label}graph replay {i} all_reduce", static_x, want_x)
        _check(f"{label}graph replay {i} all_gather", static_ag, want_ag)


def bulk_path(tg, rank, world, device, gen):
    """The bulk path (chunk flags; pushes by the copy engines, then by the push kernel) on
    groups that take it at every size: all_gather, reduce_scatter and all_reduce with odd
    element counts and several chunks, then 20 CUDA-graph replays of them."""
    from torch_tdist import bulk

    if NVSHMEM:  # more NVSHMEM heaps of 1 GB per rank than the runs allow for
        return
    for pusher in bulk.PUSHERS:
        bg = _tdist_group({"algorithm": "bulk", "bulk_push": pusher})
        chunk_bytes = bulk.CHUNK_BYTES[pusher]
        bulk.CHUNK_BYTES[pusher] = 1 << 20
        _large_calls(bg, f"bulk {pusher}", (1001, "3M", 65536), world, device, gen)
        bulk.CHUNK_BYTES[pusher] = chunk_bytes
        _progress(rank, f"bulk_path: {pusher} calls done")
        n = (2 << 20) + 3
        _graph_replays(bg, f"bulk {pusher} ", n, n, torch.float32, 20, warmups=1, device=device, gen=gen)
        _progress(rank, f"bulk_path: {pusher} graph replays done")


def _progress(rank, what):
    torch.cuda.synchronize()
    print(f"rank {rank}: {what}", flush=True)


def _large_calls(group, label, sizes, world, device, gen):
    """all_gather, reduce_scatter and all_reduce (sum, avg, max) on ``group`` against NCCL, fp32
    and bf16, at ``sizes`` elements per rank ("3M": 3 MB and 5 elements)."""
    for dtype in (torch.float32, torch.bfloat16):
        for trial, n in enumerate(sizes):
            if n == "3M":
                n = (3 << 20) // dtype.itemsize + 5
            tag = f"{label} {str(dtype)[6:]} n={n} #{trial}"
            x = _rand(n, dtype, device, gen)

            _check(f"all_gather {tag}", *_pair(_gathered(x, world), group))
            for name in ("sum", "avg", "max"):
                wide = _rand(n * world, dtype, device, gen)

                def reduce_scatter(g):
                    out = torch.full((n,), 7, dtype=dtype, device=device)
                    reduce_scatter_single(out, wide, op=REDUCE_OPS[name], group=g)
                    return out
                _check(f"reduce_scatter {name} {tag}", *_pair(reduce_scatter, group))

                _check(f"all_reduce {name} {tag}", *_pair(_all_reduced(x, REDUCE_OPS[name]), group))


def streamed_path(tg, rank, world, device, gen):
    """The streamed kernel (triton_kernels/streamed.py) on a group that takes it at every size,
    with a 64 MB heap (2 MB mailbox slots on 4 ranks, so the larger messages take several rounds
    of many steps): all_gather, reduce_scatter and all_reduce (in place) with odd element
    counts, also with blocks from 2 KB (streamed_min_block_bytes), then 20 CUDA-graph replays of a 1 MB all_reduce (its all_gather streamed too); and
    the default group at 4 MB (all_gather streamed there, all_reduce two-shot, reduce_scatter one-shot)."""
    sg = _tdist_group({"algorithm": "streamed", "heap_size": "64M"})
    _large_calls(sg, "streamed", (1001, "3M", (5 << 20) + 3), world, device, gen)
    small_blocks = _tdist_group({"algorithm": "streamed", "heap_size": "64M",
                                 "streamed_min_block_bytes": "2048"})
    _large_calls(small_blocks, "streamed, blocks from 2 KB", (1001, "3M"), world, device, gen)
    _large_calls(tg, "auto", ((1 << 20) + 3,), world, device, gen)
    _progress(rank, "streamed_path: calls done")
    n = (1 << 18) + 3
    _graph_replays(sg, "streamed ", n, n, torch.float32, 20, warmups=1, device=device, gen=gen)


@contextlib.contextmanager
def _launches_of(owner, name: str, what):
    """A list that gets ``what(args)`` of every call of ``owner.<name>`` (a function of an
    algorithm module, or a method of an algorithm class) made inside the block (which kernel
    served what)."""
    original = getattr(owner, name)
    served = []

    def counted(*args, **kwargs):
        served.append(what(args))
        return original(*args, **kwargs)
    setattr(owner, name, counted)
    try:
        yield served
    finally:
        setattr(owner, name, original)


def twoshot_path(tg, rank, world, device, gen):
    """The two-shot all_reduce (triton_kernels/twoshot.py) on a group that takes it at every size,
    with a 64 MB heap (1 MB a share on 4 ranks, so the largest call takes two rounds): fp32 and
    bf16 (sum, avg, max) with odd element counts, back to back with all_gather and reduce_scatter
    (one-shot there); a 1 MB all_reduce three times on it and on the default tdist group (two-shot
    there too; the later calls replayed by C++); then 20 CUDA-graph replays of a 1 MB fp32 all_reduce."""
    from torch_tdist.collectives import twoshot

    wg = _tdist_group({"algorithm": "twoshot", "heap_size": "64M"})
    with _launches_of(twoshot, "launch", lambda args: args[1]) as served:
        _large_calls(wg, "twoshot", (3, 1001, "3M", (1 << 20) + 3), world, device, gen)
        for trial in range(3):  # one shape again: the later calls replay C++'s launch plan
            for group, label in ((wg, "twoshot"), (tg, "auto")):  # (1 MB and 3 elements: two-shot in both)
                x = _rand((1 << 18) + 3, torch.float32, device, gen)
                _check(f"{label} all_reduce sum n={x.numel()} #{trial}", *_pair(_all_reduced(x, REDUCE_OPS["sum"]), group))
    global _checked
    _checked += 1
    if len(served) < 2 * 4 * 3 + 3:  # 2 dtypes x 4 sizes x 3 reduce ops (the 4 MB ones in two rounds), the 1 MB ones
        _failures.append(f"twoshot: the kernel served {len(served)} launches, not every all_reduce")
    _graph_replays(wg, "twoshot ", 1 << 18, 4096, torch.bfloat16, 20, warmups=1, device=device, gen=gen)


def multi_round_plans(tg, rank, world, device, gen):
    """Calls whose message takes several rounds of the mailboxes (a 16 MB heap: slots of about
    400 KB on 4 ranks) are replayed from C++ after their first call, every round's launch:
    all_gather, reduce_scatter (sum), all_reduce (one-shot and two-shot sizes),
    all_to_all_single and broadcast of about 1 MB (what tdist serves on GPUs), three calls each
    of one shape with fresh data and outputs first filled with 7s, against NCCL; the later calls
    launch nothing from Python."""
    from torch_tdist.collectives import oneshot, twoshot

    hg = _tdist_group({"heap_size": "16M"})
    n = (1 << 18) - 8 * world  # fp32 elements per rank: 1 MB less 32 bytes a rank
    for trial in range(3):
        with _launches_of(oneshot, "launch", lambda args: args[1]) as one, \
                _launches_of(twoshot, "launch", lambda args: args[1]) as two:
            x = _rand(n, torch.float32, device, gen)
            _check(f"rounds all_gather #{trial}", *_pair(_gathered(x, world), hg))
            wide = _rand(n * world, torch.float32, device, gen)

            def scatter(g, wide=wide):
                out = torch.full((n,), 7.0, device=device)
                reduce_scatter_single(out, wide, group=g)
                return out
            _check(f"rounds reduce_scatter #{trial}", *_pair(scatter, hg))
            for size in (n, 150_001):  # (two-shot in rounds; one-shot in rounds)
                _check(f"rounds all_reduce n={size} #{trial}", *_pair(_all_reduced(_rand(size, torch.float32, device, gen),
                                                                                     REDUCE_OPS["sum"]), hg))

            def exchange(g, x=x):
                out = torch.full_like(x, 7.0)
                dist.all_to_all_single(out, x, group=g)
                return out
            _check(f"rounds all_to_all_single #{trial}", *_pair(exchange, hg))

            def broadcast(g, x=x, root=min(1, world - 1)):
                t = x.clone() if rank == root else torch.full_like(x, 7.0)
                dist.broadcast(t, root, group=g)
                return t
            _check(f"rounds broadcast #{trial}", *_pair(broadcast, hg))
        global _checked
        _checked += 1
        if trial > 0 and (one or two):
            _failures.append(f"rounds: call {trial} launched from Python: {one + two}")


def lowlatency_path(tg, rank, world, device, gen):
    """The low-latency kernel (triton_kernels/lowlatency.py) on a group that takes it wherever a
    call fits: all_gather, reduce_scatter and all_reduce (sum, avg, max) in fp32 and bf16 at
    sizes of one word to a full slot, even all-to-alls of bf16 and uint8, then 20 CUDA-graph
    replays (an all_gather of 4096 bf16 and an all_reduce of 1000 fp32, both low-latency)."""
    from torch_tdist import collectives
    from torch_tdist.collectives.lowlatency import LowLatency

    lg = _tdist_group({"algorithm": "lowlatency"})
    with _launches_of(LowLatency, "run", lambda args: args[2].family) as served:
        _large_calls(lg, "lowlatency", (2, 1000, 4096 + 8, collectives.LOWLATENCY_SLOT_WORDS), world, device, gen)
        for dtype in (torch.bfloat16, torch.uint8):
            for n in (8, 4096):
                x = _rand(n * world, dtype, device, gen)

                def exchange(g):
                    out = torch.full_like(x, 7)
                    dist.all_to_all_single(out, x, group=g)
                    return out
                _check(f"lowlatency all_to_all_single {str(dtype)[6:]} n={n}", *_pair(exchange, lg))
    global _checked
    _checked += 1
    if not {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"} <= set(served):
        _failures.append(f"lowlatency: the kernel served only {sorted(set(served))}")
    _graph_replays(lg, "lowlatency ", 1000, 4096, torch.bfloat16, 20, warmups=1, device=device, gen=gen)


def served_by_tdist(tg, rank, world, device, gen):
    """Each op that tdist serves on GPUs was served by its kernels in every_op's calls."""
    if every_op.__name__ not in _ran:
        print(f"rank {rank}: served_by_tdist counts every_op's calls, which did not run; not checked", flush=True)
        return
    stats = torch_tdist.stats(tg)
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
               "broadcast"):
        if GPU_SIZE_LIMITS[op] == 0:  # NCCL serves it on GPUs
            continue
        global _checked
        _checked += 1
        if stats[op]["tdist"] == 0:
            _failures.append(f"stats: no {op} served by tdist kernels: {stats[op]}")


def fused_ops(tg, rank, world, device, gen):
    """torch_tdist.ops on CUDA tensors (bf16, seed-like shapes scaled down, and odd ones), on the
    sequential path, on the overlapping kernels with both pushers, pipelined (twice: recorded, then
    replayed), and tuned: outputs and gradients against NCCL + torch.matmul in float32; relative
    error <= 1e-2."""
    _ops_against_nccl(tg, "sequential", rank, world, device, gen)
    if NVSHMEM:
        return
    overlapped = {"fused sm": {"overlap": "fused", "bulk_push": "sm"},
                  "fused copy_engine": {"overlap": "fused", "bulk_push": "copy_engine"},
                  "pipelined": {"overlap": "pipelined"}}
    for label, env in overlapped.items():
        og = _tdist_group(env)
        # pipelined: the second call of each shape replays the first's record from C++, with new tensors
        repeats = 2 if label == "pipelined" else 1
        for _ in range(repeats):
            _ops_against_nccl(og, label, rank, world, device, gen)
        state = overlap.state(og)
        served = state.fused_calls["all_gather_matmul"]
        if served != 2 * repeats:
            _failures.append(f"{label}: {served} calls overlapped, expected {2 * repeats}")
        replayed = state.replays.replayed_calls
        if label == "pipelined" and min(replayed["all_gather_matmul"], replayed["matmul_reduce_scatter"]) < 2:
            _failures.append(f"pipelined: calls replayed from C++: {dict(replayed)}, expected 2 or more of each op")
    tuned = _tdist_group({"overlap": "tune"})  # every way runs while tuning
    _ops_against_nccl(tuned, "tuned", rank, world, device, gen)
    if rank == 0:
        print(f"fused_ops: tuning chose {overlap.state(tuned).tuning.tuned}", flush=True)


def fused_tile_configs(tg, rank, world, device, gen):
    """The fused kernels in every tile config (overlap.fused.GEMM_CONFIGS: tile shapes, stages,
    grouped tile orders) and dtype, called directly (not tuned), against NCCL + torch.matmul in
    float64: 1100 rows a rank (9 row blocks of 128: a group of 8 and a short one), a K and a
    width that leave part tiles. Relative error <= 1e-2 (16 bits), 1e-5 (float32, IEEE
    products)."""
    state = overlap.state(_tdist_group({"overlap": "fused"}))
    m, k, n = 1100, 328, 600
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        a = torch.randn(m, k, device=device, generator=gen).to(dtype)
        b = torch.randn(n, k, device=device, generator=gen).to(dtype).t()  # (as nn.Linear weights come)
        a_full = torch.empty(world * m, k, device=device, dtype=torch.float64)
        all_gather_single(a_full, a.double())
        a2 = torch.randn(world * m, k, device=device, generator=gen).to(dtype)
        want = torch.empty(m, n, device=device, dtype=torch.float64)
        reduce_scatter_single(want, a2.double() @ b.double())
        for i, tiles in enumerate(fused.GEMM_CONFIGS):
            label = f"fused_tile_configs {dtype} config {i}"
            out, a_out = a.new_empty(world * m, n), a.new_empty(world * m, k)
            if not fused.all_gather_matmul(state, a, [b], [out], a_out, tiles):
                _failures.append(f"{label}: all_gather_matmul did not run")
                continue
            _relative(f"{label} all_gather_matmul", out, a_full @ b.double(), tolerance)
            _check(f"{label} all_gather_matmul's gathered A", a_out, a_full.to(dtype))
            out2 = a.new_empty(m, n)
            if not fused.matmul_reduce_scatter(state, a2, b, out2, "sum", tiles):
                _failures.append(f"{label}: matmul_reduce_scatter did not run")
                continue
            _relative(f"{label} matmul_reduce_scatter", out2, want, tolerance)


def _in_turn(side, first, then):
    """``first()`` on the stream ``side`` after about 10 ms of GPU sleep there, then ``then()`` on
    the caller's stream at once, no synchronisation between them; waits for ``first``'s Work (if
    it returns one) and the device; returns what ``then`` returned."""
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        work = first()
    result = then()
    if work is not None:
        work.wait()
    torch.cuda.synchronize()
    return result


def fused_after_async(tg, rank, world, device, gen):
    """An overlapped op issued while an async collective of its group is still running (no
    wait() between them) runs after it, as a second collective of the group would (one stream
    order per group): all_gather_matmul of the tensor an async all_reduce is summing in place
    gets the sum. The all_reduce is issued from a side stream that first sleeps, the op from the
    caller's stream (unordered, the op would read the tensor unsummed on every rank)."""
    if NVSHMEM:
        return  # (the overlapped ways need the cuda transport: fused_ops)
    m, k, n = 256, 384, 512
    for label, env in (("fused", {"overlap": "fused"}), ("pipelined", {"overlap": "pipelined"})):
        og = _tdist_group(env)
        b = torch.randn(k, n, device=device, generator=gen).to(torch.bfloat16)
        side = torch.cuda.Stream(device)
        for call in range(2):  # (the second: the all_reduce, and the pipelined way, replayed from C++)
            x = torch.randn(m * k, device=device, generator=gen).to(torch.bfloat16)
            summed = x.clone()
            dist.all_reduce(summed)  # (NCCL)
            a_full = torch.empty(world * m, k, device=device)
            all_gather_single(a_full, summed.view(m, k).float())
            dist.barrier()
            torch.cuda.synchronize()
            out = _in_turn(side, lambda: dist.all_reduce(x, group=og, async_op=True),
                           lambda: torch_tdist.ops.all_gather_matmul(x.view(m, k), b, group=og))
            _check(f"{label} async all_reduce, call {call}", x, summed)
            _relative(f"{label} all_gather_matmul of the all_reduce's tensor, call {call}", out, a_full @ b.float())
        if overlap.state(og).fused_calls["all_gather_matmul"] != 2:
            _failures.append(f"{label}: the op did not take the overlapped way")


def fallback_in_order(tg, rank, world, device, gen):
    """Calls the group hands to NCCL (a 4 MB broadcast, over broadcast's GPU size limit) keep the
    group's order with its own calls, whatever stream each comes from (no wait() or
    synchronisation between them; the first call from a side stream that sleeps first):
    an async tdist all_reduce, then the broadcast of the same tensor: every rank gets the sum
    (unordered: world x rank 0's input); the broadcast async, then a tdist all_reduce of the
    tensor: world x rank 0's input (unordered: the sum); the same with the broadcast synchronous on
    the side stream. Whole numbers, so that every order of summing gives the same floats."""
    n = 1 << 20  # float32: 4 MB
    fg = _tdist_group({"algorithm": "auto", "gpu_size_limits": "1"})  # (whatever the run's)
    side = torch.cuda.Stream(device)
    dist.broadcast(torch.zeros(n, device=device), 0, group=fg)  # (NCCL's communicator starts here)
    torch.cuda.synchronize()
    handed = torch_tdist.stats(fg)["broadcast"]["fallback"]
    served = torch_tdist.stats(fg)["all_reduce"]["tdist"]
    for call in range(2):
        x = torch.randint(-1000, 1000, (n,), device=device, generator=gen).float()
        first = x.clone()
        dist.broadcast(first, 0)  # (NCCL)
        total = x.clone()
        dist.all_reduce(total)
        dist.barrier()
        torch.cuda.synchronize()
        y = x.clone()
        _in_turn(side, lambda: dist.all_reduce(y, group=fg, async_op=True), lambda: dist.broadcast(y, 0, group=fg))
        _check(f"async all_reduce, then a broadcast NCCL serves, call {call}", y, total)
        for first_async in (True, False):
            z = x.clone()
            _in_turn(side, lambda: dist.broadcast(z, 0, group=fg, async_op=first_async),
                     lambda: dist.all_reduce(z, group=fg))
            how = "async" if first_async else "synchronous (on a side stream)"
            _check(f"{how} broadcast NCCL serves, then an all_reduce, call {call}", z, first * world)
    handed = torch_tdist.stats(fg)["broadcast"]["fallback"] - handed
    served = torch_tdist.stats(fg)["all_reduce"]["tdist"] - served
    if (handed, served) != (6, 6):
        _failures.append(f"fallback_in_order: {handed} broadcasts handed to NCCL and {served} all_reduces "
                         "served by tdist, expected 6 and 6")


def pipelined_graphs(tg, rank, world, device, gen):
    """Pipelined ops replayed as CUDA graphs (overlap.replay.ProgramReplay.run_program): the same tensors, refilled
    with fresh random data and the outputs poisoned before every call, so that calls from the
    third on replay a graph; each call's outputs against NCCL + torch.matmul in float32."""
    if NVSHMEM:
        return
    state = overlap.state(_tdist_group({"overlap": "pipelined"}))
    m, n, k, calls = 256, 512, 384, 5

    def empty(*shape):
        return torch.empty(*shape, device=device, dtype=torch.bfloat16)
    a, b, out, a_out = empty(m, k), empty(k, n), empty(world * m, n), empty(world * m, k)
    rs_a, rs_out = empty(world * m, k), empty(m, n)
    for call in range(calls):
        for t in (a, b, rs_a):
            t.copy_(torch.randn(t.shape, device=device, generator=gen))
        for t in (out, a_out, rs_out):
            t.fill_(float("nan"))
        if not (pipelined.all_gather_matmul(state, a, [b], [out], a_out, 2)
                and pipelined.matmul_reduce_scatter(state, rs_a, b, rs_out, "sum", 2)):
            _failures.append("pipelined_graphs: the heap did not take the pipelined ops")
            return
        a_full = torch.empty(world * m, k, device=device)
        all_gather_single(a_full, a.float())
        _relative(f"graphs all_gather_matmul call {call}", out, a_full @ b.float())
        _relative(f"graphs all_gather_matmul gathered A call {call}", a_out, a_full, tolerance=0)
        want = torch.empty(m, n, device=device)
        reduce_scatter_single(want, rs_a.float() @ b.float())
        _relative(f"graphs matmul_reduce_scatter call {call}", rs_out, want)
    global _checked
    _checked += 1
    if state.replays.graph_calls != 2 * (calls - 2):
        _failures.append(f"pipelined_graphs: {state.replays.graph_calls} calls replayed as graphs, expected {2 * (calls - 2)}")


def _operand_count(args) -> int:
    """How many Bs a call of pipelined.all_gather_matmul(state, a, bs, ...) multiplies by."""
    return len(args[2])


def fused_issued_from_cpp(tg, rank, world, device, gen):
    """Calls of torch_tdist.ops issued from C++ (csrc/fused_calls.cpp) after their signature's
    first call ran in Python: on the same inputs, every later call is bit for bit the first
    one's result (the sequential way, and the pipelined way's program, step by step and from
    its CUDA graph); a new stride or dtype takes the Python path, still right. Also with several
    Bs as nn.Linear weights come (transposes of row-major matrices): wide ones, which the
    pipelined way multiplies one by one, and narrow ones, which it puts side by side
    (custom_ops.PER_B_MIN_COLUMNS), their first results against torch.matmul; and wide Bs that
    share memory, which go side by side."""
    from torch_tdist.overlap.custom_ops import PER_B_MIN_COLUMNS

    ways = {"sequential": {"overlap": "sequential"}}
    if not NVSHMEM:
        ways["pipelined"] = {"overlap": "pipelined"}
    m, n, k, calls = 512, 768, 1024, 6
    a = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn(k, n, device=device, generator=gen).to(torch.bfloat16)
    rs_a = torch.randn(world * m, k, device=device, generator=gen).to(torch.bfloat16)
    weights = {label: [torch.randn(w, k, device=device, generator=gen).to(torch.bfloat16).t() for w in widths]
               for label, widths in (("wide", (PER_B_MIN_COLUMNS, PER_B_MIN_COLUMNS + 128)), ("narrow", (256, 128)))}
    a_full = torch.empty(world * m, k, device=device)
    all_gather_single(a_full, a.float())

    def same(x, y):
        if isinstance(x, list):
            return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        return torch.equal(x, y) and x.stride() == y.stride()
    global _checked
    for label, env in ways.items():
        og = _tdist_group(env)
        state = overlap.state(og)
        ops = {"all_gather_matmul": lambda: torch_tdist.ops.all_gather_matmul(a, b, group=og),
               "matmul_reduce_scatter": lambda: torch_tdist.ops.matmul_reduce_scatter(rs_a, b, group=og),
               **{f"all_gather_matmul, {kind} Bs": lambda bs=bs: torch_tdist.ops.all_gather_matmul(a, bs, group=og)
                  for kind, bs in weights.items()}}
        for op, call in ops.items():
            i = 1 if op == "matmul_reduce_scatter" else 0
            overlapped = state.fused_calls["all_gather_matmul"]
            with _launches_of(pipelined, "all_gather_matmul", _operand_count) as operands:
                first = call()  # through Python
            if op in (f"all_gather_matmul, {kind} Bs" for kind in weights):
                _checked += 1
                if state.fused_calls["all_gather_matmul"] - overlapped != (label == "pipelined"):
                    _failures.append(f"{label} {op}: the first call was not served as its way says")
                kind = op.split()[1]
                for j, (got, w) in enumerate(zip(first, weights[kind])):
                    _relative(f"{label} {op}, output {j}", got, a_full @ w.float())
                _checked += 1
                want = [] if label == "sequential" else [len(weights[kind]) if kind == "wide" else 1]
                if operands != want:
                    _failures.append(f"{label} {op}: the pipelined way multiplied by {operands} Bs a call, "
                                     f"expected {want} (one by one where wide, side by side where narrow)")
            issued = (state.issued.sequential[i], state.issued.program[i], state.issued.graph[i])
            for j in range(1, calls):
                again = call()  # (each call's output freed before the next: its graph finds it again)
                _checked += 1
                if not same(again, first):
                    _failures.append(f"{label} {op} call {j}: issued from C++, differs from the Python path's")
                del again
            now = (state.issued.sequential[i], state.issued.program[i], state.issued.graph[i])
            from_cpp = [x - y for x, y in zip(now, issued)]
            want = [calls - 1, 0, 0] if label == "sequential" else None
            if (want is not None and from_cpp != want) or (want is None and (from_cpp[0] or sum(from_cpp) != calls - 1
                                                                            or from_cpp[2] == 0)):
                _failures.append(f"{label} {op}: calls issued from C++ (sequential, program, graph) {from_cpp}")
        # wide Bs that share memory (the same B twice; column slices of one matrix) go side by side
        # (one by one, a recorded program would bind an address in both to the first, which a
        # later call's Bs need not share), and are right on every call
        packed = torch.randn(k, 2 * PER_B_MIN_COLUMNS, device=device, generator=gen).to(torch.bfloat16)
        for kind, bs in (("the same B twice", [weights["wide"][0]] * 2),
                         ("column slices of one matrix", list(packed.split(PER_B_MIN_COLUMNS, dim=1)))):
            for j in range(3):
                with _launches_of(pipelined, "all_gather_matmul", _operand_count) as operands:
                    outs = torch_tdist.ops.all_gather_matmul(a, bs, group=og)
                for got, w in zip(outs, bs):
                    _relative(f"{label} all_gather_matmul, {kind}, call {j}", got, a_full @ w.float())
                _checked += 1
                if j == 0 and operands != ([] if label == "sequential" else [1]):
                    _failures.append(f"{label} all_gather_matmul, {kind}: the pipelined way multiplied by "
                                     f"{operands} Bs a call, expected them side by side")
        # a stride it was not recorded for: the Python path, still right
        before = (list(state.issued.sequential), list(state.issued.program), list(state.issued.graph))
        b_cols = b.t().contiguous().t()
        out = torch_tdist.ops.all_gather_matmul(a, b_cols, group=og)
        _relative(f"{label} all_gather_matmul, B column-major", out, a_full @ b.float())
        if (list(state.issued.sequential), list(state.issued.program), list(state.issued.graph)) != before:
            _failures.append(f"{label}: a call with B column-major was issued from C++")


def sync_calls_keep_no_tensors(tg, rank, world, device, gen):
    """A synchronous call's tensors go back to the caching allocator as soon as the caller drops
    them: its Work keeps none (csrc/work.cpp). Kept until the watchdog's next poll, a loop that
    allocates its outputs would get new memory from the driver on most calls."""
    og = _tdist_group({"overlap": "sequential"})
    a = torch.randn(256, 1024, device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn(1024, 512, device=device, generator=gen).to(torch.bfloat16)
    calls = {"all_gather_into_tensor": lambda: all_gather_single(
                 torch.empty(world * a.numel(), device=device, dtype=a.dtype), a.flatten().clone(), group=tg),
             "all_gather_matmul, sequential way": lambda: torch_tdist.ops.all_gather_matmul(a, b, group=og)}
    global _checked
    for name, call in calls.items():
        for _ in range(3):  # (plans, the C++-issued signature, tuned sizes: made once)
            call()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        for _ in range(5):
            call()  # (its result and tensors dropped at once)
        _checked += 1
        if torch.cuda.memory_allocated(device) != base:
            _failures.append(f"{name}: {torch.cuda.memory_allocated(device) - base} bytes still allocated "
                             f"after synchronous calls whose tensors the caller dropped")


def pipelined_tf32_switch(tg, rank, world, device, gen):
    """float32 pipelined ops follow a change of torch's TF32 setting between calls: calls with
    TF32 on (the later ones replay a CUDA graph, whose matmuls keep the setting of their
    capture), then with it off, whose results must be as exact as an fp32 matmul's (TF32's are
    not: the check fails if they are not, since it could not tell the two apart)."""
    if NVSHMEM:
        return
    state = overlap.state(_tdist_group({"overlap": "pipelined"}))
    m, n, k = 256, 512, 384
    a = torch.empty(m, k, device=device)
    b = torch.empty(k, n, device=device)
    out, a_out = torch.empty(world * m, n, device=device), torch.empty(world * m, k, device=device)
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        for precision, calls in (("tf32", 4), ("ieee", 2)):
            torch.backends.cuda.matmul.fp32_precision = precision
            for call in range(calls):
                a.copy_(torch.randn(a.shape, device=device, generator=gen))
                b.copy_(torch.randn(b.shape, device=device, generator=gen))
                out.fill_(float("nan"))
                if not pipelined.all_gather_matmul(state, a, [b], [out], a_out, 2):
                    _failures.append("pipelined_tf32_switch: the heap did not take the pipelined op")
                    return
                a_full = torch.empty(world * m, k, device=device, dtype=torch.float64)
                all_gather_single(a_full, a.double())
                want = a_full @ b.double()
                err = ((out.double() - want).norm() / want.norm()).item()
                exact = err < 1e-5
                global _checked
                _checked += 1
                if exact != (precision == "ieee"):
                    _failures.append(f"pipelined_tf32_switch: call {call} with fp32_precision={precision}: "
                                     f"relative error {err:.3g}")
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    if state.replays.graph_calls < 2:
        _failures.append(f"pipelined_tf32_switch: {state.replays.graph_calls} calls replayed as graphs, expected 2 or more")


def pipelined_back_to_back(tg, rank, world, device, gen):
    """Pipelined ops and bulk collectives of one group queued back to back with no host
    synchronisation, each rank held up by a different GPU sleep before different calls (a rank
    ahead of its peers must not touch what they still read; matmul_reduce_scatter's start
    barrier waits on a side stream while the main stream computes). Three
    bursts on the same tensors, refilled with fresh random data (the later ones replay CUDA
    graphs); every output against NCCL + torch.matmul."""
    if NVSHMEM:
        return
    group = _tdist_group({"overlap": "pipelined", "algorithm": "bulk"})
    state = overlap.state(group)
    m, n, k, rounds = 256, 512, 384, 3

    def rand(*shape):
        return torch.empty(*shape, device=device, dtype=torch.bfloat16)
    b = rand(k, n)
    calls = []
    for _ in range(rounds):
        calls.append(("ag", rand(m, k), rand(world * m, n), rand(world * m, k)))
        calls.append(("rs", rand(world * m, k), rand(m, n)))
        calls.append(("ar", rand(3 << 18), rand(3 << 18)))
    for burst in range(3):
        for t in [b] + [x for call in calls for x in call[1:2]]:
            t.copy_(torch.randn(t.shape, device=device, generator=gen))
        for call in calls:
            for t in call[2:]:
                t.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier()
        for i, (kind, x, *outs) in enumerate(calls):
            if (i + rank) % world == 0:
                torch.cuda._sleep(100_000 * (1 + rank))  # tens of microseconds
            if kind == "ag":
                ok = pipelined.all_gather_matmul(state, x, [b], [outs[0]], outs[1], 2)
            elif kind == "rs":
                ok = pipelined.matmul_reduce_scatter(state, x, b, outs[0], "sum", 2)
            else:
                outs[0].copy_(x)
                dist.all_reduce(outs[0], group=group)
                ok = True
            if not ok:
                _failures.append("pipelined_back_to_back: the heap did not take the pipelined ops")
                return
        for i, (kind, x, *outs) in enumerate(calls):
            label = f"back to back burst {burst} call {i} {kind}"
            if kind == "ag":
                a_full = torch.empty(world * m, k, device=device)
                all_gather_single(a_full, x.float())
                _relative(label, outs[0], a_full @ b.float())
                _relative(f"{label} gathered A", outs[1], a_full, tolerance=0)
            elif kind == "rs":
                want = torch.empty(m, n, device=device)
                reduce_scatter_single(want, x.float() @ b.float())
                _relative(label, outs[0], want)
            else:
                want = x.float()
                dist.all_reduce(want)
                _relative(label, outs[0], want)
    if state.replays.graph_calls == 0:
        _failures.append("pipelined_back_to_back: no call was replayed as a CUDA graph")


def pipelined_in_user_graph(tg, rank, world, device, gen):
    """torch_tdist.ops inside the user's own CUDA graph (how inference engines and
    torch.compile's reduce-overhead mode run them), pipelined, fused and tuned (the way tuning
    picked on the warm-up calls): all_gather_matmul, then matmul_reduce_scatter of its output,
    then a bulk all_reduce, captured once after eager warm-up calls on a side stream, replayed
    with the static inputs refilled with fresh random data and the outputs poisoned; each
    replay's outputs against NCCL + torch.matmul."""
    if NVSHMEM:
        return
    for policy in ("pipelined", "fused", "tune"):
        _ops_in_user_graph(policy, _tdist_group({"overlap": policy, "algorithm": "bulk"}),
                           world, device, gen)


def _ops_in_user_graph(policy, group, world, device, gen):
    state = overlap.state(group)
    m, n, k, replays = 256, 512, 384, 4

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=torch.bfloat16)
    a, b_up, b_down, x = rand(m, k), rand(k, n), rand(n, k), rand(3 << 18)

    def step():
        up = torch_tdist.ops.all_gather_matmul(a, b_up, group=group)
        down = torch_tdist.ops.matmul_reduce_scatter(up, b_down, group=group)
        summed = x.clone()
        dist.all_reduce(summed, group=group)
        return up, down, summed
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(warm)
    own_graph_calls = state.replays.graph_calls
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for replay in range(replays):
        for t in (a, b_up, b_down, x):
            t.copy_(torch.randn(t.shape, device=device, generator=gen))
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        label = f"user graph {policy} replay {replay}"
        a_full = torch.empty(world * m, k, device=device)
        all_gather_single(a_full, a.float())
        _relative(f"{label} all_gather_matmul", outs[0], a_full @ b_up.float())
        down = torch.empty(m, k, device=device)
        reduce_scatter_single(down, outs[0].float() @ b_down.float())
        _relative(f"{label} matmul_reduce_scatter", outs[1], down)
        summed = x.float()
        dist.all_reduce(summed)
        _relative(f"{label} all_reduce", outs[2], summed)
    if state.replays.graph_calls != own_graph_calls:
        _failures.append(f"{policy} in a user graph: a call inside the capture replayed the executor's own graph")


def _tdist_group(options: dict):
    """A new tdist group created with the backend ``options`` (its config)."""
    return dist.new_group(backend="tdist", pg_options=options)


def _ops_against_nccl(tg, label, rank, world, device, gen):
    for m, n, k in ((256, 512, 384), (24, 40, 56)):
        a = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
        b = torch.randn(k, n, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
        out = torch_tdist.ops.all_gather_matmul(a, b, group=tg)
        w = torch.randn(out.shape, device=device, generator=gen)
        (out.float() * w).sum().backward()
        a_full = torch.empty(world * m, k, device=device)
        all_gather_single(a_full, a.detach().float())
        _relative(f"{label} all_gather_matmul {m}x{n}x{k}", out, a_full @ b.detach().float())
        grad_full = w @ b.detach().float().t()
        dist.all_reduce(grad_full)
        _relative(f"{label} all_gather_matmul grad A {m}x{n}x{k}", a.grad, grad_full.chunk(world)[rank])
        _relative(f"{label} all_gather_matmul grad B {m}x{n}x{k}", b.grad, a_full.t() @ w)

        a2 = torch.randn(world * m, k, device=device, generator=gen).to(torch.bfloat16)
        out2 = torch_tdist.ops.matmul_reduce_scatter(a2, b.detach(), group=tg)
        want = torch.empty(m, n, device=device)
        reduce_scatter_single(want, a2.float() @ b.detach().float())
        _relative(f"{label} matmul_reduce_scatter {m}x{n}x{k}", out2, want)


def _relative(name, got, want, tolerance=1e-2):
    global _checked
    _checked += 1
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    if not err <= tolerance:
        _failures.append(f"{name}: relative error {err:.3g}")


def shmem_calls(tg, rank, world, device, gen):
    """Every torch_tdist.shmem_device function in one kernel (tests/jobs_shmem.py), on GPUs."""
    if not NVSHMEM:
        return
    from tests.jobs_shmem import _ring_puts

    heap = torch_tdist.get_heap(tg)
    n = 4099
    mine, inbox, inbox_nbi = heap.empty(n, torch.float32), heap.empty(2 * n, torch.float32), heap.empty(2 * n, torch.float32)
    sigs = heap.empty(5, torch.int64)
    sigs.zero_()
    left = (rank - 1) % world
    for epoch in range(1, REPEATS + 1):
        x = torch.randn(n, device=device, generator=gen)
        everyone = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(everyone, x)
        mine.copy_(x)
        torch.cuda.synchronize()
        dist.barrier(tg)
        _ring_puts[(1,)](heap.ctx, mine, inbox, inbox_nbi, sigs, n, epoch, num_warps=8)
        torch.cuda.synchronize()
        for name, got in (("putmem_block", inbox[:n]), ("putmem_signal_block", inbox[n:]),
                          ("putmem_nbi_block", inbox_nbi[:n]), ("putmem_signal_nbi_block", inbox_nbi[n:])):
            _check(f"shmem {name} #{epoch}", got, everyone[left])
        want = torch.tensor([epoch, 3 * epoch, epoch, 5 * epoch, epoch], device=device)
        _check(f"shmem signals #{epoch}", sigs, want)
        dist.barrier(tg)


def hierarchical(tg, rank, world, device, gen):
    """The all-gather over 'nodes': world 4 as 2 x 2, as 4 x 1 and as 1 x 4."""
    if not NVSHMEM:
        return
    for ranks_per_node in sorted({r for r in (1, 2, world) if world % r == 0}):
        for trial, n in enumerate((1001, 1 << 20)):
            x = torch.randn(n, device=device, generator=gen).to(torch.bfloat16)
            want = torch.empty(world * n, dtype=x.dtype, device=device)
            all_gather_single(want, x)
            got = torch.full_like(want, float("nan"))
            torch_tdist.hierarchical_all_gather(got, x, ranks_per_node, group=tg)
            _check(f"hierarchical all_gather {world // ranks_per_node}x{ranks_per_node} n={n}", got, want)


def moe_example(tg, rank, world, device, gen):
    """The MoE dispatch example (torch_tdist/examples/moe_all_to_all.py) against NCCL."""
    if not NVSHMEM:
        return
    from torch_tdist.examples import moe_all_to_all as moe

    tokens, topk, hidden, per_rank = 128, 8, 7168, 8  # the benchmark's MoE-dispatch shape
    dispatch = moe.MoeDispatch(tg, tokens * topk, hidden, per_rank, torch.bfloat16, pieces=8)
    for step in range(REPEATS):
        rows, counts = moe.route(tokens, topk, world * per_rank, hidden, torch.bfloat16, device,
                                 100 * step + rank)
        recv, recv_counts = dispatch(rows, counts)
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts)
        rows_in = counts_in.view(world, -1).sum(1)
        want = torch.empty(int(rows_in.sum()), hidden, dtype=torch.bfloat16, device=device)
        dist.all_to_all_single(want, rows, rows_in.tolist(), counts.view(world, -1).sum(1).tolist())
        _check(f"moe dispatch counts #{step}", recv_counts.reshape(-1), counts_in)
        _check(f"moe dispatch rows #{step}", torch.cat([recv[s, :int(rows_in[s])] for s in range(world)]), want)


def symm_mem_coexists(tg, rank, world, device, gen):
    """torch's NVSHMEM symmetric memory works in the same process as tdist's NVSHMEM heap."""
    if not NVSHMEM:
        return
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.set_backend("NVSHMEM")
    buf = symm_mem.empty(4096, device=device)
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    x = torch.randn(4096, device=device, generator=gen)
    buf.copy_(x)
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)  # (NCCL; it also orders every rank's copy before the reads)
    torch.cuda.synchronize()
    right = (rank + 1) % world
    peer = handle.get_buffer(right, (4096,), torch.float32)
    _check("torch symm_mem (NVSHMEM) read of the right peer", peer.clone(), everyone[right])
    torch.cuda.synchronize()
    dist.barrier()


NVSHMEM = os.environ.get("TDIST_TRANSPORT") == "nvshmem"
_ran = set()  # the checks that ran to their end
CHECKS = [every_op, uneven_all_to_all, uneven_all_to_all_in_turns, subgroups, dtensor, async_overlap, stream_changes, captured_stream_changes,
          graph_replay, bulk_path,
          streamed_path, twoshot_path, multi_round_plans, lowlatency_path, served_by_tdist, fused_ops, fused_tile_configs, fused_after_async, fallback_in_order, pipelined_graphs, pipelined_back_to_back,
          pipelined_in_user_graph, pipelined_tf32_switch, fused_issued_from_cpp, sync_calls_keep_no_tensors,
          shmem_calls, hierarchical, moe_example, symm_mem_coexists]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument("--quick", action="store_true", help="float32 and bfloat16 only")
    parser.add_argument("--symm-mem-first", action="store_true",
                        help="torch's NVSHMEM symmetric memory starts before tdist's heap")
    args = parser.parse_args()
    if args.quick:
        global DTYPES
        DTYPES = ALL_REDUCE_OPS_FOR
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    tg = dist.new_group(backend="tdist")
    gen = torch.Generator(device).manual_seed(1234 + rank)
    wanted = set(filter(None, args.only.split(",")))
    checks = CHECKS
    if args.symm_mem_first:
        checks = [symm_mem_coexists] + [c for c in CHECKS if c is not symm_mem_coexists]
    for check in checks:
        if wanted and check.__name__ not in wanted:
            continue
        before, start = len(_failures), time.perf_counter()
        # A check that hangs (a kernel waiting for a flag that never comes) prints every thread's
        # stack and ends the run, rather than using up the whole run's time limit.
        faulthandler.dump_traceback_later(CHECK_TIMEOUT_S, exit=True)
        check(tg, rank, world, device, gen)
        _ran.add(check.__name__)
        torch.cuda.synchronize()
        faulthandler.cancel_dump_traceback_later()
        status = "ok" if len(_failures) == before else f"FAILED ({len(_failures) - before})"
        print(f"rank {rank}: {check.__name__:<20} {status}  {time.perf_counter() - start:6.1f} s", flush=True)
    report_and_exit(rank, _checked, _failures)


if __name__ == "__main__":
    main()
