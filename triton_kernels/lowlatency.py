"""Small collectives in one launch with no fence and no separate flag: every 8-byte line a rank
pushes carries its own flag (NCCL's LL protocol, in Triton).

The one-shot kernel (``oneshot.py``) pushes data, then releases a flag (a system-scope fence:
the pushes must reach every peer first), then the peer acquires the flag and reads the data:
three NVLink trips. Here each element travels as a line ``flag << 32 | its bits`` (32 bits of
payload), stored with one 8-byte store, and the receiver polls the lines themselves until every
one carries this call's flag: one trip. Aligned 8-byte stores reach a peer whole, so a line with
the right flag holds the right data. The price: 8 bytes of traffic per element (4x for bf16),
so it serves small messages only.

Served: all_gather, all_reduce, reduce_scatter, broadcast and even all-to-alls of elements of 4
bytes or less (reductions: 16- and 32-bit floats and int32, on power-of-two groups). Program
``q`` of every rank moves elements ``[q * BLOCK, (q + 1) * BLOCK)`` of every share:

1. stores two header lines (its call word, with the count it sends each rank, in two halves)
   and its lines into slot ``[me][parity]`` of every rank (itself included);
2. polls the header lines from every rank until they carry the flag, and checks the call words
   (a mismatch is recorded in the status slot ``counter[2]``, and that rank's lines are not
   waited for); even broadcast's non-roots send headers, so every rank waits on every peer;
3. polls its lines from every rank, then copies them out (all_gather, all-to-all, broadcast)
   or reduces them (every rank the same tree over ranks, so every rank gets the same bits).

Mailboxes: ``box[WORLD][2][cap]`` int64 lines of their own (each rank's slots together, so the
watchdog can name a rank whose lines never came), ``2 * MAXP`` header lines then data lines per
slot. The flag is ``(epoch mod 2^31) | 2^31`` in the high half: never 0 (a fresh heap), and a
slot's stale lines are two calls old. Epoch, parity rule and counter are the one-shot kernel's.
"""

import triton.language as tl

from torch_tdist import language as tdl

from .oneshot import COUNT_SHIFT, _share
from .staged import STATUS_CALL_MISMATCH, _arrive_last

LOW = tl.constexpr(0xFFFFFFFF)  # the payload half of a line


@tdl.jit
def _lines(x, flag, BITS: tl.constexpr):
    """Values (4 bytes or less) as lines carrying ``flag``."""
    return flag | (x.to(BITS, bitcast=True).to(tl.int64) & LOW)


@tdl.jit
def _values(lines, BITS: tl.constexpr, DTYPE: tl.constexpr):
    return (lines & LOW).to(tl.int32).to(BITS).to(DTYPE, bitcast=True)


@tdl.jit
def _sent(me, d, n, stride, root, MODE: tl.constexpr, WORLD: tl.constexpr):
    """(offset in the input, count) of what rank ``me`` sends rank ``d``."""
    if MODE == "all_to_all":
        return d * stride, n
    else:
        return _share(me, d, n, stride, root, None, MODE, WORLD, False)


@tdl.jit
def _received(me, d, n, stride, root, MODE: tl.constexpr, WORLD: tl.constexpr):
    """(offset in the output, count) of what rank ``d`` sends rank ``me``."""
    if MODE == "all_to_all":
        return d * stride, n
    else:
        return _share(me, d, n, stride, root, None, MODE, WORLD, True)


@tdl.jit
def _sum(a, b):
    return a + b


@tdl.jit
def _max(a, b):
    return tl.maximum(a, b)


@tdl.jit
def _min(a, b):
    return tl.minimum(a, b)


@tdl.jit
def _product(a, b):
    return a * b


@tdl.jit
def _reduce_ranks(x, OP: tl.constexpr):
    """``x[WORLD, BLOCK]`` reduced over ranks (axis 0)."""
    if OP == "max":
        return tl.reduce(x, 0, _max)
    elif OP == "min":
        return tl.reduce(x, 0, _min)
    elif OP == "product":
        return tl.reduce(x, 0, _product)
    else:
        return tl.reduce(x, 0, _sum)


@tdl.jit
def lowlatency_kernel(ctx, src, dst, box, cap, counter, n, stride, root, call_word,
                      MODE: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, OP: tl.constexpr,
                      ACC: tl.constexpr, BITS: tl.constexpr, MAXP: tl.constexpr, LANES: tl.constexpr):
    """``n``, ``stride``, ``root``: as ``oneshot_kernel``'s (all-to-all: even, ``n`` elements per
    rank pair, ``stride`` apart in input and output). ``cap``: lines per slot. ``BITS``: the
    integer type of the elements' width."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = tdl.rank(ctx)
    stride = tl.cast(stride, tl.int64)
    epoch = tl.load(counter + 1) + 1
    parity = epoch % 2
    flag = ((epoch & 0x7FFFFFFF) | 0x80000000) << 32
    lanes = tl.arange(0, LANES)
    live = lanes < WORLD
    to_rank = tl.where(live, (me + lanes) % WORLD, me)
    from_rank = tl.where(live, lanes, 0)
    header = 2 * MAXP
    offs = pid * BLOCK + tl.arange(0, BLOCK)

    # 1. headers and lines to every rank
    slots = tdl.symm_at(ctx, box, to_rank) + (me * 2 + parity) * cap
    _, sent = _sent(me, to_rank, n, stride, root, MODE, WORLD)
    word = call_word + (tl.cast(sent, tl.int64) << COUNT_SHIFT)
    tl.store(slots + 2 * pid, flag | (word & LOW), mask=live)
    tl.store(slots + 2 * pid + 1, flag | ((word >> 32) & LOW), mask=live)
    if (MODE == "reduce_scatter") or (MODE == "all_to_all"):
        off, count = _sent(me, to_rank, n, stride, root, MODE, WORLD)
        mask = live[:, None] & (offs[None, :] < (count + lanes * 0)[:, None])
        x = tl.load(src + off[:, None] + offs[None, :], mask=mask)
        tl.store(slots[:, None] + header + offs[None, :], _lines(x, flag, BITS), mask=mask)
    else:
        _, count = _sent(me, me, n, stride, root, MODE, WORLD)
        x = _lines(tl.load(src + offs, mask=offs < count), flag, BITS)
        tl.store(slots[:, None] + header + offs[None, :], tl.broadcast_to(x[None, :], (LANES, BLOCK)),
                 mask=live[:, None] & (offs < count)[None, :])

    # 2. every rank's header, and its call word
    mine = box + (from_rank * 2 + parity) * cap
    low = tdl.wait_lines(ctx, mine + 2 * pid, live, flag)
    high = tdl.wait_lines(ctx, mine + 2 * pid + 1, live, flag)
    _, expected = _sent(from_rank, me, n, stride, root, MODE, WORLD)
    got = (low & LOW) | ((high & LOW) << 32)
    wrong = live & (got != call_word + (tl.cast(expected, tl.int64) << COUNT_SHIFT))
    status = tdl.largest(tl.where(wrong, (from_rank + 1) * 4 + STATUS_CALL_MISMATCH, 0))
    if status != 0:
        tl.atomic_max(counter + 2, tl.cast(status, tl.int64), sem="relaxed", scope="gpu")
    rows = live & (lanes * 0 == status)

    # 3. every rank's lines, copied out or reduced
    if (MODE == "all_reduce") or (MODE == "reduce_scatter"):
        mask = rows[:, None] & (offs < n)[None, :]
        x = _values(tdl.wait_lines(ctx, mine[:, None] + header + offs[None, :], mask, flag), BITS,
                    dst.dtype.element_ty)
        acc = _reduce_ranks(x.to(ACC), OP)
        if OP == "avg":
            acc = acc / WORLD
        tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=(offs < n) & (offs * 0 == status))
    else:
        off, count = _received(me, from_rank, n, stride, root, MODE, WORLD)
        mask = rows[:, None] & (offs[None, :] < (count + lanes * 0)[:, None])
        x = tdl.wait_lines(ctx, mine[:, None] + header + offs[None, :], mask, flag)
        tl.store(dst + off[:, None] + offs[None, :], _values(x, BITS, dst.dtype.element_ty), mask=mask)

    if nprog == 1:
        tl.store(counter + 1, epoch)
    elif _arrive_last(counter, 0):
        tl.store(counter + 1, epoch)  # every program of this launch has read it
