"""Small collectives in one launch, with no fence and no separate flag (NCCL's LL protocol).

The one-shot kernel (``oneshot.py``) pushes data, releases a flag (a system-scope fence: the
pushes must have reached every peer first), and the peer acquires the flag, then reads: three
NVLink trips in a row. Here every 4-byte word of a message travels as an 8-byte line
``flag << 32 | word``, written with one store, and the receiver polls the lines themselves
until each carries this call's flag: one trip. An aligned 8-byte store reaches a peer whole, so
a line with the right flag holds the right word. The price is twice the bytes, so it serves
small messages: all_gather, reduce_scatter, all_reduce and even all-to-alls whose shares are
whole words (bf16 and fp16 two to a word; reductions of 16- and 32-bit types).

Program ``q`` of every rank, for words ``[q * BLOCK, (q + 1) * BLOCK)`` of every share:

1. stores its lines into slot ``[me][parity]`` of every rank (itself included);
2. polls its lines from every rank until each carries the flag (``tdl.wait_lines``), then sets
   them back to 0;
3. copies the words out (all_gather, all-to-all), or reduces them in rank order
   (every rank the same order, so every rank gets the same bits).

The flag (the high half of a line) is ``2^31 | (epoch mod 2^16) << 15 | 15 bits of the call
word``: never 0, so a line set back to 0 never passes for a new one, and a peer making another
call (op, dtype or count) sends lines that never pass (the wait ends with the group's timeout).
A slot is free when a peer writes it by the one-shot kernel's parity rule, with the same epoch
counters (``oneshot.start_call``): it needs every rank to receive lines from every rank in every call,
which is why broadcast (non-roots send nothing) is left to the one-shot kernel.

Lines: ``lines[WORLD][2][SLOT]`` int64 (each sender's slots together, so the watchdog can name a
rank whose lines never came). Words and counts below are in 4-byte words.
"""

import triton.language as tl

from torch_tdist import language as tdl

from .oneshot import _share, end_call, rank_lanes, start_call
from .staged import _combine

LOW = tl.constexpr(0xFFFFFFFF)


@tdl.jit
def line_flag(epoch, call_word):
    """The high half of every line of this call."""
    return (1 << 31) | ((epoch & 0xFFFF) << 15) | ((call_word ^ (call_word >> 15) ^ (call_word >> 30)) & 0x7FFF)


@tdl.jit
def _part(me, d, n, stride, MODE: tl.constexpr, WORLD: tl.constexpr, RECV: tl.constexpr):
    """(offset, count) in words of rank ``me``'s share for rank ``d`` (RECV: of what ``d``
    sent ``me``, in the output)."""
    if MODE == "all_to_all":
        return d * stride, n
    else:
        return _share(me, d, n, stride, 0, None, MODE, WORLD, RECV)


@tdl.jit
def _add(a, b):
    return a + b


@tdl.jit
def _row(words, lanes, s):
    """Row ``s`` of a [LANES, BLOCK] block (its bits: a sum with zeros)."""
    return tl.reduce(tl.where(lanes[:, None] == s, words, 0), 0, _add)


@tdl.jit
def _halves(words, DTYPE: tl.constexpr, ACC: tl.constexpr, PACK: tl.constexpr):
    """The elements packed in 4-byte words (PACK 1: one, PACK 2: two 16-bit ones, low first),
    as ACC."""
    if PACK == 1:
        return words.to(DTYPE, bitcast=True).to(ACC), words.to(DTYPE, bitcast=True).to(ACC)
    else:
        low = words.to(tl.int16).to(DTYPE, bitcast=True).to(ACC)
        high = (words >> 16).to(tl.int16).to(DTYPE, bitcast=True).to(ACC)
        return low, high


@tdl.jit
def _packed(low, high, DTYPE: tl.constexpr, PACK: tl.constexpr):
    if PACK == 1:
        return low.to(DTYPE).to(tl.int32, bitcast=True)
    else:
        low_bits = low.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        high_bits = high.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32)
        return low_bits | (high_bits << 16)


@tdl.jit
def lowlatency_kernel(ctx, src, dst, lines, counter, n, stride, call_word,
                      MODE: tl.constexpr, WORLD: tl.constexpr, SLOT: tl.constexpr, BLOCK: tl.constexpr,
                      ALIGN: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr, DTYPE: tl.constexpr,
                      PACK: tl.constexpr, LANES: tl.constexpr):
    """``src``, ``dst``: the tensors as int32 words. ``n``: words per rank pair (all_gather,
    all_reduce, broadcast: the input; reduce_scatter: the output; all-to-all: each share),
    ``stride``: words between ranks' parts (all_gather: in the output, reduce_scatter: in the
    input, all-to-all: both). Offsets are multiples of ALIGN
    words. ``DTYPE``, ``PACK``: the elements and how many a word holds (reductions)."""
    pid = tl.program_id(0)
    me = tdl.rank(ctx)
    lanes, live, to_rank, from_rank = rank_lanes(me, WORLD, LANES)
    peer_lines = tdl.symm_at(ctx, lines, to_rank)
    stride = tl.cast(stride, tl.int64)
    epoch, parity = start_call(counter)
    flag = line_flag(epoch, call_word)
    high = flag << 32
    offs = pid * BLOCK + tl.arange(0, BLOCK)

    # 1. this rank's lines into its slot on every rank
    slots = peer_lines + (me * 2 + parity) * SLOT
    if (MODE == "reduce_scatter") or (MODE == "all_to_all"):
        off, count = _part(me, to_rank, n, stride, MODE, WORLD, False)
        mask = live[:, None] & (offs[None, :] < (count + lanes * 0)[:, None])
        x = tl.load(src + tl.multiple_of(off, ALIGN)[:, None] + offs[None, :], mask=mask)
        tl.store(slots[:, None] + offs[None, :], high | (x.to(tl.int64) & LOW), mask=mask)
    else:
        _, count = _part(me, me, n, stride, MODE, WORLD, False)
        x = high | (tl.load(src + offs, mask=offs < count).to(tl.int64) & LOW)
        tl.store(slots[:, None] + offs[None, :], tl.broadcast_to(x[None, :], (LANES, BLOCK)),
                 mask=live[:, None] & (offs < count)[None, :])

    # 2. every rank's lines here, then zeros in their place
    _, expected = _part(from_rank, me, n, stride, MODE, WORLD, False)
    mine = lines + (from_rank * 2 + parity) * SLOT
    mask = live[:, None] & (offs[None, :] < (expected + lanes * 0)[:, None])
    got = tdl.wait_lines(ctx, mine[:, None] + offs[None, :], mask, flag)
    tl.store(mine[:, None] + offs[None, :], got * 0, mask=mask)
    words = got.to(tl.int32)  # (the low half)

    # 3. copied out, or reduced in rank order
    if (MODE == "all_reduce") or (MODE == "reduce_scatter"):
        acc_low, acc_high = _halves(_row(words, lanes, 0), DTYPE, ACC, PACK)
        for s in tl.static_range(1, WORLD):
            low, high_half = _halves(_row(words, lanes, s), DTYPE, ACC, PACK)
            acc_low = _combine(acc_low, low, OP)
            acc_high = _combine(acc_high, high_half, OP)
        if OP == "avg":
            acc_low = acc_low / WORLD
            acc_high = acc_high / WORLD
        tl.store(dst + offs, _packed(acc_low, acc_high, DTYPE, PACK), mask=offs < n)
    else:
        off, _ = _part(me, from_rank, n, stride, MODE, WORLD, True)
        tl.store(dst + tl.multiple_of(off, ALIGN)[:, None] + offs[None, :], words, mask=mask)

    end_call(counter, epoch)
