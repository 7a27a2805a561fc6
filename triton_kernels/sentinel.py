"""all_reduce of floating-point tensors in one launch with no flags: the data say that they have
arrived (two-shot; TensorRT-LLM calls the method "Lamport").

The streamed kernel's two-shot all_reduce (``streamed.py``) pushes data, releases a flag (a
system-scope fence first), and its peers acquire the flag before they read: each of its two hops
is data, fence, flag. Here a mailbox at rest holds zeros and no element sent is ever zero: the
sender turns -0.0 into +0.0 and flips the sign bit (so +0.0 travels as the bits of -0.0), the
receiver flips it back. A receiver polls the data themselves until no element is zero
(``tdl.wait_filled``): each hop is one trip. It sets the mailbox back to zeros once read. Pushes
are strong stores (``tdl.store_polled``): with plain ones, fenced or not, peers on 4 H200s often
waited until the kernel that pushed had ended, which it never did (it waited for them in turn).
Strong stores still stall at times (README, "flag-free two-shot"): hence experimental on GPUs.

Rank ``d`` owns elements ``[d * part, (d + 1) * part)`` of the ``n`` (the executor calls this
kernel only where every share is non-empty). Program ``q`` of every rank, for its blocks ``q, q
+ P, ...`` of a share (``P`` programs):

1. pushes its input's block of every rank's share into that rank's inbox ``[me][parity]`` (its
   own included), and a line with its call word into that rank's ``lines[me][parity][q]``;
2. waits for every rank's line (the same call: op, dtype, element count; a peer that made another
   call leaves this rank waiting until the group's timeout, as in ``lowlatency.py``) and block in
   its own inbox, sets them back to zero, reduces the block (``_over_ranks``), writes it into its
   share of the output and pushes it into every peer's outbox ``[me][parity]``;
3. waits for every peer's reduced block in its outbox, sets it back to zero and copies it into the
   output.

Why two parities (``epoch % 2``) and nothing to say a mailbox is free: a rank that pushes for call
``e + 2`` has finished ``e + 1``, in which it got a block from every peer (a reduced one, or the
peer's contribution to its own share: no share is empty), so every peer had started ``e + 1`` and
so finished ``e``, zeroing included. The epochs are the one-shot kernel's (``start_call``), so
calls served by other kernels count too (they also hear from every peer).

Memory: ``mail``, one block per peer of ``PEER`` elements, on each rank: the inbox ``[2][SHARE]``
(what that peer sent for this rank's share), the outbox ``[2][SHARE]`` (that peer's reduced
share), then ``lines[2][MAXP]`` (int64). Elements move as integers of their width (``mail`` and
``src``/``dst`` are int16 or int32 views), so the checks are on bits.
"""

import os

import triton.language as tl

from torch_tdist import language as tdl

from .lowlatency import line_flag
from .oneshot import end_call, rank_lanes, start_call


# Under trial (TDIST_SENTINEL_TRACE=1, GPUs): each of the first TRACE_PROGRAMS programs stamps the
# GPU's clock (%globaltimer, ns) in the abort word's page (host memory) as it reaches each phase:
# word TRACE_WORD + 4 * program + phase; phases: started, lines arrived, step 2 done, step 3 done
# (benchmarks/sentinel_probe.py prints them).
TRACE = tl.constexpr(os.environ.get("TDIST_SENTINEL_TRACE", "0") == "1")
TRACE_WORD = tl.constexpr(128)
TRACE_PROGRAMS = tl.constexpr(96)


@tdl.jit
def _stamp(ctx, PHASE: tl.constexpr):
    if TRACE:
        pid = tl.program_id(0)
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)
        slot = tl.load(ctx + tdl.CTX_ABORT) + 8 * (TRACE_WORD + 4 * pid + PHASE)
        tl.store(slot.to(tl.pointer_type(tl.int64)), now, mask=pid < TRACE_PROGRAMS)


@tdl.jit
def _sign(BITS: tl.constexpr):
    """The bits of -0.0 (the sign bit alone), as an int32 (sign-extended for 16-bit elements)."""
    return -(1 << (BITS - 1))


@tdl.jit
def _encoded(x, BITS: tl.constexpr):
    """Elements (integer bits) as they travel: -0.0 made +0.0, then the sign bit flipped (never 0)."""
    x = x.to(tl.int32)
    return (tl.where(x == _sign(BITS), 0, x) ^ _sign(BITS)).to(tl.int32 if BITS == 32 else tl.int16)


@tdl.jit
def _decoded(x, BITS: tl.constexpr):
    return (x.to(tl.int32) ^ _sign(BITS)).to(tl.int32 if BITS == 32 else tl.int16)


@tdl.jit
def _summed(a, b):
    return a + b


@tdl.jit
def _largest(a, b):
    return tl.maximum(a, b)


@tdl.jit
def _smallest(a, b):
    return tl.minimum(a, b)


@tdl.jit
def _multiplied(a, b):
    return a * b


@tdl.jit
def _over_ranks(x, live, OP: tl.constexpr):
    """``OP`` over the rows of ``x`` (a row per rank, those where ``live`` holds): a tree over
    the rows, the same on every rank (only a share's owner reduces it anyway), with no row read
    twice and nothing moved between threads first."""
    if OP == "max":
        return tl.reduce(tl.where(live[:, None], x, float("-inf")), 0, _largest)
    elif OP == "min":
        return tl.reduce(tl.where(live[:, None], x, float("inf")), 0, _smallest)
    elif OP == "product":
        return tl.reduce(tl.where(live[:, None], x, 1.0), 0, _multiplied)
    else:
        return tl.reduce(tl.where(live[:, None], x, 0.0), 0, _summed)


@tdl.jit
def sentinel_all_reduce_kernel(ctx, src, dst, mail, lines, counter, n, part, call_word,
                               WORLD: tl.constexpr, SHARE: tl.constexpr, PEER: tl.constexpr,
                               BLOCK: tl.constexpr, OP: tl.constexpr, DTYPE: tl.constexpr,
                               ACC: tl.constexpr, MAXP: tl.constexpr, LANES: tl.constexpr):
    """``src``, ``dst``: ``n`` elements as integers of their width (``DTYPE``: what they are).
    ``part``: elements per share, a multiple of 16 bytes' worth. ``mail``: the mailboxes as those
    integers, ``lines``: the same memory as int64."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = tdl.rank(ctx)
    BITS: tl.constexpr = mail.dtype.element_ty.primitive_bitwidth
    lanes, live, to_rank, from_rank = rank_lanes(me, WORLD, LANES)
    epoch, parity = start_call(counter)
    flag = line_flag(epoch, call_word)
    part = tl.multiple_of(part, 16 * 8 // BITS)
    mine = tl.minimum(tl.maximum(n - me * part, 0), part)  # this rank's share's elements
    counts = tl.minimum(tl.maximum(n - lanes * part, 0), part)  # rank ``lane``'s
    inbox, outbox = parity * SHARE, (2 + parity) * SHARE  # in a peer's block of ``mail``
    line_of_mine = (4 * SHARE * BITS // 64) + parity * MAXP + pid  # in a peer's block, int64s
    blocks = (part + BLOCK - 1) // BLOCK
    _stamp(ctx, 0)

    # 1. every rank's share of the input into its inbox [me] (rank to_rank, a lane each)
    to_counts = tl.minimum(tl.maximum(n - to_rank * part, 0), part)
    my_mail = mail + me * PEER  # (in every peer's mail)
    for b in range(pid, blocks, nprog):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = live[:, None] & (offs[None, :] < to_counts[:, None])
        x = tl.load(src + (to_rank * part)[:, None] + offs[None, :], mask=mask)
        tdl.store_polled(ctx, my_mail + inbox + tl.broadcast_to(offs[None, :], (LANES, BLOCK)), _encoded(x, BITS),
                         to_rank[:, None], mask=mask)
    tdl.store_polled(ctx, lines + me * (PEER * BITS // 64) + line_of_mine, flag.to(tl.int64) << 32, to_rank,
                     mask=live)

    # 2. every rank's block here, reduced: into the output and every peer's outbox
    my_lines = lines + from_rank * (PEER * BITS // 64) + line_of_mine
    lines_got = tdl.wait_lines(ctx, my_lines, live, flag)
    tl.store(my_lines, lines_got * 0, mask=live)
    _stamp(ctx, 1)
    for b in range(pid, blocks, nprog):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < mine
        rows = mail + from_rank * PEER + inbox
        arrived = tdl.wait_filled(ctx, rows[:, None] + offs[None, :], live[:, None] & mask[None, :])
        tl.store(rows[:, None] + offs[None, :], arrived * 0, mask=live[:, None] & mask[None, :])
        acc = _over_ranks(_decoded(arrived, BITS).to(DTYPE, bitcast=True).to(ACC), live, OP)
        if OP == "avg":
            acc = acc / WORLD
        y = _encoded(acc.to(DTYPE).to(mail.dtype.element_ty, bitcast=True), BITS)
        tl.store(dst + me * part + offs, _decoded(y, BITS), mask=mask)  # (-0.0 as the peers get it)
        peers = live & (lanes != 0)
        tdl.store_polled(ctx, my_mail + outbox + tl.broadcast_to(offs[None, :], (LANES, BLOCK)),
                         tl.broadcast_to(y[None, :], (LANES, BLOCK)), to_rank[:, None],
                         mask=peers[:, None] & mask[None, :])

    _stamp(ctx, 2)

    # 3. every peer's reduced block, out of this rank's outbox into the output
    others = live & (from_rank != me)
    for b in range(pid, blocks, nprog):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = others[:, None] & (offs[None, :] < counts[:, None])
        rows = mail + from_rank * PEER + outbox
        reduced = tdl.wait_filled(ctx, rows[:, None] + offs[None, :], mask)
        tl.store(rows[:, None] + offs[None, :], reduced * 0, mask=mask)
        tl.store(dst + (from_rank * part)[:, None] + offs[None, :], _decoded(reduced, BITS), mask=mask)

    _stamp(ctx, 3)
    end_call(counter, epoch)
