"""Jobs for test_shmem.py: the NVSHMEM-named device functions (torch_tdist.shmem_device) in user
kernels, the hierarchical all-gather and the MoE dispatch example, on the interpreter."""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton.language as tl

import torch_tdist
from torch_tdist import language as tdl
from torch_tdist import shmem_device as shmem
from torch_tdist.examples import moe_all_to_all as moe


@shmem.jit
def _ring_puts(ctx, mine, inbox, inbox_nbi, sigs, n, epoch):
    me = tdl.rank(ctx)
    right = (me + 1) % tdl.num_ranks(ctx)
    nbytes = n * 4
    shmem.putmem_block(inbox, mine, nbytes, right)
    shmem.putmem_nbi_block(inbox_nbi, mine, nbytes, right)
    shmem.quiet()
    shmem.signal_op(sigs, epoch, shmem.NVSHMEM_SIGNAL_SET, right)             # sigs[0] = epoch
    shmem.putmem_signal_block(inbox + n, mine, nbytes, sigs + 1, 3, shmem.NVSHMEM_SIGNAL_ADD, right)
    shmem.putmem_signal_nbi_block(inbox_nbi + n, mine, nbytes, sigs + 2, epoch, shmem.NVSHMEM_SIGNAL_SET,
                                  right)
    shmem.fence()
    shmem.signal_op(sigs + 3, 5, shmem.NVSHMEM_SIGNAL_ADD, right)            # sigs[3] += 5
    seen = shmem.signal_wait_until(sigs, shmem.NVSHMEM_CMP_GE, epoch)
    shmem.signal_wait_until(sigs + 1, shmem.NVSHMEM_CMP_EQ, 3 * epoch)
    shmem.signal_wait_until(sigs + 2, shmem.NVSHMEM_CMP_GT, epoch - 1)
    shmem.signal_wait_until(sigs + 3, shmem.NVSHMEM_CMP_NE, 5 * epoch - 5)
    shmem.signal_wait_until(sigs + 3, shmem.NVSHMEM_CMP_LE, 5 * epoch)
    shmem.signal_wait_until(sigs + 3, shmem.NVSHMEM_CMP_LT, 5 * epoch + 1)
    tl.store(sigs + 4, seen)


def every_call(rank, ws, seed, calls=3):
    heap = torch_tdist.get_heap()
    n = 257
    mine, inbox, inbox_nbi = heap.empty(n, torch.float32), heap.empty(2 * n, torch.float32), heap.empty(2 * n, torch.float32)
    sigs = heap.empty(5, torch.int64)
    sigs.zero_()
    dist.barrier()
    left = (rank - 1) % ws
    for epoch in range(1, calls + 1):
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(seed + 100 * epoch + r)) for r in range(ws)]
        mine.copy_(xs[rank])
        dist.barrier()  # peers' previous reads are done, every rank's data is in place
        _ring_puts[(1,)](heap.ctx, mine, inbox, inbox_nbi, sigs, n, epoch)
        for buf, name in ((inbox, "putmem_block"), (inbox_nbi, "putmem_nbi_block")):
            assert torch.equal(buf[:n], xs[left]), f"{name} did not deliver the left neighbour's data"
        assert torch.equal(inbox[n:], xs[left]), "putmem_signal_block did not deliver"
        assert torch.equal(inbox_nbi[n:], xs[left]), "putmem_signal_nbi_block did not deliver"
        assert sigs.tolist() == [epoch, 3 * epoch, epoch, 5 * epoch, epoch], f"signals: {sigs.tolist()}"
        dist.barrier()


def hierarchical(rank, ws, seed, ranks_per_node, dtype=torch.float32):
    n = 1003
    for call in range(3):  # fresh data each call: epochs and the barrier at work
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(seed + 10 * call + r)).to(dtype)
              for r in range(ws)]
        out = torch.full((ws, n), float("nan"), dtype=dtype)
        torch_tdist.hierarchical_all_gather(out, xs[rank], ranks_per_node)
        assert torch.equal(out, torch.stack(xs)), f"call {call}: hierarchical all-gather differs"


def moe_dispatch(rank, ws, seed, pieces):
    experts_per_rank, hidden, tokens, topk = 2, 64, 12, 3
    dispatch = moe.MoeDispatch(None, tokens * topk, hidden, experts_per_rank, torch.bfloat16, pieces)
    gloo = dist.new_group(backend="gloo")
    for step in range(3):
        rows, counts = moe.route(tokens, topk, ws * experts_per_rank, hidden, torch.bfloat16,
                                 torch.device("cpu"), seed + 1000 * step + rank)
        recv, recv_counts = dispatch(rows, counts)
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts, group=gloo)
        rows_in = counts_in.view(ws, -1).sum(1)
        expected = torch.empty(int(rows_in.sum()), hidden, dtype=torch.bfloat16)
        dist.all_to_all_single(expected, rows, rows_in.tolist(), counts.view(ws, -1).sum(1).tolist(), group=gloo)
        assert torch.equal(recv_counts.reshape(-1), counts_in), f"step {step}: counts differ"
        got = torch.cat([recv[s, :int(rows_in[s])] for s in range(ws)])
        assert torch.equal(got, expected), f"step {step}: rows differ from all_to_all_single on Gloo"
    dist.destroy_process_group(gloo)
