"""Jobs for test_groups.py: subgroups made with dist.new_group (4 ranks).

new_group must be called by every rank of the default group, in the same order.
Each job destroys the groups it made, then checks the default group still works,
and returns the torch_tdist.stats() diff of the subgroup(s) it used (None when
the backend is not tdist).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import torch_tdist
from torch_tdist.backend import is_tdist_group
from torch_tdist.compat import all_gather_single, reduce_scatter_single

from tests.common import (Checker, poison, rand, rank_gen, ref_reduce, shared_gen,
                          stats_diff, stats_snapshot)

# ops run_group_suite issues (torch_tdist.stats() names)
SUITE_OPS = ["all_reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
             "broadcast", "all_to_all_single", "barrier"]
ROOTED_OPS = ["scatter", "gather", "reduce"]


def run_group_suite(chk, group, members, seed, salt, rooted=False):
    """Collectives on `group` (whose members are the global ranks `members`),
    checked against references built from every member's deterministic input."""
    rank = dist.get_rank()
    members = sorted(members)
    assert dist.get_process_group_ranks(group) == members, (dist.get_process_group_ranks(group), members)
    n = len(members)
    gr = members.index(rank)
    chk.true(dist.get_rank(group) == gr, "group rank", f"get_rank(group)={dist.get_rank(group)}, expected {gr}")
    chk.true(dist.get_world_size(group) == n, "group size", f"get_world_size(group)={dist.get_world_size(group)}")
    tag = f"group {members}"

    def inputs(shape, dtype, s, kind="move"):
        return [rand(shape, dtype, rank_gen(seed, m, salt * 100 + s), kind) for m in members]

    # all_reduce (SUM fp32, MAX bf16)
    ins = inputs((13,), "float32", 1, "sum")
    t = ins[gr].clone()
    dist.all_reduce(t, group=group)
    chk.close(t, ref_reduce(ins, "SUM"), f"{tag} all_reduce SUM float32")
    ins = inputs((2, 7), "bfloat16", 2, "minmax")
    t = ins[gr].clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    chk.close(t, ref_reduce(ins, "MAX"), f"{tag} all_reduce MAX bfloat16", "MAX")

    # all_gather_into_tensor / all_gather
    ins = inputs((3, 2), "int64", 3)
    out = poison((3 * n, 2), torch.int64)
    all_gather_single(out, ins[gr], group=group)
    chk.equal(out, torch.cat(ins), f"{tag} all_gather_into_tensor int64")
    ins = inputs((5,), "float16", 4)
    outs = [poison((5,), torch.float16, seed=500 + j) for j in range(n)]
    dist.all_gather(outs, ins[gr], group=group)
    for j in range(n):
        chk.equal(outs[j], ins[j], f"{tag} all_gather float16 output[{j}]")

    # reduce_scatter_tensor
    ins = inputs((4 * n, 3), "float32", 5, "sum")
    out = poison((4, 3), torch.float32)
    reduce_scatter_single(out, ins[gr], group=group)
    chk.close(out, ref_reduce([x[4 * gr:4 * gr + 4] for x in ins], "SUM"), f"{tag} reduce_scatter_tensor")

    # broadcast from the last member (src is a global rank)
    src = members[-1]
    data = rand((9,), "float32", rank_gen(seed, src, salt * 100 + 6))
    t = data.clone() if rank == src else poison((9,), torch.float32)
    dist.broadcast(t, src=src, group=group)
    chk.equal(t, data, f"{tag} broadcast src={src}")

    # all_to_all_single, uneven
    g = shared_gen(seed, salt * 100 + 7)
    S = torch.randint(0, 4, (n, n), generator=g)
    S[0, n - 1] = 0
    ins = [rand((int(S[j].sum()), 2), "float32", rank_gen(seed, m, salt * 100 + 7)) for j, m in enumerate(members)]
    parts = []
    for j in range(n):
        off = int(S[j][:gr].sum())
        parts.append(ins[j][off:off + int(S[j][gr])])
    expected = torch.cat(parts)
    out = poison(expected.shape, torch.float32)
    dist.all_to_all_single(out, ins[gr], S[:, gr].tolist(), S[gr].tolist(), group=group)
    chk.equal(out, expected, f"{tag} all_to_all_single splits {S.tolist()}")

    dist.barrier(group=group)

    if rooted:
        root = members[-1]
        # scatter from the last member
        chunks = [rand((6,), "float32", rank_gen(seed, root, salt * 100 + 8 + k)) for k in range(n)]
        out = poison((6,), torch.float32)
        dist.scatter(out, chunks if rank == root else None, src=root, group=group)
        chk.equal(out, chunks[gr], f"{tag} scatter src={root}")
        # gather to the second member
        dst = members[1]
        ins = inputs((4,), "int32", 20)
        outs = [poison((4,), torch.int32, seed=600 + j) for j in range(n)] if rank == dst else None
        dist.gather(ins[gr], outs, dst=dst, group=group)
        if rank == dst:
            for j in range(n):
                chk.equal(outs[j], ins[j], f"{tag} gather dst={dst} output[{j}]")
        # reduce to the last member
        ins = inputs((7,), "float32", 21, "sum")
        t = ins[gr].clone()
        dist.reduce(t, dst=root, group=group)
        if rank == root:
            chk.close(t, ref_reduce(ins, "SUM"), f"{tag} reduce dst={root}")


def check_default_group(chk, seed, salt=999):
    rank, ws = dist.get_rank(), dist.get_world_size()
    ins = [rand((11,), "float32", rank_gen(seed, r, salt), "sum") for r in range(ws)]
    t = ins[rank].clone()
    dist.all_reduce(t)
    chk.close(t, ref_reduce(ins, "SUM"), "default group all_reduce afterwards")
    out = poison((11 * ws,), torch.float32)
    all_gather_single(out, ins[rank])
    chk.equal(out, torch.cat(ins), "default group all_gather_into_tensor afterwards")
    dist.barrier()


def disjoint_pairs(rank, ws, backend, seed, rounds=3):
    """[0, 2] and [1, 3] run collectives on their own group at the same time."""
    assert ws == 4
    chk = Checker(rank, "disjoint pairs")
    g02 = dist.new_group([0, 2], backend=backend)
    g13 = dist.new_group([1, 3], backend=backend)
    mine, members = (g02, [0, 2]) if rank in (0, 2) else (g13, [1, 3])
    before = stats_snapshot(mine)
    for i in range(rounds):
        run_group_suite(chk, mine, members, seed, salt=i, rooted=(i == 0))
    diff = stats_diff(before, stats_snapshot(mine))
    dist.destroy_process_group(mine)
    check_default_group(chk, seed)
    chk.done()
    return diff


def group_of_three(rank, ws, backend, seed):
    """Ranks [0, 1, 3] (not contiguous); rank 2 is not a member and idles."""
    assert ws == 4
    chk = Checker(rank, "group of three")
    members = [0, 1, 3]
    g = dist.new_group(members, backend=backend)
    diff = None
    if rank in members:
        before = stats_snapshot(g)
        for i in range(2):
            run_group_suite(chk, g, members, seed, salt=i, rooted=True)
        diff = stats_diff(before, stats_snapshot(g))
        dist.destroy_process_group(g)
    else:
        chk.true(g == dist.GroupMember.NON_GROUP_MEMBER, "non-member",
                 f"new_group returned {g!r} to a non-member")
        chk.true(not is_tdist_group(g), "non-member", "is_tdist_group said True")
        try:
            torch_tdist.stats(g)
            chk.true(False, "non-member stats()", "no error")
        except ValueError as err:
            chk.true("not a member" in str(err), "non-member stats() error", str(err))
    check_default_group(chk, seed)
    chk.done()
    return diff


def overlapping_groups(rank, ws, backend, seed, rounds=2):
    """A=[0,1,2], B=[1,2,3], C=[0,3] and the default group, all alive at once.
    Every rank uses its groups in the same global order (A, B, C, WORLD), first
    blocking, then with async ops of several groups in flight together."""
    assert ws == 4
    chk = Checker(rank, "overlapping groups")
    specs = [("A", [0, 1, 2]), ("B", [1, 2, 3]), ("C", [0, 3])]
    groups = {name: dist.new_group(m, backend=backend) for name, m in specs}
    before = {name: stats_snapshot(groups[name]) for name, m in specs if rank in m}
    for i in range(rounds):
        for k, (name, m) in enumerate(specs):
            if rank in m:
                run_group_suite(chk, groups[name], m, seed, salt=10 * i + k)
        check_default_group(chk, seed, salt=1000 + i)

    # async: issue all_reduce on every group this rank belongs to, then wait all
    pending = []
    for name, m in specs + [("WORLD", list(range(ws)))]:
        if rank not in m:
            continue
        grp = groups.get(name)  # None = default group
        ins = [rand((17,), "float32", rank_gen(seed, r, 5000 + ord(name[0])), "sum") for r in m]
        t = ins[m.index(rank)].clone()
        pending.append((name, dist.all_reduce(t, group=grp, async_op=True), t, ref_reduce(ins, "SUM")))
    for name, work, t, expected in pending:
        work.wait()
        chk.close(t, expected, f"async all_reduce on group {name}")

    diffs = {name: stats_diff(before[name], stats_snapshot(groups[name])) for name in before}
    for name, m in specs:
        if rank in m:
            dist.destroy_process_group(groups[name])
    check_default_group(chk, seed)
    chk.done()
    return diffs


def backend_string_groups(rank, ws, backend, seed):
    """new_group(..., backend="cpu:<backend>"): a full-size subgroup and the pair
    [1, ws - 1] (ws >= 3)."""
    chk = Checker(rank, f"new_group(backend={backend!r})")
    full = dist.new_group(list(range(ws)), backend=backend)
    pair = dist.new_group([1, ws - 1], backend=backend)
    diffs = {}
    before = stats_snapshot(full)
    run_group_suite(chk, full, list(range(ws)), seed, salt=1, rooted=True)
    diffs["full"] = stats_diff(before, stats_snapshot(full))
    if rank in (1, ws - 1):
        before = stats_snapshot(pair)
        run_group_suite(chk, pair, [1, ws - 1], seed, salt=2)
        diffs["pair"] = stats_diff(before, stats_snapshot(pair))
        dist.destroy_process_group(pair)
    dist.destroy_process_group(full)
    check_default_group(chk, seed)
    chk.done()
    return diffs


def no_communication(rank, ws, backend, seed):
    """A group made with the backend option communication=False (the bound of a training step
    with free communication): its collectives return at once leaving their outputs as they were,
    and count as calls; torch_tdist.ops run sequentially on what the untouched outputs hold; bad
    input still raises; a group made without the option after it communicates as usual."""
    import torch_tdist

    chk = Checker(rank, "no communication")
    free = dist.new_group(backend="tdist", pg_options={"communication": False})
    gen = rank_gen(seed, rank)
    x = torch.randn(64, generator=gen)
    mine = x.clone()
    dist.all_reduce(x, group=free)
    chk.equal(x, mine, "all_reduce leaves the tensor as it was")
    out = torch.full((64 * ws,), 7.0)
    all_gather_single(out, mine, group=free)
    chk.equal(out, torch.full((64 * ws,), 7.0), "all_gather leaves its output as it was")
    a2a = torch.full((64,), 3.0)
    dist.all_to_all_single(a2a, mine, group=free)
    chk.equal(a2a, torch.full((64,), 3.0), "all_to_all_single leaves its output as it was")
    dist.barrier(group=free)
    chk.true(torch_tdist.stats(free)["all_reduce"]["tdist"] == 1, "counted", str(torch_tdist.stats(free)))
    a, b = torch.randn(4 * ws, 8, generator=gen), torch.randn(8, 5, generator=gen)
    got = torch_tdist.ops.matmul_reduce_scatter(a, b, group=free)  # (values: whatever the output held)
    chk.true(tuple(got.shape) == (4, 5) and got.dtype == a.dtype, "matmul_reduce_scatter", str(got.shape))
    got = torch_tdist.ops.all_gather_matmul(a, b, group=free)
    chk.true(tuple(got.shape) == (4 * ws * ws, 5), "all_gather_matmul", str(got.shape))
    try:
        all_gather_single(torch.empty(3), mine, group=free)
        chk.true(False, "bad input", "no error")
    except ValueError as err:
        chk.true("all_gather" in str(err), "bad input", str(err))
    # a scatter only the root can tell is wrong: the root raises at once, its peers return
    start = time.perf_counter()
    try:
        dist.scatter(torch.empty(4), [torch.empty(3)] * ws if rank == 0 else None, src=0, group=free)
        chk.true(rank != 0, "rejected scatter", "the root raised nothing")
    except ValueError as err:
        chk.true(rank == 0 and "scatter" in str(err), "rejected scatter", str(err))
    chk.true(time.perf_counter() - start < 5, "rejected scatter", f"took {time.perf_counter() - start:.1f} s")
    usual = dist.new_group(backend="tdist")
    y = torch.full((4,), float(rank + 1))
    dist.all_reduce(y, group=usual)
    chk.equal(y, torch.full((4,), float(sum(range(1, ws + 1)))), "a group without the option communicates")
    chk.done()
