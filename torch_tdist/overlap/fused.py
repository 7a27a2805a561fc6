"""The fused way: one Triton kernel (``triton_kernels/overlap.py``) computes the matmul's tiles as
the chunks they need land (all_gather_matmul), or sends each rank its rows as the matmul makes
them (matmul_reduce_scatter), over the group's bulk path."""

from __future__ import annotations

import torch

from .. import language
from ..bulk import KMAX
from ..bulk import aligned as _aligned
from ..bulk import vector as _vector
from ..triton_kernels import overlap as kernels

# Tile configs of the overlapped matmuls, the first the default of "fused": small under the
# interpreter (GROUP_M 2, so that grouped tile orders run there); on GPUs H100/H200 bf16 shapes.
# GROUP_M (triton_kernels/overlap.py, _tile): row blocks a group of tiles spans, so that the
# tiles running at once share A's rows and B's columns in L2. The kernels alone on one H200
# (one rank), TP=4 layers of Llama-3 at 8192 rows, us, 128x256 tiles in rows (GROUP_M 1)
# against groups of 8: 70B gate/up 3212 -> 2773 (cuBLAS 2374), 8B q/k/v 265 -> 193 (131),
# 70B MLP down projection 1464 -> 1388 (1204); 70B q/k/v 543 -> 627 (418), hence the third.
# 128x128 tiles in 4 stages win at 2048 rows of 70B q/k/v (227 us against 267); 256x128 tiles
# won nowhere.
GEMM_CONFIGS = ([{"BM": 16, "BN": 16, "BK": 16, "GROUP_M": 2}] if language.INTERPRET else
                [{"BM": 128, "BN": 256, "BK": 64, "num_stages": 3, "GROUP_M": 8},
                 {"BM": 128, "BN": 128, "BK": 64, "num_stages": 4, "GROUP_M": 8},
                 {"BM": 128, "BN": 256, "BK": 64, "num_stages": 3, "GROUP_M": 1}])
GEMM_PROGRAMS = 1 if language.INTERPRET else 132  # persistent, one per H200 SM


def _sized(tiles: dict, dtype: torch.dtype) -> dict:
    """``tiles`` for ``dtype``: on GPUs, 4-byte elements take half the K of a tile, so that a
    stage of float32 tiles takes the shared memory a stage of 16-bit ones does (the configs are
    sized for those)."""
    if language.INTERPRET or dtype.itemsize < 4:
        return tiles
    return {**tiles, "BK": tiles["BK"] // 2}


def all_gather_matmul(state, a: torch.Tensor, bs: list[torch.Tensor], outs: list[torch.Tensor],
                      a_out: torch.Tensor, tiles: dict = GEMM_CONFIGS[0]) -> bool:
    """``out`` = all_gather(``a``) @ ``b`` and ``a_out`` = all_gather(``a``) over ``state``'s
    group, the matmul taking each peer's rows as they land; ``a`` [m, K], ``bs`` [b] (one
    kernel makes one product: the caller puts several Bs side by side) and ``outs`` [out],
    out [world * m, N], ``a_out`` contiguous. On the caller's stream; in rounds of as many
    rows as the bulk area holds. False, having done nothing, when not one row fits."""
    op = "all_gather_matmul"
    (b,), (out,) = bs, outs
    m, k = a.shape
    n, dtype = b.shape[1], a.dtype
    rounds = state.rounds(op, a, m, k)
    if rounds is None:
        return False
    executor = state.executor
    bulk, ctx = executor.bulk, executor.heap.ctx
    for row0, rows in rounds:

        def consume(own, slots, slot_stride, ready, chunk, n_chunks, grid, push_args, pushers):
            aligned = _aligned(dtype, (slot_stride, chunk, push_args[1], row0 * k))
            executor.launch(op, kernels.ag_gemm_kernel, (grid,), ctx, own, slots, slot_stride, ready,
                            b, out, a_out, rows, row0, m, n, k, b.stride(0), b.stride(1), chunk, n_chunks,
                            *push_args, **bulk.kernel_meta(dtype), **_sized(tiles, dtype),
                            ALIGN=_vector(dtype) if aligned else 1, PUSHERS=pushers,
                            IEEE=dtype == torch.float32, UPCAST=language.INTERPRET)

        executor.bulk_call(op, lambda op_, word, _, flat: bulk.all_gather_consumed(op_, word, flat, consume),
                           out, a[row0:row0 + rows].reshape(-1))
    return True


def matmul_reduce_scatter(state, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                          reduce_op: str, tiles: dict = GEMM_CONFIGS[0]) -> bool:
    """``out`` [m, N] = rows [rank * m, (rank + 1) * m) of OP over ranks of ``a`` [world * m,
    K] @ ``b`` [K, N], each rank's rows sent as the matmul makes them. On the caller's stream;
    in rounds of as many rows as the bulk area holds (at most KMAX row blocks). False, having
    done nothing, when not one row fits."""
    op = "matmul_reduce_scatter"
    m, n = out.shape
    rounds = state.rounds(op, a, m, n, most_rows=KMAX * tiles["BM"])
    if rounds is None:
        return False
    executor = state.executor
    bulk, ctx = executor.bulk, executor.heap.ctx
    warps = {} if language.INTERPRET else {"num_warps": 8}
    for row0, rows in rounds:

        def produce(slots, slot_stride, ready, counters):
            executor.launch(op, kernels.gemm_rs_kernel, (GEMM_PROGRAMS,), ctx, a, b, slots,
                            slot_stride, ready, counters, rows, row0, m, n, a.shape[1], a.stride(0), a.stride(1),
                            b.stride(0), b.stride(1), ME=executor.rank, WORLD=executor.world_size, KMAX=KMAX,
                            IEEE=out.dtype == torch.float32, UPCAST=language.INTERPRET, **_sized(tiles, out.dtype),
                            **warps)

        executor.bulk_call(op, lambda op_, word, flat, _: bulk.reduce_scatter_produced(
            op_, word, flat, rows, tiles["BM"] * n, reduce_op, produce), out[row0:row0 + rows].view(-1), a)
    return True
