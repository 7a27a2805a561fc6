"""all_reduce in one launch, two-shot: each rank reduces a share of the message and hands it out.

The one-shot kernel (``oneshot.py``) pushes a rank's whole message to every peer: (WORLD - 1)
messages out of each GPU. Here rank ``d`` owns share ``d`` (``[d * part, (d + 1) * part)``, the
last shares may be shorter or empty), and program ``q`` of every rank, in order:

1. pushes its blocks (``q, q + P, ...``, ``P`` programs) of every share ``d`` into rank ``d``'s
   mailbox slot ``[parity][me]`` (first half; its own share into its own slot), writes its call
   word and raises ``flags@d[me][q] = epoch`` (release), to every rank at once;
2. waits for ``flags[s][q] >= epoch`` from every rank and checks their call words; reduces its
   blocks of its own share from the slots in rank order, stores them into the output and pushes
   them into every peer's slot ``[parity][me]`` (second half); raises ``gathered@d[me][q] =
   epoch`` (release);
3. waits for ``gathered[s][q] >= epoch`` from every peer and copies its blocks of their shares
   out of the second halves.

So 2 (WORLD - 1) / WORLD messages leave each GPU, for one more round of signals. Program ``q``
waits only on program ``q`` of other ranks (the block split is the same on every rank), as in the
one-shot kernel, whose mailboxes, call words, flags and epochs this kernel shares: its parity
rule holds across both kernels (a rank that starts call ``e + 2`` has seen every peer's first
signal of ``e + 1``, so every peer has finished ``e``, second halves included). ``gathered`` is
this kernel's own ``[WORLD][MAXP]`` block (epochs only grow, so ``>=`` never misses one). Its
call word carries a bit of its own (collectives.twoshot.TWOSHOT_CALL_BIT), so a peer that serves the
same call one-shot (another TDIST_ALGORITHM) sees a different call.
"""

import triton.language as tl

from torch_tdist import language as tdl

from .oneshot import _copy_rows, call_words_differ, end_call, rank_lanes, send_call_words, start_call
from .staged import _combine


@tdl.jit
def twoshot_all_reduce_kernel(ctx, src, dst, box, cap, flags, gathered, words, counter, n, part, call_word,
                              WORLD: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                              OP: tl.constexpr, ACC: tl.constexpr, MAXP: tl.constexpr,
                              LANES: tl.constexpr):
    """``n`` elements, rank ``d``'s share ``[d * part, (d + 1) * part)``, ``part <= cap // 2``
    and a multiple of ALIGN elements. ``cap``: elements per mailbox slot. ``LANES``: the power
    of two from WORLD up."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = tdl.rank(ctx)
    lanes, live, to_rank, from_rank = rank_lanes(me, WORLD, LANES)
    part = tl.multiple_of(tl.cast(part, tl.int64), ALIGN)
    epoch, parity = start_call(counter)
    mailboxes = tdl.symm_at(ctx, box, to_rank) + (parity * WORLD + me) * cap  # this rank's slot on each
    to_count = tl.minimum(tl.maximum(n - to_rank * part, 0), part)
    _copy_rows(mailboxes, src + to_rank * part, to_count, live, pid, nprog, BLOCK)
    tl.debug_barrier()  # every thread's pushes before the releases below
    send_call_words(ctx, words, parity, me, pid, call_word, n + lanes * 0, to_rank, live, WORLD, MAXP)
    tl.debug_barrier()
    tdl.notify(ctx, flags + me * MAXP + pid, to_rank, epoch, mask=live)

    tdl.wait_all(ctx, flags + from_rank * MAXP + pid, epoch, live)
    status = call_words_differ(words, counter, parity, pid, call_word, n + lanes * 0, from_rank, live,
                               WORLD, MAXP)
    mine = tl.where(status != 0, 0, tl.minimum(tl.maximum(n - me * part, 0), part))
    peers = live & (lanes != 0)  # lane 0 is this rank
    for start in range(pid * BLOCK, mine, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < mine
        acc = tl.load(box + parity * WORLD * cap + offs, mask=mask).to(ACC)
        for s in tl.static_range(1, WORLD):
            acc = _combine(acc, tl.load(box + (parity * WORLD + s) * cap + offs, mask=mask).to(ACC), OP)
        if OP == "avg":
            acc = acc / WORLD
        result = acc.to(dst.dtype.element_ty)
        tl.store(dst + me * part + offs, result, mask=mask)
        tl.store(mailboxes[:, None] + part + offs[None, :], tl.broadcast_to(result[None, :], (LANES, BLOCK)),
                 mask=peers[:, None] & mask[None, :])
    tl.debug_barrier()
    tdl.notify(ctx, gathered + me * MAXP + pid, to_rank, epoch, mask=peers)

    others = live & (from_rank != me) & (lanes * 0 == status)  # (a call word that differs: no more waits)
    tdl.wait_all(ctx, gathered + from_rank * MAXP + pid, epoch, others)
    from_count = tl.minimum(tl.maximum(n - from_rank * part, 0), part)
    _copy_rows(dst + from_rank * part, box + (parity * WORLD + from_rank) * cap + part, from_count, others,
               pid, nprog, BLOCK)
    end_call(counter, epoch)
