"""The pipelined way: the copy engines move each rank's part in chunks while torch.matmul takes
the chunks that have landed (all_gather_matmul) or makes the next ones (matmul_reduce_scatter),
over the group's bulk path; recorded on the first call and replayed from C++ (``replay.py``)."""

from __future__ import annotations

import torch

from .. import language
from ..bulk import KMAX

PIPELINE_CHUNKS = (2,) if language.INTERPRET else (2, 1, 4)  # chunks per rank's part; the first is "pipelined"'s
# A pipelined op's matmul that overlaps no transfer (all_gather_matmul: the last chunk's;
# matmul_reduce_scatter: the first chunk's) goes in END_PIECES pieces of rows where the transfer
# outlasts the matmul (estimated at an H200's copy-engine and bf16 matmul rates below): there it
# adds to the op's time. Where the matmul is longer it does not, and smaller matmuls only cost.
# 4 H200s, M 8192, 4 pieces against 1 (replayed step by step): all_gather_matmul 8192x4096x12288 and 8192x3584x14336
# 618 -> 578 and 707 -> 654 us, matmul_reduce_scatter 8192x14336x4096 734 -> 679 us (transfer
# longer); 8192x28672x8192 1546 -> 1608 and 1766 -> 1823 us (matmul longer).
END_PIECES = 4
COPY_BYTES_PER_US = 300e3
MATMUL_FLOP_PER_US = 600e6


def _rounds(state, op: str, a: torch.Tensor, rows: int, row_len: int, chunks: int, pulled: bool = False):
    """``OverlapState.rounds`` of a pipelined op, each with its elements per chunk: the round's
    rows in ``chunks`` pieces (at most KMAX)."""
    rounds = state.rounds(op, a, rows, row_len, pulled)
    if rounds is None:
        return None
    return [(row0, n, max(-(-n // chunks), -(-n // KMAX)) * row_len) for row0, n in rounds]


def _end_pieces(moved_bytes: int, flop: int) -> int:
    """How many pieces the pipelined op's exposed matmul goes in (END_PIECES)."""
    return END_PIECES if moved_bytes / COPY_BYTES_PER_US > flop / MATMUL_FLOP_PER_US else 1


def all_gather_matmul(state, a: torch.Tensor, bs: list[torch.Tensor], outs: list[torch.Tensor],
                      a_out: torch.Tensor, chunks: int) -> bool:
    """What ``fused.all_gather_matmul`` makes, by the copy engines and torch.matmul, for each B
    of ``bs`` into its output of ``outs``: each peer's rows, in ``chunks`` pieces, are pulled
    into ``a_out`` and multiplied on the caller's stream as they land
    (``BulkPath.all_gather_pulled``); this rank's own first."""
    op = "all_gather_matmul"
    m, k = a.shape
    rounds = _rounds(state, op, a, m, k, chunks, pulled=True)
    if rounds is None:
        return False
    executor = state.executor
    bulk, world = executor.bulk, executor.world_size
    columns = sum(b.shape[1] for b in bs)
    pieces = _end_pieces((world - 1) * a.numel() * a.element_size(), 2 * world * a.numel() * columns)

    def calls():
        for row0, rows, chunk in rounds:

            def consume(rank, start, piece, stream):
                r0, count = rank * m + row0 + start // k, piece.numel() // k
                for b, out in zip(bs, outs):
                    bulk.matmul(piece.view(count, k), b, out[r0:r0 + count], stream)

            a_round = a[row0:row0 + rows].reshape(-1)
            # a_out's rows of this round, rank by rank: contiguous per rank, so a strided view
            gathered = a_out.view(world, m * k)[:, row0 * k:(row0 + rows) * k]
            executor.bulk_call(op, lambda op_, word, _, flat: bulk.all_gather_pulled(
                op_, word, flat, gathered, chunk, consume, row=k, end_pieces=pieces), outs[0], a_round)

    state.replays.recorded(op, (op, chunks), [a, *bs, *outs, a_out], calls)
    return True


def matmul_reduce_scatter(state, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                          reduce_op: str, chunks: int) -> bool:
    """What ``fused.matmul_reduce_scatter`` makes, by torch.matmul and the copy engines: the
    partial products for each peer, in ``chunks`` pieces, are pushed while the next are
    made, this rank's own last, then summed as they land (``BulkPath.reduce_scatter_pipelined``;
    torch.matmul writing them straight into the peers' heaps was 1.2x to 1.35x slower on
    H200s)."""
    op = "matmul_reduce_scatter"
    m, n = out.shape
    rounds = _rounds(state, op, a, m, n, chunks)
    if rounds is None:
        return False
    executor = state.executor
    bulk, world = executor.bulk, executor.world_size
    staging = state.replays.scratch(out, world * max(rows for _, rows, _ in rounds) * n)
    pieces = _end_pieces((world - 1) * out.numel() * out.element_size(), 2 * world * out.numel() * a.shape[1])

    def calls():
        for row0, rows, chunk in rounds:

            def produce(rank, start, dst):
                r0, count = rank * m + row0 + start // n, dst.numel() // n
                bulk.matmul(a[r0:r0 + count], b, dst.view(count, n))

            executor.bulk_call(op, lambda op_, word, flat, _: bulk.reduce_scatter_pipelined(
                op_, word, flat, chunk, reduce_op, produce, staging, row=n, end_pieces=pieces),
                out[row0:row0 + rows].view(-1), a)

    state.replays.recorded(op, (op, chunks, reduce_op), [a, b, out, staging], calls)
    return True
