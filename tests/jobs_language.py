"""Jobs for test_language.py: every device primitive in a user kernel, on the interpreter."""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton.language as tl

import torch_tdist
from torch_tdist import language as tdl


@tdl.jit
def _ring_exchange(ctx, mine, inbox, pulled, slots, olds, sig, n, epoch, BLOCK: tl.constexpr):
    me = tdl.rank(ctx)
    world = tdl.num_ranks(ctx)
    right = (me + 1) % world
    left = (me + world - 1) % world
    tdl.putmem_block(ctx, inbox, mine, n, right, BLOCK)          # mine -> right's inbox
    tdl.atomic_add(ctx, slots, me + 1, right)                      # right's slots[0] += me + 1
    tl.store(olds, tdl.atomic_cas(ctx, slots + 1, 0, me + 7, right))  # right's slots[1]: 0 -> me + 7
    tl.store(olds + 1, tdl.atomic_xchg(ctx, slots + 2, me + 3, right))  # right's slots[2] = me + 3
    tdl.notify_add(ctx, slots + 3, right, 5)                       # right's slots[3] += 5
    tdl.notify(ctx, sig + 1, right, me + 11)                       # right's sig[1] = me + 11
    tdl.notify(ctx, sig, right, epoch)
    token = tdl.wait(ctx, sig, epoch)                              # left's puts have landed
    tdl.wait_equal(ctx, sig + 1, left + 11)                        # exactly left's value
    src = tdl.consume_token(mine, token)
    tdl.getmem_block(ctx, pulled, src, n, left, BLOCK)             # left's mine -> pulled
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    peek = tdl.load(ctx, mine + offs, left, mask=mask, other=0.0)  # left's mine, again
    tdl.store(ctx, pulled + n + offs, peek, me, mask=mask)         # "remote" store to myself


def every_primitive(rank, ws, seed):
    heap = torch_tdist.get_heap()
    n = 300
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(seed + r)) for r in range(ws)]
    mine, inbox, pulled = heap.empty(n, torch.float32), heap.empty(n, torch.float32), heap.empty(2 * n, torch.float32)
    slots, sig = heap.empty(4, torch.int64), heap.empty(2, torch.int64)
    olds = torch.full((2,), -1, dtype=torch.int64)
    mine.copy_(xs[rank])
    inbox.fill_(float("nan"))
    pulled.fill_(float("nan"))
    slots.zero_()
    sig.zero_()
    dist.barrier()  # every rank's buffers are filled before any peer touches them
    _ring_exchange[(1,)](heap.ctx, mine, inbox, pulled, slots, olds, sig, n, 1, BLOCK=512)
    dist.barrier()  # every rank's atomics on my slots are done
    left = (rank - 1) % ws
    assert torch.equal(inbox, xs[left]), "putmem_block did not deliver the left neighbour's data"
    assert torch.equal(pulled[:n], xs[left]), "getmem_block did not fetch the left neighbour's data"
    assert torch.equal(pulled[n:], xs[left]), "load/store with a peer did not move the data"
    assert slots.tolist() == [left + 1, left + 7, left + 3, 5], f"atomics on this rank's slots: {slots.tolist()}"
    assert olds.tolist() == [0, 0], f"atomic_cas/atomic_xchg returned {olds.tolist()}, expected the old zeros"
    assert sig.tolist() == [1, left + 11], f"notify did not set the signals: {sig.tolist()}"


@tdl.jit
def _every_rank_at_once(ctx, board, sig, got, top, base, epoch, LANES: tl.constexpr):
    me = tdl.rank(ctx)
    lanes = tl.arange(0, LANES)
    live = lanes < tdl.num_ranks(ctx)
    to_rank = tl.where(live, lanes, 0)
    tdl.store(ctx, board + me, base + 100 * me + to_rank, to_rank, mask=live)  # rank d's board[me]
    tdl.notify(ctx, sig + me, to_rank, epoch, mask=live)                     # rank d's sig[me] = epoch
    tdl.wait_all(ctx, sig + to_rank, epoch, live)                            # every rank's stores landed
    values = tl.load(board + lanes, mask=live, other=0)
    tl.store(got + lanes, values, mask=live)
    tl.store(top, tdl.largest(tl.where(live, values, -1)))


def every_rank_at_once(rank, ws, seed):
    """notify to a block of ranks, wait_all on a block of signals, largest: every rank writes a
    value for each rank into that rank's board, signals all of them at once, waits for all."""
    heap = torch_tdist.get_heap()
    lanes = 1 << (ws - 1).bit_length()
    board, sig = heap.empty(lanes, torch.int64), heap.empty(lanes, torch.int64)
    got, top = torch.full((lanes,), -7, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    base = seed % 1000
    board.fill_(-1)
    sig.zero_()
    dist.barrier()
    _every_rank_at_once[(1,)](heap.ctx, board, sig, got, top, base, 3, LANES=lanes)
    want = [base + 100 * s + rank for s in range(ws)]
    assert got[:ws].tolist() == want, f"board after wait_all: {got[:ws].tolist()}, expected {want}"
    assert got[ws:].tolist() == [-7] * (lanes - ws), "lanes past the group were written"
    assert sig[:ws].tolist() == [3] * ws, f"notify did not reach every slot: {sig.tolist()}"
    assert top.item() == max(want), f"largest gave {top.item()}, expected {max(want)}"
    dist.barrier()  # no peer still writes into this rank's board when the job returns


@tdl.jit
def _data_as_signal(ctx, mine, box, got, n, BLOCK: tl.constexpr):
    me = tdl.rank(ctx)
    right = (me + 1) % tdl.num_ranks(ctx)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tdl.store_polled(ctx, box + offs, tl.load(mine + offs, mask=mask), right, mask=mask)  # right's box
    tl.store(got + offs, tdl.wait_filled(ctx, box + offs, mask), mask=mask)  # the left's, once here


def data_as_signal(rank, ws, seed):
    """store_polled and wait_filled: every rank stores non-zero ints into its right neighbour's
    zeroed box and waits until its own box holds no zero."""
    heap = torch_tdist.get_heap()
    n = 200
    xs = [torch.randint(1, 1 << 30, (n,), generator=torch.Generator().manual_seed(seed + r)).to(torch.int32)
          for r in range(ws)]
    mine, box = heap.empty(n, torch.int32), heap.empty(n, torch.int32)
    got = torch.zeros(n, dtype=torch.int32)
    mine.copy_(xs[rank])
    box.zero_()
    dist.barrier()
    _data_as_signal[(1,)](heap.ctx, mine, box, got, n, BLOCK=256)
    assert torch.equal(got, xs[(rank - 1) % ws]), "wait_filled returned before the left neighbour's data"
    dist.barrier()
