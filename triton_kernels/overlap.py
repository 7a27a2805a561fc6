"""Kernels that overlap a matmul with the collective feeding it.

``ag_gemm_kernel``: C = all_gather(A) @ B while A's shards arrive. Peers push their shard of A
[m, K] into this rank's bulk slots (``triton_kernels/bulk.py``'s protocol: slot ``s`` holds rank
``s``'s shard, flag ``ready + s * KMAX + k`` rises when its chunk ``k`` has landed). The GEMM's
persistent programs take output tiles shard by shard, this rank's own shard first, then the
others in rank order from it (the order they are likely to land in), and wait only for the chunks
a tile's rows live in. Within a shard, tiles go in groups of ``GROUP_M`` row blocks
(``_tile``). With ``PUSHERS``, the kernel's first programs push this rank's shard to
its peers (``bulk._pushers_first``).

``gemm_rs_kernel``: the partial products of matmul + reduce-scatter, made in the order of the rank
they are for (the next rank first, this rank's own rows last) and stored straight into that
rank's slot for this rank; when the last tile of a row block is there, the rank's flag for that
block rises. The owner's ``reduce_chunks_kernel`` sums each row block as its flags come up.
"""

import triton.language as tl

from torch_tdist import language as tdl

from .bulk import _pushers_first


@tdl.jit
def _mma(acc, a_tile, b_tile, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a_tile @ b_tile``. ``IEEE``: float32 products in full precision (as torch.matmul),
    not TF32. ``UPCAST``: multiply in float32 (the interpreter's dot of 16-bit floats is wrong in
    Triton 3.9)."""
    if UPCAST:
        return tl.dot(a_tile.to(tl.float32), b_tile.to(tl.float32), acc)
    if IEEE:
        return tl.dot(a_tile, b_tile, acc, input_precision="ieee")
    return tl.dot(a_tile, b_tile, acc)


@tdl.jit
def _tile(t, row_blocks, col_blocks, GROUP_M: tl.constexpr):
    """(row block, column block) of tile ``t`` of a [row_blocks, col_blocks] grid, in groups of
    ``GROUP_M`` row blocks taken column by column, so that the tiles running at once share rows
    of A and columns of B in L2 (``GROUP_M`` 1: row by row)."""
    per_group = GROUP_M * col_blocks
    first = (t // per_group) * GROUP_M
    height = tl.minimum(row_blocks - first, GROUP_M)
    return first + (t % per_group) % height, (t % per_group) // height


@tdl.jit
def ag_gemm_kernel(ctx, own, slots, slot_stride, ready, b, c, a_out, m, row0, m_shard, N, K, stride_bk, stride_bn,
                   chunk, n_chunks, push_src, push_stride, push_len, push_limit,
                   ME: tl.constexpr, WORLD: tl.constexpr, KMAX: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                   PUSHERS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr):
    """One round: rows ``[row0, row0 + m)`` of every rank's shard of A (``m_shard`` rows each;
    ``own`` for this rank, ``slots + s * slot_stride`` for rank ``s``, each contiguous [m, K]) times
    ``b`` [K, N] go to rows ``s * m_shard + row0 + i`` of ``c`` [WORLD * m_shard, N]
    (contiguous); ``a_out`` [WORLD * m_shard, K] gets those rows of A as well. ``IEEE``,
    ``UPCAST``: see ``_mma``."""
    pid, nprog, slot_stride, chunk = _pushers_first(ctx, push_src, push_stride, push_len, push_limit, slots,
                                                    slot_stride, ready, chunk, n_chunks, ME, WORLD, KMAX,
                                                    BLOCK, ALIGN, PUSHERS)
    if pid >= 0:
        row_blocks = (m + BM - 1) // BM
        col_blocks = (N + BN - 1) // BN
        per_shard = row_blocks * col_blocks
        offs_k = tl.arange(0, BK)
        for t in range(pid, WORLD * per_shard, nprog):
            s = (ME + t // per_shard) % WORLD
            rb, cb = _tile(t % per_shard, row_blocks, col_blocks, GROUP_M)
            rows = rb * BM + tl.arange(0, BM)
            cols = cb * BN + tl.arange(0, BN)
            if s == ME:
                a = own
            else:
                first = (rb * BM * K) // chunk
                last = (tl.minimum(rb * BM + BM, m) * K - 1) // chunk
                for k in range(first, last + 1):
                    tdl.wait(ctx, ready + s * KMAX + k, 1)
                a = slots + s * slot_stride
            acc = tl.full((BM, BN), 0.0, tl.float32)  # (tl.zeros is a jit function the interpreter cannot call)
            for k0 in range(0, K, BK):
                ks = k0 + offs_k
                a_tile = tl.load(a + rows[:, None].to(tl.int64) * K + ks[None, :],
                                 mask=(rows[:, None] < m) & (ks[None, :] < K), other=0.0)
                b_tile = tl.load(b + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                                 mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
                acc = _mma(acc, a_tile, b_tile, IEEE, UPCAST)
            if cb == 0:
                # A's rows to a_out in a pass of their own: storing a_tile inside the loop above
                # gave wrong products with 8 warps and 3 stages on H200s (Triton 3.x)
                for k0 in range(0, K, BK):
                    ks = k0 + offs_k
                    a_mask = (rows[:, None] < m) & (ks[None, :] < K)
                    tl.store(a_out + (s * m_shard + row0 + rows)[:, None].to(tl.int64) * K + ks[None, :],
                             tl.load(a + rows[:, None].to(tl.int64) * K + ks[None, :], mask=a_mask), mask=a_mask)
            out_rows = (s * m_shard + row0 + rows)[:, None].to(tl.int64)
            tl.store(c + out_rows * N + cols[None, :], acc.to(c.dtype.element_ty),
                     mask=(rows[:, None] < m) & (cols[None, :] < N))
        if pid == 0:  # every peer's pushes have landed before the host zeroes the flags (N may be 0)
            for i in tl.static_range(1, WORLD):
                for k in range(n_chunks):
                    tdl.wait(ctx, ready + ((ME + i) % WORLD) * KMAX + k, 1)


@tdl.jit
def gemm_rs_kernel(ctx, a, b, slots, slot_stride, ready, counters, m, row0, m_shard, N, K, stride_am, stride_ak,
                   stride_bk, stride_bn, ME: tl.constexpr, WORLD: tl.constexpr, KMAX: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                   UPCAST: tl.constexpr, GROUP_M: tl.constexpr):
    """One round: rows ``[d * m_shard + row0, d * m_shard + row0 + m)`` of ``a`` [WORLD *
    m_shard, K] @ ``b`` [K, N] go to rank ``d``'s slot ``ME`` (``slots + ME * slot_stride``
    there, row-major [m, N]). Row block ``rb`` (``BM``
    rows) of it done, ``ready + ME * KMAX + rb`` rises on ``d``; ``counters + d * KMAX + rb``
    (this rank's, zero before and after) counts its finished tiles. Rank ``ME``'s own rows go to
    its own slot, with no flag (the reduction runs after this kernel on the same stream)."""
    row_blocks = (m + BM - 1) // BM
    col_blocks = (N + BN - 1) // BN
    per_rank = row_blocks * col_blocks
    offs_k = tl.arange(0, BK)
    mine = slots + ME * slot_stride.to(tl.int64)
    for t in range(tl.program_id(0), WORLD * per_rank, tl.num_programs(0)):
        d = (ME + 1 + t // per_rank) % WORLD
        rb, cb = _tile(t % per_rank, row_blocks, col_blocks, GROUP_M)
        rows = rb * BM + tl.arange(0, BM)
        cols = cb * BN + tl.arange(0, BN)
        a_rows = (d * m_shard + row0 + rows)[:, None].to(tl.int64)
        acc = tl.full((BM, BN), 0.0, tl.float32)  # (tl.zeros is a jit function the interpreter cannot call)
        for k0 in range(0, K, BK):
            ks = k0 + offs_k
            a_tile = tl.load(a + a_rows * stride_am + ks[None, :] * stride_ak,
                             mask=(rows[:, None] < m) & (ks[None, :] < K), other=0.0)
            b_tile = tl.load(b + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                             mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
            acc = _mma(acc, a_tile, b_tile, IEEE, UPCAST)
        there = tdl.symm_at(ctx, mine, d)
        tl.store(there + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(there.dtype.element_ty),
                 mask=(rows[:, None] < m) & (cols[None, :] < N))
        tl.debug_barrier()  # every thread's stores before the (one-thread) count below
        done = tl.atomic_add(counters + d * KMAX + rb, 1, sem="acq_rel", scope="sys")
        if done == col_blocks - 1:  # the block's last tile: its other tiles are visible here
            tl.atomic_xchg(counters + d * KMAX + rb, 0, sem="relaxed", scope="gpu")
            if d != ME:
                tdl.notify(ctx, ready + ME * KMAX + rb, d, 1)
