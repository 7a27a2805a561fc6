"""Collectives over a staging buffer in the symmetric heap: publish, then pull.

Every collective is two launches on every rank:

1. ``publish_kernel``: wait until every peer finished reading this rank's staging buffer in
   the previous collective (``done[p] >= epoch - 1``), copy the local input and a small int64
   header into the staging area, then tell every peer it is ready (``ready[me] = epoch``).
2. ``pull_copy_kernel`` / ``pull_reduce_kernel``: wait for the peers whose data is needed,
   check that each one's header describes the same call as ours (op, dtype, element count),
   read their staging buffers through pointer translation and write (or reduce into) the
   local output, then tell every peer this rank is done reading (``done[me] = epoch``).
   A header that does not match is never read past: the status slot records it for the host,
   which raises, and the signals still flow so the group stays usable.

Header layout (int64): ``op | dtype | count``, then any words the caller publishes with it;
``count`` is the whole call's element count (a large call is staged in several rounds).

Signals hold the group's epoch, which only grows (compared with ``>=``), so nothing is ever
reset between collectives. The epoch lives in device memory: every launch reads
``epoch = slot + 1`` and the last program of the pull launch stores it, so a captured CUDA
graph counts on by itself when replayed (no epoch is baked into the graph). The last program
of a launch to arrive at the ``arrive`` counter sends the signals, so the launch may have any
number of programs, and no program waits on a later program of its own launch (which the
interpreter, running programs one by one, could never satisfy).

Signal block layout (int64, one block per group, same offset on every rank):
``ready[WORLD] | done[WORLD] | arrive[2] | status[1] | epoch[1]``.
"""

import triton.language as tl

from torch_tdist import language as tdl

# The status slot holds (peer + 1) * 4 + kind for the highest peer that disagreed.
STATUS_OK = tl.constexpr(0)
STATUS_SIZE_MISMATCH = tl.constexpr(1)  # all-to-all: the peer sends a different count
STATUS_CALL_MISMATCH = tl.constexpr(2)  # the peer made a different call (op, dtype or size)
HEADER_FIXED = tl.constexpr(3)
NO_COUNT = tl.constexpr(-1)


def signal_slots(world: int) -> int:
    return 2 * world + 4


@tdl.jit
def _epoch(sig, WORLD: tl.constexpr):
    """This collective's epoch: one more than the last finished one on this rank."""
    return tl.load(sig + 2 * WORLD + 3) + 1


@tdl.jit
def _arrive_last(sig, ARRIVE: tl.constexpr):
    """True in exactly one program of the launch: the last one to get here (a launch of one
    program skips the count, an atomic round trip)."""
    nprog = tl.num_programs(0) * tl.num_programs(1)
    tl.debug_barrier()  # every thread's stores happen before the (one-thread) release
    last = nprog == 1
    if nprog > 1:
        arrived = tl.atomic_add(sig + ARRIVE, 1, sem="acq_rel", scope="gpu")
        last = arrived == nprog - 1
        if last:
            tl.atomic_xchg(sig + ARRIVE, 0, sem="relaxed", scope="gpu")
    return last


@tdl.jit
def publish_kernel(ctx, src, stage, n, hdr_src, hdr, n_hdr, sig, op_code, dtype_code, count,
                   WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = tdl.rank(ctx)
    epoch = _epoch(sig, WORLD)
    for p in tl.static_range(WORLD):
        tdl.wait(ctx, sig + WORLD + p, epoch - 1)
    if pid == 0:
        tl.store(hdr, tl.cast(op_code, tl.int64))
        tl.store(hdr + 1, tl.cast(dtype_code, tl.int64))
        tl.store(hdr + 2, tl.cast(count, tl.int64))
        for start in range(0, n_hdr, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n_hdr
            tl.store(hdr + HEADER_FIXED + offs, tl.load(hdr_src + offs, mask=mask), mask=mask)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(stage + offs, tl.load(src + offs, mask=mask), mask=mask)
    if _arrive_last(sig, 2 * WORLD):
        for p in tl.static_range(WORLD):
            tdl.notify(ctx, sig + me, p, epoch)


@tdl.jit
def _finish_pull(ctx, sig, epoch, WORLD: tl.constexpr):
    if _arrive_last(sig, 2 * WORLD + 1):
        me = tdl.rank(ctx)
        for p in tl.static_range(WORLD):
            tdl.notify(ctx, sig + WORLD + me, p, epoch)
        tl.store(sig + 2 * WORLD + 3, epoch)  # every program of this launch has read it


@tdl.jit
def _call_matches(ctx, hdr, sig, peer, op_code, dtype_code, count, WORLD: tl.constexpr):
    """Whether ``peer``'s header describes our call; records the peer in the status slot if not."""
    same = (tdl.load(ctx, hdr, peer) == op_code) & (tdl.load(ctx, hdr + 1, peer) == dtype_code)
    same = same & ((count == NO_COUNT) | (tdl.load(ctx, hdr + 2, peer) == count))
    if not same:
        _report(sig, peer, STATUS_CALL_MISMATCH, WORLD)
    return same


@tdl.jit
def _report(sig, peer, kind, WORLD: tl.constexpr):
    tl.atomic_max(sig + 2 * WORLD + 2, tl.cast((peer + 1) * 4 + kind, tl.int64), sem="relaxed", scope="gpu")


@tdl.jit
def pull_copy_kernel(ctx, stage, hdr, out, segs, sig, op_code, dtype_code, count,
                     WORLD: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """Program (b, s) copies its share of segment s: ``out[dst:dst+len] = stage@peer[src:src+len]``.

    ``segs`` is int64 ``[n_segs, 4]``: (peer, src offset, dst offset, length) in elements;
    every offset and length is a multiple of ALIGN (which lets the compiler use wide accesses).
    ``count``: the element count every peer must have published (NO_COUNT: not compared).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = _epoch(sig, WORLD)
    seg = segs + tl.program_id(1) * 4
    peer = tl.load(seg)
    src_off = tl.multiple_of(tl.load(seg + 1), ALIGN)
    dst_off = tl.multiple_of(tl.load(seg + 2), ALIGN)
    length = tl.multiple_of(tl.load(seg + 3), ALIGN)
    tdl.wait(ctx, sig + peer, epoch)
    same = _call_matches(ctx, hdr, sig, peer, op_code, dtype_code, count, WORLD)
    limit = tl.where(same, length, 0)  # (the mask keeps `length`, whose alignment is known)
    remote = tdl.symm_at(ctx, stage, peer) + src_off
    local = out + dst_off
    for start in range(pid * BLOCK, limit, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < length
        tl.store(local + offs, tl.load(remote + offs, mask=mask), mask=mask)
    _finish_pull(ctx, sig, epoch, WORLD)


@tdl.jit
def _combine(acc, x, OP: tl.constexpr):
    if OP == "max":
        return tl.maximum(acc, x)
    elif OP == "min":
        return tl.minimum(acc, x)
    elif OP == "product":
        return acc * x
    else:
        return acc + x


@tdl.jit
def pull_reduce_kernel(ctx, stage, hdr, out, src_off, n, sig, op_code, dtype_code, count,
                       WORLD: tl.constexpr, BLOCK: tl.constexpr, OP: tl.constexpr,
                       ACC: tl.constexpr):
    """``out[i] = OP over peers p (in rank order) of stage@p[src_off + i]``, for i < n.

    Every rank combines in the same order, so all ranks get bit-identical results.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = _epoch(sig, WORLD)
    limit = n
    for p in tl.static_range(WORLD):
        tdl.wait(ctx, sig + p, epoch)
        same = _call_matches(ctx, hdr, sig, p, op_code, dtype_code, count, WORLD)
        limit = tl.where(same, limit, 0)
    for start in range(pid * BLOCK, limit, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(tdl.symm_at(ctx, stage, 0) + src_off + offs, mask=mask).to(ACC)
        for p in tl.static_range(1, WORLD):
            x = tl.load(tdl.symm_at(ctx, stage, p) + src_off + offs, mask=mask).to(ACC)
            acc = _combine(acc, x, OP)
        if OP == "avg":
            acc = acc / WORLD
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)
    _finish_pull(ctx, sig, epoch, WORLD)
