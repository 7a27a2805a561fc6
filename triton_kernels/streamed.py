"""Large all_gather, reduce_scatter, all_reduce and even all-to-all in one launch, streamed in
steps, so that pushing to peers (NVLink), reducing and copying out (local memory) overlap.

The one-shot kernel (``oneshot.py``) pushes a whole message, waits once and then combines: one
round trip, right for small messages, but on large ones its reduction or copy starts only once
every push is done. Here every program walks its blocks (``q, q + P, ...`` of a share, ``P``
programs) in steps of STEP blocks. In iteration ``k``, program ``q`` of every rank:

1. pushes step ``k`` of every peer's share of the input into that peer's mailbox slot ``[me]``
   (all_gather: the whole input is every peer's share; all_gather and all-to-all copy this
   rank's own share into the output; all_reduce: the slot's first half);
2. waits until program ``q`` of every rank has signalled iteration ``k - 1`` (a flag per rank and
   program, all polled at once, a lane per rank), and at ``k = 1`` checks every rank's call word;
3. all_gather, all-to-all: copy step ``k - 1`` of every peer's slot into the output. reduce_scatter and
   all_reduce: reduce step ``k - 1`` of this rank's share in rank order, its own part read from
   the input; reduce_scatter writes the output; all_reduce (two-shot) writes its share of the
   output and pushes it into every peer's slot ``[me]`` (second half);
4. all_reduce: copies step ``k - 2`` of every peer's reduced share out of the second halves;
5. signals iteration ``k`` to every rank: ``flags@d[me][q] = epoch * MAX_STEPS + k + 1``
   (release), after the stores of 1 and 3, which have had the reduction's time to drain.

Flags: a ``[WORLD][MAXP]`` block of its own (values that grow by step within a call and by
epoch across calls, compared with ``>=``). Mailboxes, call words and the epoch counter are the
one-shot kernel's (same layout, same parity rule): a rank that starts call ``e + 2`` has seen
every peer's first signal of ``e + 1``, so every peer had finished ``e`` and its slots of parity
``e % 2`` are free, whichever kernel served each call. A call word that differs (status slot
of ``counter``) stops this rank's waits, reductions and copies; pushes stay within a slot.
"""

import triton.language as tl

from torch_tdist import language as tdl

from .oneshot import call_words_differ, end_call, rank_lanes, send_call_words, start_call
from .staged import _combine

MAX_STEPS = tl.constexpr(1 << 24)  # more steps than any launch takes (a flag's room per epoch)


@tdl.jit
def _blocks(count, pid, nprog, BLOCK: tl.constexpr):
    """How many of ``count`` elements' blocks are program ``pid``'s (``pid, pid + nprog, ...``)."""
    return tl.maximum((count - pid * BLOCK + nprog * BLOCK - 1) // (nprog * BLOCK), 0)


@tdl.jit
def _share(d, n, stride, part, MODE: tl.constexpr):
    """(offset in the input, elements) of rank ``d``'s share: all_gather the whole input,
    reduce_scatter and all-to-all the ``n`` elements ``stride`` apart, all_reduce ``[d * part,
    (d + 1) * part)`` (the last shares may be shorter, or empty)."""
    if MODE == "all_gather":
        return d * 0, n
    elif (MODE == "reduce_scatter") or (MODE == "all_to_all"):
        return d * stride, n
    else:
        return d * part, tl.minimum(tl.maximum(n - d * part, 0), part)


@tdl.jit
def _copy_blocks(dst, src, count, first, last, pid, nprog, BLOCK: tl.constexpr):
    """This program's blocks ``first`` to ``last - 1`` (of ``pid, pid + nprog, ...``) of ``count``
    elements, ``src`` to ``dst``."""
    for j in range(first, last):
        offs = (pid + j * nprog) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < count
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@tdl.jit
def streamed_kernel(ctx, src, dst, box, cap, flags, words, counter, n, stride, part, call_word,
                    MODE: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, STEP: tl.constexpr,
                    ALIGN: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr, MAXP: tl.constexpr,
                    LANES: tl.constexpr):
    """all_gather: ``n`` input elements, ranks' parts ``stride`` apart in ``dst``. reduce_scatter:
    ``n`` output elements, ranks' parts ``stride`` apart in ``src``. all_to_all: ``n`` elements
    per rank pair, ranks' parts ``stride`` apart in both. all_reduce: ``n`` elements,
    rank ``d``'s share ``[d * part, (d + 1) * part)``, ``part <= cap // 2``. ``cap``: elements per
    mailbox slot. Offsets are multiples of ALIGN elements. ``LANES``: the power of two from WORLD
    up."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = tdl.rank(ctx)
    stride = tl.cast(stride, tl.int64)  # rank x stride may pass 2^31 (an int32 argument)
    part = tl.cast(part, tl.int64)
    epoch, parity = start_call(counter)
    base = epoch * MAX_STEPS
    half = cap // 2
    own, mine = _share(me, n, stride, part, MODE)
    own = tl.multiple_of(own, ALIGN)
    # this program's blocks of a share: pid, pid + nprog, ...; STEP of them per iteration
    longest = part if MODE == "all_reduce" else n
    blocks = _blocks(longest, pid, nprog, BLOCK)
    steps = tl.maximum((blocks + STEP - 1) // STEP, 1)
    iterations = steps + 2 if MODE == "all_reduce" else steps + 1
    lanes, live, to_rank, from_rank = rank_lanes(me, WORLD, LANES)
    status = pid * 0

    for k in range(0, iterations):
        if k < steps:
            for i in tl.static_range(1, WORLD):
                d = (me + i) % WORLD
                off, count = _share(d, n, stride, part, MODE)
                remote = tdl.symm_at(ctx, box, d) + (parity * WORLD + me) * cap
                _copy_blocks(remote, src + tl.multiple_of(off, ALIGN), count, k * STEP,
                             tl.minimum(k * STEP + STEP, blocks), pid, nprog, BLOCK)
            if (MODE == "all_gather") or (MODE == "all_to_all"):
                _copy_blocks(dst + tl.multiple_of(me * stride, ALIGN), src + own, n, k * STEP,
                             tl.minimum(k * STEP + STEP, blocks), pid, nprog, BLOCK)
        if k == 0:
            tl.debug_barrier()
            send_call_words(ctx, words, parity, me, pid, call_word, n, to_rank, live, WORLD, MAXP)
        if k >= 1:
            tdl.wait_all(ctx, flags + from_rank * MAXP + pid, base + k, live & (lanes * 0 == status))
            if k == 1:
                status = call_words_differ(words, counter, parity, pid, call_word, n, from_rank, live,
                                           WORLD, MAXP)
        if (k >= 1) & (k <= steps) & (status == 0):
            if (MODE == "all_gather") or (MODE == "all_to_all"):
                for i in tl.static_range(1, WORLD):
                    s = (me + i) % WORLD
                    _copy_blocks(dst + tl.multiple_of(s * stride, ALIGN), box + (parity * WORLD + s) * cap, n,
                                 k * STEP - STEP, tl.minimum(k * STEP, blocks), pid, nprog, BLOCK)
            else:
                for j in range(k * STEP - STEP, tl.minimum(k * STEP, blocks)):
                    offs = (pid + j * nprog) * BLOCK + tl.arange(0, BLOCK)
                    mask = offs < mine
                    for s in tl.static_range(WORLD):
                        if s == me:
                            x = tl.load(src + own + offs, mask=mask).to(ACC)
                        else:
                            x = tl.load(box + (parity * WORLD + s) * cap + offs, mask=mask).to(ACC)
                        if s == 0:
                            acc = x
                        else:
                            acc = _combine(acc, x, OP)
                    if OP == "avg":
                        acc = acc / WORLD
                    result = acc.to(dst.dtype.element_ty)
                    if MODE == "reduce_scatter":
                        tl.store(dst + offs, result, mask=mask)
                    else:
                        tl.store(dst + own + offs, result, mask=mask)
                        for i in tl.static_range(1, WORLD):
                            d = (me + i) % WORLD
                            remote = tdl.symm_at(ctx, box, d) + (parity * WORLD + me) * cap + half
                            tl.store(remote + offs, result, mask=mask)
        if MODE == "all_reduce":
            if (k >= 2) & (status == 0):
                for i in tl.static_range(1, WORLD):
                    s = (me + i) % WORLD
                    off, count = _share(s, n, stride, part, MODE)
                    _copy_blocks(dst + tl.multiple_of(off, ALIGN), box + (parity * WORLD + s) * cap + half,
                                 count, k * STEP - 2 * STEP, tl.minimum(k * STEP - STEP, blocks), pid, nprog,
                                 BLOCK)
        if k < iterations - 1:
            tl.debug_barrier()  # every thread's pushes before the releases
            tdl.notify(ctx, flags + me * MAXP + pid, to_rank, base + k + 1, mask=live)

    end_call(counter, epoch)


@tdl.jit
def _ring_copy_rows(dst, src, counts, rows, first, last, pid, nprog, ring, BLOCK: tl.constexpr,
                    INTO_RING: tl.constexpr):
    """This program's blocks ``first`` to ``last - 1`` of each row ``r`` where ``rows`` holds:
    ``counts[r]`` elements from ``src[r]`` to ``dst[r]`` (blocks of pointers), every row's loads
    before any store (as ``oneshot._copy_rows``). The mailbox side (``dst`` if INTO_RING, else
    ``src``) holds ``ring`` of this program's blocks: block ``j`` at the place of block
    ``j % ring``."""
    for j in range(first, last):
        offs = (pid + j * nprog) * BLOCK + tl.arange(0, BLOCK)
        slot = (pid + (j % ring) * nprog) * BLOCK + tl.arange(0, BLOCK)
        mask = (offs[None, :] < counts[:, None]) & rows[:, None]
        if INTO_RING:
            tl.store(dst[:, None] + slot[None, :], tl.load(src[:, None] + offs[None, :], mask=mask), mask=mask)
        else:
            tl.store(dst[:, None] + offs[None, :], tl.load(src[:, None] + slot[None, :], mask=mask), mask=mask)


@tdl.jit
def _steps(count, pid, nprog, BLOCK: tl.constexpr, STEP: tl.constexpr):
    """Iterations program ``pid`` takes to move its blocks of ``count`` elements."""
    return (_blocks(count, pid, nprog, BLOCK) + STEP - 1) // STEP


@tdl.jit
def streamed_all_to_all_v_kernel(ctx, src, dst, box, cap, ring, flags, acks, words, counter, call_word, tables,
                                 WORLD: tl.constexpr, BLOCK: tl.constexpr, STEP: tl.constexpr,
                                 ALIGN: tl.constexpr, MAXP: tl.constexpr, LANES: tl.constexpr):
    """An all-to-all whose counts may differ between rank pairs (split sizes), streamed as above:
    ``tables`` = send offsets[WORLD] | send counts | recv offsets | recv counts (elements, the
    one-shot kernel's layout). Ranks' counts differ, so the grid may not follow them (every rank
    launches the same), and neither may the iterations: a program takes as many as its largest
    share needs, waits in iteration ``k >= 2`` only on the ranks that still send it step ``k - 1``
    and signals only the ranks it still sends to, which both ends of a pair work out from the
    count they share. Iteration 1 waits on every rank (the call words, and the mailbox parity
    rule). Each step moves every peer's block at once, a lane each (``_ring_copy_rows``).

    A share may be larger than a mailbox slot (``cap`` elements): each program's part of a slot is
    a ring of ``ring`` blocks (``ring // STEP >= 2`` steps; a larger ``ring`` than any share needs: no
    turns), and before step ``k`` overwrites step ``k - room`` (``room = ring // STEP``) the sender
    waits until its receiver has acknowledged copying that step out (``acks``, laid out as
    ``flags``; iteration ``k`` acknowledges steps up to ``k - 1`` with ``epoch * MAX_STEPS + k``,
    in every ``batch``-th iteration and the last one a sender waits for, so a sender waits once
    per ``batch`` steps, for the acknowledgement that covers them all). A receiver that found a
    call word wrong acknowledges every step at once (it copies nothing), so no sender waits for
    it in vain. With ``batch <= room - 1`` every wait is on an earlier iteration of the peer, so
    the ranks cannot wait on each other in a circle."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = tdl.rank(ctx)
    epoch, parity = start_call(counter)
    base = epoch * MAX_STEPS
    lanes, live, to_rank, from_rank = rank_lanes(me, WORLD, LANES)
    others = live & (from_rank != me)
    sent = tl.load(tables + WORLD + to_rank, mask=live, other=0)
    expected = tl.load(tables + 3 * WORLD + from_rank, mask=live, other=0)
    send_steps = _steps(sent, pid, nprog, BLOCK, STEP)  # a lane per rank to_rank
    recv_steps = tl.where(from_rank == me, 0, _steps(expected, pid, nprog, BLOCK, STEP))  # per from_rank
    # the same, per rank from_rank: the steps this rank sends each receiver, whose acks it waits on
    push_steps = _steps(tl.load(tables + WORLD + from_rank, mask=live, other=0), pid, nprog, BLOCK, STEP)
    room = ring // STEP
    batch = tl.maximum(room // 2, 1)  # steps per acknowledgement (fewer release fences)
    steps = tl.maximum(tl.maximum(tdl.largest(tl.where(live, send_steps, 0)),
                                  tdl.largest(tl.where(live, recv_steps, 0))), 1)
    # this rank's own share: straight from the input (the shorter count if the two disagree)
    own_count = tl.minimum(tl.load(tables + WORLD + me), tl.load(tables + 3 * WORLD + me))
    own_src = src + tl.multiple_of(tl.load(tables + me), ALIGN)
    own_dst = dst + tl.multiple_of(tl.load(tables + 2 * WORLD + me), ALIGN)
    own_blocks = _blocks(own_count, pid, nprog, BLOCK)
    # every peer's share at once, a lane each (to_rank: pushes, from_rank: copies out)
    push_from = src + tl.multiple_of(tl.load(tables + to_rank, mask=live, other=0), ALIGN)
    push_to = tdl.symm_at(ctx, box, to_rank) + (parity * WORLD + me) * cap
    pushing = live & (to_rank != me)
    push_blocks = tdl.largest(tl.where(pushing, _blocks(sent, pid, nprog, BLOCK), 0))
    copy_to = dst + tl.multiple_of(tl.load(tables + 2 * WORLD + from_rank, mask=live, other=0), ALIGN)
    copy_from = box + (parity * WORLD + from_rank) * cap
    copy_blocks = tdl.largest(tl.where(others, _blocks(expected, pid, nprog, BLOCK), 0))
    status = pid * 0

    for k in range(0, steps + 1):
        if k < steps:
            if (k >= room) & ((k - room) % batch == 0):
                # the places of steps k - room to k - room + batch - 1 in each receiver's ring must
                # have been copied out (acks come for every batch-th step and the last one owed)
                tdl.wait_all(ctx, acks + from_rank * MAXP + pid,
                             base + tl.minimum(k + batch - room, push_steps - room), others & (k < push_steps))
            _ring_copy_rows(push_to, push_from, tl.multiple_of(sent, ALIGN), pushing, k * STEP,
                            tl.minimum(k * STEP + STEP, push_blocks), pid, nprog, ring, BLOCK, True)
            _copy_blocks(own_dst, own_src, own_count, k * STEP, tl.minimum(k * STEP + STEP, own_blocks),
                         pid, nprog, BLOCK)
        if k == 0:
            tl.debug_barrier()
            send_call_words(ctx, words, parity, me, pid, call_word, sent, to_rank, live, WORLD, MAXP)
        if k >= 1:
            waiting = live & (lanes * 0 == status) & ((k == 1) | (k <= recv_steps))
            tdl.wait_all(ctx, flags + from_rank * MAXP + pid, base + k, waiting)
            if k == 1:
                status = call_words_differ(words, counter, parity, pid, call_word, expected, from_rank, live,
                                           WORLD, MAXP)
            if status == 0:
                _ring_copy_rows(copy_to, copy_from, tl.multiple_of(expected, ALIGN), others, k * STEP - STEP,
                                tl.minimum(k * STEP, copy_blocks), pid, nprog, ring, BLOCK, False)
        tl.debug_barrier()  # every thread's pushes and copies before the releases
        if k >= 1:
            owed = others & (((lanes * 0 == status) & (k + room <= recv_steps) &
                              ((lanes * 0 + k % batch == 0) | (k + room == recv_steps))) |
                             ((lanes * 0 != status) & (lanes * 0 + k == 1)))
            tdl.notify(ctx, acks + me * MAXP + pid, from_rank, tl.where(status == 0, base + k, base + MAX_STEPS - 1),
                       mask=owed)
        if k < steps:
            tdl.notify(ctx, flags + me * MAXP + pid, to_rank, base + k + 1, mask=live & ((k == 0) | (k < send_steps)))

    end_call(counter, epoch)
