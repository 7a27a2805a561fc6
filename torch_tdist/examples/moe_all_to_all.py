"""MoE dispatch as a user-written kernel: the low-latency all-to-all on tdist's primitives.

Each rank holds tokens already sorted by expert (``experts_per_rank`` experts live on each
rank) and a count per expert. ``pieces`` programs per destination rank put a share of that
rank's rows (and the counts) straight into the destination's receive buffer, then raise
their signal there; the receive buffers alternate between two halves by call parity, so no
"done" message is ever needed. The same source runs on GPUs (NVSHMEM calls, ``TDIST_TRANSPORT=nvshmem``) and on
the CPU (Triton interpreter, one process per rank).

    python -m torch_tdist.examples.moe_all_to_all --nproc 4
    python -m torch_tdist.examples.moe_all_to_all --nproc 4 --tokens 128 --hidden 7168 --topk 8

It checks every received row against ``dist.all_to_all_single`` on a Gloo (CPU) or NCCL
(GPU) group and prints the time per dispatch.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import triton.language as tl

import torch_tdist
from torch_tdist import language as tdl
from torch_tdist import shmem_device as shmem


@shmem.jit
def moe_dispatch_kernel(ctx, send, send_offsets, send_counts, recv, recv_counts, signals, call,
                        HIDDEN: tl.constexpr, MAX_ROWS: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr,
                        PIECES: tl.constexpr):
    peer = tl.program_id(0)  # the destination rank
    piece = tl.program_id(1)  # this program's share of the rows for it
    me = tdl.rank(ctx)
    world = tdl.num_ranks(ctx)
    elem_bytes: tl.constexpr = send.dtype.element_ty.primitive_bitwidth // 8
    half = call % 2
    first = tl.load(send_offsets + peer * EXPERTS_PER_RANK)
    rows = tl.load(send_offsets + (peer + 1) * EXPERTS_PER_RANK) - first
    mine = (rows + PIECES - 1) // PIECES
    start = tl.minimum(piece * mine, rows)
    count = tl.minimum(mine, rows - start)
    # rows for `peer`'s experts -> peer's recv[half, me], counts -> peer's recv_counts[half, me]
    shmem.putmem_nbi_block(recv + ((half * world + me) * MAX_ROWS + start) * HIDDEN,
                           send + (first + start) * HIDDEN, count * HIDDEN * elem_bytes, peer)
    if piece == 0:
        shmem.putmem_nbi_block(recv_counts + (half * world + me) * EXPERTS_PER_RANK,
                               send_counts + peer * EXPERTS_PER_RANK, EXPERTS_PER_RANK * 8, peer)
    shmem.fence()  # the rows and counts land before the signal
    slot = (half * world + me) * PIECES + piece
    shmem.signal_op(signals + slot, call, shmem.NVSHMEM_SIGNAL_SET, peer)
    shmem.signal_wait_until(signals + (half * world + peer) * PIECES + piece, shmem.NVSHMEM_CMP_GE, call)


class MoeDispatch:
    """Symmetric buffers for one group and shape, and the call counter."""

    def __init__(self, group, max_rows: int, hidden: int, experts_per_rank: int, dtype, pieces: int = 1):
        heap = torch_tdist.get_heap(group)
        self.pieces = pieces
        self.world = dist.get_world_size(group)
        self.ctx, self.hidden, self.max_rows, self.experts = heap.ctx, hidden, max_rows, experts_per_rank
        self.send = heap.empty((max_rows, hidden), dtype)
        self.send_counts = heap.empty(self.world * experts_per_rank, torch.int64)
        self.recv = heap.empty((2, self.world, max_rows, hidden), dtype)
        self.recv_counts = heap.empty((2, self.world, experts_per_rank), torch.int64)
        self.signals = heap.empty(2 * self.world * pieces, torch.int64)
        self.signals.zero_()
        self.calls = 0
        dist.barrier(group)  # every rank's signals are zero before any peer raises one

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor):
        """``tokens``: rows sorted by expert; ``counts[e]``: rows for expert e (all experts of
        the group). Returns (rows from each source rank, their per-expert counts)."""
        self.calls += 1
        self.send[:tokens.shape[0]].copy_(tokens)
        self.send_counts.copy_(counts)
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        moe_dispatch_kernel[(self.world, self.pieces)](
            self.ctx, self.send, offsets, self.send_counts, self.recv, self.recv_counts, self.signals,
            self.calls, HIDDEN=self.hidden, MAX_ROWS=self.max_rows, EXPERTS_PER_RANK=self.experts,
            PIECES=self.pieces, **({"num_warps": 16} if tokens.is_cuda else {}))
        half = self.calls % 2
        return self.recv[half], self.recv_counts[half]


def route(tokens: int, topk: int, experts: int, hidden: int, dtype, device, seed: int):
    """Random top-k routing: rows sorted by expert and the count per expert."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    choice = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.flatten()
    order = torch.argsort(choice, stable=True)
    sorted_rows = x.repeat_interleave(topk, dim=0)[order]
    counts = torch.bincount(choice, minlength=experts)
    return sorted_rows.to(device), counts.to(device)


def run(rank, world, device, args):
    dtype = getattr(torch, args.dtype)
    experts = world * args.experts_per_rank
    reference_group = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
    pieces = args.pieces or (8 if device.type == "cuda" else 1)
    dispatch = MoeDispatch(None, args.tokens * args.topk, args.hidden, args.experts_per_rank, dtype, pieces)
    for step in range(args.steps):
        rows, counts = route(args.tokens, args.topk, experts, args.hidden, dtype, device, 1000 * step + rank)
        recv, recv_counts = dispatch(rows, counts)
        # reference: the same exchange through all_to_all_single on Gloo / NCCL
        per_rank = counts.view(world, -1).sum(1)
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts, group=reference_group)
        rows_in = counts_in.view(world, -1).sum(1)
        expected = torch.empty(int(rows_in.sum()), args.hidden, dtype=dtype, device=device)
        dist.all_to_all_single(expected, rows, rows_in.tolist(), per_rank.tolist(), group=reference_group)
        assert torch.equal(recv_counts.reshape(-1), counts_in), f"rank {rank} step {step}: counts differ"
        got = torch.cat([recv[src, :int(rows_in[src])] for src in range(world)])
        assert torch.equal(got, expected), f"rank {rank} step {step}: rows differ from all_to_all_single"
    return _time_per_call(lambda: dispatch(rows, counts), device), \
        _time_per_call(lambda: dist.all_to_all_single(expected, rows, rows_in.tolist(), per_rank.tolist(),
                                                      group=reference_group), device)


def _time_per_call(call, device, iters: int = 20, loops: int = 5) -> float:
    """Microseconds per call: ``iters`` calls back to back after a barrier, median of ``loops``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    call()
    results = []
    for _ in range(loops):
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        results.append((time.perf_counter() - start) / iters * 1e6)
    return sorted(results)[loops // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=5, help="checked dispatches")
    parser.add_argument("--pieces", type=int, default=0, help="programs per destination (0: 8 on GPUs)")
    args = parser.parse_args(argv)
    from torch_tdist.launch import device_kind, run_local

    if device_kind(args.nproc) == "cuda":
        os.environ.setdefault("TDIST_TRANSPORT", "nvshmem")
    results = run_local(run, args.nproc, args)
    if any(r is None for r in results):
        print("moe_all_to_all: a rank failed (its error is above)", file=sys.stderr)
        return 1
    tdist_us, reference_us = (max(r[i] for r in results) for i in (0, 1))
    print(f"moe_all_to_all: {args.nproc} ranks, {args.tokens} tokens x top-{args.topk} x {args.hidden} "
          f"{args.dtype}: every row matches all_to_all_single; {tdist_us:.1f} us per dispatch "
          f"(with the input copies), all_to_all_single on the reference group {reference_us:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
