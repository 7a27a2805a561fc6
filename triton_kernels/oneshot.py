"""Collectives in one launch: every rank pushes straight into its peers' mailboxes.

``oneshot_kernel`` serves all_gather, all_reduce, reduce_scatter, broadcast and all-to-all.
Program ``q`` of every rank, in order:

1. push: for every rank ``d`` (itself included, starting with itself), copy the share of the
   input meant for ``d`` into ``d``'s mailbox slot ``[parity][me]``, blocks ``q, q + P, ...``
   (``P`` programs); then write a call word (op | dtype | count) next to it and raise the
   flag ``flags@d[me][q] = epoch`` (release, system scope).
2. wait for ``flags[s][q] >= epoch`` from every peer ``s`` (acquire), and check that ``s``'s
   call word describes the same call (a mismatch is recorded in the status slot, never read
   past). The flags of step 1 go to every rank at once and these waits poll every flag at once,
   a lane per rank: one round trip each, not one per rank.
3. combine its blocks of the local mailbox slots into the output: copy (all_gather,
   all-to-all, broadcast) or reduce in rank order (all_reduce, reduce_scatter), so every rank
   gets bit-identical sums.

Program ``q`` waits only on program ``q`` of other ranks, never on another program of its own
launch, so any number of programs is safe under the interpreter; on GPUs the grid is kept
small enough for every program to be resident.

Why two mailbox slots (``parity = epoch % 2``) and no "done" signal: a rank pushing for call
``e + 2`` has finished call ``e + 1``, so it saw every peer's flag for ``e + 1``, so every peer
had started ``e + 1``, which runs after its ``e`` on the same stream: slot ``e % 2`` is free.
This needs every rank to wait on every peer, which is why even broadcast's non-roots raise
flags, and why all of a group's launches on a rank must run in one stream order.

The epoch lives in device memory, a slot per program number (``start_call`` / ``end_call``):
each program reads its own slot at the start and, at its end, stores the epoch into the slots
of its program numbers modulo the grid, so a CUDA graph replays correctly with nothing baked
in, and no program waits for the others to end (an atomic count cost 0.8 us a call).

Memory (int64 unless said; one block per group, same offsets on every rank):
``box[2][WORLD][cap]`` (data dtype), ``flags[WORLD][MAXP]``, ``words[2][WORLD][MAXP]``
(MAXP: the most programs a launch may have), ``counter = status | epochs[EPOCH_SLOTS]``.
a2a ``tables``: ``send offsets[WORLD] | send counts[WORLD] | recv offsets[WORLD] | recv counts[WORLD]``.
"""

import triton.language as tl

from torch_tdist import language as tdl

from .staged import STATUS_CALL_MISMATCH, _combine

STATUS_SLOT = tl.constexpr(0)
# at least the programs of any launch that counts epochs (the interpreter's launch one)
EPOCH_SLOTS = tl.constexpr(1 if tdl.INTERPRET else 256)
COUNTER_SLOTS = 1 + EPOCH_SLOTS.value
COUNT_SHIFT = tl.constexpr(16)  # call word: op | dtype << 8 | count << 16 | rounds left << 48


def flag_slots(world: int, max_programs: int) -> int:
    return world * max_programs


def word_slots(world: int, max_programs: int) -> int:
    return 2 * world * max_programs


@tdl.jit
def send_call_words(ctx, words, parity, me, pid, call_word, counts, to_rank, live,
                    WORLD: tl.constexpr, MAXP: tl.constexpr):
    """This program's call word, with the element count meant for each rank (``counts``, a lane
    per rank ``to_rank``), into slot ``[parity][me][pid]`` of every live rank's words."""
    tdl.store(ctx, words + (parity * WORLD + me) * MAXP + pid,
              call_word + (tl.cast(counts, tl.int64) << COUNT_SHIFT), to_rank, mask=live)


@tdl.jit
def call_words_differ(words, counter, parity, pid, call_word, counts, from_rank, live,
                      WORLD: tl.constexpr, MAXP: tl.constexpr):
    """The status of the words program ``pid`` of each rank ``from_rank`` sent (0: each one
    ``call_word`` with the count this rank expects from it, ``counts``); a mismatch is also
    recorded in the status slot of ``counter`` for the host."""
    got = tl.load(words + (parity * WORLD + from_rank) * MAXP + pid, mask=live, other=0)
    wrong = live & (got != call_word + (tl.cast(counts, tl.int64) << COUNT_SHIFT))
    status = tdl.largest(tl.where(wrong, (from_rank + 1) * 4 + STATUS_CALL_MISMATCH, 0))
    if status != 0:
        tl.atomic_max(counter + STATUS_SLOT, tl.cast(status, tl.int64), sem="relaxed", scope="gpu")
    return status


@tdl.jit
def start_call(counter):
    """(epoch, parity) of this call, once the kernel before it has ended (programmatic dependent
    launch: only ``ctx`` may be read before this), which also lets the next kernel be scheduled.
    The epoch is one more than the last call's, from this program's slot (see ``end_call``)."""
    tdl.wait_prior_kernels()
    tdl.start_next_kernel()
    epoch = tl.load(counter + 1 + tl.program_id(0)) + 1
    return epoch, epoch % 2


@tdl.jit
def end_call(counter, epoch):
    """Record ``epoch`` as the last call's, in the slots that this program's number stands for
    modulo the grid: the next launch, whatever its grid, finds it in every program's slot. (The
    next launch runs after this one has ended: stream order, or tdl.wait_prior_kernels.)"""
    slots = tl.arange(0, EPOCH_SLOTS)
    tl.store(counter + 1 + slots, epoch + slots * 0, mask=slots % tl.num_programs(0) == tl.program_id(0))


@tdl.jit
def _share(me, d, n, stride, root, tables, MODE: tl.constexpr, WORLD: tl.constexpr, RECV: tl.constexpr,
           ALIGN: tl.constexpr = 1):
    """(offset, count) of rank ``me``'s share for rank ``d``: in the input when pushing
    (RECV False), in the output when combining what ``d`` sent (RECV True)."""
    if MODE == "all_to_all":  # counts too are multiples of ALIGN (the executor checked the tables)
        if RECV:
            return tl.load(tables + 2 * WORLD + d), tl.multiple_of(tl.load(tables + 3 * WORLD + d), ALIGN)
        else:
            return tl.load(tables + d), tl.multiple_of(tl.load(tables + WORLD + d), ALIGN)
    elif MODE == "reduce_scatter":
        if RECV:
            return d * 0, n
        else:
            return d * stride, n
    elif MODE == "all_gather":
        if RECV:
            return d * stride, n
        else:
            return d * 0, n
    elif MODE == "broadcast":
        if RECV:
            return d * 0, tl.where((d == root) & (me != root), n, 0)
        else:
            return d * 0, tl.where(me == root, n, 0)
    else:  # all_reduce
        return d * 0, n


@tdl.jit
def rank_lanes(me, WORLD: tl.constexpr, LANES: tl.constexpr):
    """A lane per rank, for signalling every rank at once: (lanes, live (lanes < WORLD), to_rank
    (the rank ``me + lane``, from this rank on), from_rank (the rank ``lane``))."""
    lanes = tl.arange(0, LANES)
    live = lanes < WORLD
    return lanes, live, tl.where(live, (me + lanes) % WORLD, me), tl.where(live, lanes, 0)


@tdl.jit
def _copy_rows(dst, src, counts, rows, pid, nprog, BLOCK: tl.constexpr):
    """Row ``r`` of a block of rows, where ``rows`` holds: ``counts[r]`` elements from ``src[r]``
    to ``dst[r]`` (blocks of pointers), this program's blocks ``pid, pid + nprog, ...`` of each.
    Every row's loads go out before any store (a row at a time, each load would wait for the
    store before it). (Masks by ``rows`` apart from ``counts``: a count of unknown divisibility
    would make every access scalar.)"""
    longest = tdl.largest(tl.where(rows, counts, 0))
    for start in range(pid * BLOCK, longest, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = (offs[None, :] < counts[:, None]) & rows[:, None]
        tl.store(dst[:, None] + offs[None, :], tl.load(src[:, None] + offs[None, :], mask=mask), mask=mask)


@tdl.jit
def oneshot_kernel(ctx, src, dst, box, cap, flags, words, counter, n, stride, root, call_word, tables,
                   MODE: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                   ALIGN: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr,
                   MAXP: tl.constexpr, LANES: tl.constexpr):
    """``n``: elements per rank pair (all_gather, all_reduce, broadcast: the input;
    reduce_scatter: the output); all-to-all reads its counts from ``tables``. ``stride``: the
    distance between ranks' parts (all_gather: in the output, reduce_scatter: in the input),
    which differs from ``n`` when a large call runs in rounds. ``cap``: elements per mailbox
    slot. ``root``: broadcast's source. Offsets are multiples of ALIGN elements. ``LANES``: the
    power of two from WORLD up (signals go to and come from every rank at once, a lane each)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = tdl.rank(ctx)
    lanes, live, to_rank, from_rank = rank_lanes(me, WORLD, LANES)
    peer_boxes = tdl.symm_at(ctx, box, to_rank)
    stride = tl.cast(stride, tl.int64)  # rank x stride may pass 2^31 (an int32 argument)
    epoch, parity = start_call(counter)
    my_slot = (parity * WORLD + me) * cap
    mailboxes = peer_boxes + my_slot  # this rank's slot on each rank
    if (MODE == "reduce_scatter") or (MODE == "all_to_all"):  # a share per rank: all moved at once
        off, count = _share(me, to_rank, n, stride, root, tables, MODE, WORLD, False, ALIGN)
        _copy_rows(mailboxes, src + tl.multiple_of(off, ALIGN), count + lanes * 0, live, pid, nprog, BLOCK)
    else:  # one share for every rank: read once, written to each
        _, count = _share(me, me, n, stride, root, tables, MODE, WORLD, False)
        for start in range(pid * BLOCK, count, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < count
            x = tl.load(src + offs, mask=mask)
            tl.store(mailboxes[:, None] + offs[None, :], tl.broadcast_to(x[None, :], (LANES, BLOCK)),
                     mask=live[:, None] & mask[None, :])
    # every rank at once, a lane each: this rank's call word and flag to each, then each one's
    tl.debug_barrier()  # every thread's pushes before the releases below
    _, sent = _share(me, to_rank, n, stride, root, tables, MODE, WORLD, False)
    send_call_words(ctx, words, parity, me, pid, call_word, sent, to_rank, live, WORLD, MAXP)
    tl.debug_barrier()
    tdl.notify(ctx, flags + me * MAXP + pid, to_rank, epoch, mask=live)

    tdl.wait_all(ctx, flags + from_rank * MAXP + pid, epoch, live)
    # the count each rank pushed to us, as our own call sees it
    if MODE == "all_to_all":
        _, expected = _share(me, from_rank, n, stride, root, tables, MODE, WORLD, True)
    else:
        _, expected = _share(from_rank, me, n, stride, root, tables, MODE, WORLD, False)
    status = call_words_differ(words, counter, parity, pid, call_word, expected, from_rank, live,
                               WORLD, MAXP)

    if (MODE == "all_reduce") or (MODE == "reduce_scatter"):
        limit = tl.where(status != 0, 0, n)
        for start in range(pid * BLOCK, limit, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            acc = tl.load(box + parity * WORLD * cap + offs, mask=mask).to(ACC)
            for s in tl.static_range(1, WORLD):
                x = tl.load(box + (parity * WORLD + s) * cap + offs, mask=mask).to(ACC)
                acc = _combine(acc, x, OP)
            if OP == "avg":
                acc = acc / WORLD
            tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=mask)
    else:
        off, count = _share(me, from_rank, n, stride, root, tables, MODE, WORLD, True, ALIGN)
        _copy_rows(dst + tl.multiple_of(off, ALIGN), box + (parity * WORLD + from_rank) * cap,
                   count + lanes * 0, live & (lanes * 0 == status), pid, nprog, BLOCK)

    end_call(counter, epoch)
