"""The kernels of the bulk path (``torch_tdist/bulk.py``): peers copy chunks of a message into
this rank's slots (by the copy engines, or by ``push_chunks_kernel``) and raise a flag per
chunk; the gather and reduce kernels take each chunk as soon as its flags are up, so their
work overlaps the copies still in flight.

Slots: ``slots + s * slot_stride`` is where rank ``s`` puts its part; ``ready + s * KMAX + k`` is
the flag rank ``s`` raises (to 1) once chunk ``k`` (elements ``[k * chunk, (k + 1) * chunk)``)
of its part is there. The host zeroes the flags after the kernel.
"""

import triton.language as tl

from torch_tdist import language as tdl

from .staged import _combine


@tdl.jit
def _copy(dst, src, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@tdl.jit
def push_chunks_kernel(ctx, src, src_stride, part_len, limit, dst, ready, chunk, n_chunks,
                       ME: tl.constexpr, WORLD: tl.constexpr, KMAX: tl.constexpr,
                       BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """The pushes by SMs: for every peer ``p`` and chunk ``k``, elements ``[k * chunk, (k + 1)
    * chunk)`` of ``p``'s part (``src + p * src_stride``, ``min(part_len, limit - p *
    src_stride)`` elements, at least 0) go to symmetric ``dst`` on ``p``, then ``p``'s flag
    ``ready + ME * KMAX + k`` is raised. One program per (chunk, peer) item, chunk-major, so
    every peer's first chunks land first."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    src_stride = tl.multiple_of(src_stride.to(tl.int64), ALIGN)  # (int64: peer * stride may pass 2**31)
    chunk = tl.multiple_of(chunk.to(tl.int64), ALIGN)
    for item in range(pid, (WORLD - 1) * n_chunks, nprog):
        k = item // (WORLD - 1)
        peer = (ME + item % (WORLD - 1) + 1) % WORLD
        length = tl.maximum(tl.minimum(part_len, limit - peer * src_stride), 0)
        count = tl.maximum(tl.minimum(chunk, length - k * chunk), 0)
        remote = tdl.symm_at(ctx, dst, peer) + k * chunk
        local = src + peer * src_stride + k * chunk
        for start in range(0, count, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < count
            tl.store(remote + offs, tl.load(local + offs, mask=mask), mask=mask)
        tl.debug_barrier()  # every thread's stores before the (one-thread) release below
        tdl.notify(ctx, ready + ME * KMAX + k, peer, 1)


@tdl.jit
def gather_chunks_kernel(ctx, own, slots, slot_stride, ready, out, part_stride, part_len, limit,
                         chunk, n_chunks, ME: tl.constexpr, WORLD: tl.constexpr, KMAX: tl.constexpr,
                         BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """``out + s * part_stride`` gets rank ``s``'s part (``own`` for this rank), of
    ``min(part_len, limit - s * part_stride)`` elements (at least 0)."""
    slot_stride = tl.multiple_of(slot_stride.to(tl.int64), ALIGN)  # (int64: s * stride may pass 2**31)
    part_stride = tl.multiple_of(part_stride.to(tl.int64), ALIGN)
    chunk = tl.multiple_of(chunk.to(tl.int64), ALIGN)
    mine = tl.maximum(tl.minimum(part_len, limit - ME * part_stride), 0)
    _copy(out + ME * part_stride, own, mine, BLOCK)
    for k in range(n_chunks):
        for i in tl.static_range(1, WORLD):
            s = (ME + i) % WORLD
            tdl.wait(ctx, ready + s * KMAX + k, 1)
            length = tl.maximum(tl.minimum(part_len, limit - s * part_stride), 0)
            count = tl.maximum(tl.minimum(chunk, length - k * chunk), 0)
            _copy(out + s * part_stride + k * chunk, slots + s * slot_stride + k * chunk, count, BLOCK)


@tdl.jit
def reduce_chunks_kernel(ctx, own, slots, slot_stride, ready, dst, n, chunk, n_chunks,
                         ME: tl.constexpr, WORLD: tl.constexpr, KMAX: tl.constexpr,
                         BLOCK: tl.constexpr, ALIGN: tl.constexpr, OP: tl.constexpr,
                         ACC: tl.constexpr):
    """``dst[i] = OP over ranks s (in rank order) of part_s[i]`` for i < n, part ``ME`` being
    ``own``. Every rank combines in the same order, so results are bit-identical across ranks."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    slot_stride = tl.multiple_of(slot_stride.to(tl.int64), ALIGN)  # (int64: s * stride may pass 2**31)
    chunk = tl.multiple_of(chunk.to(tl.int64), ALIGN)
    for k in range(n_chunks):
        for i in tl.static_range(1, WORLD):
            tdl.wait(ctx, ready + ((ME + i) % WORLD) * KMAX + k, 1)
        end = tl.minimum(n, (k + 1) * chunk)
        for start in range(k * chunk + pid * BLOCK, end, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < end
            if ME == 0:
                acc = tl.load(own + offs, mask=mask).to(ACC)
            else:
                acc = tl.load(slots + offs, mask=mask).to(ACC)
            for s in tl.static_range(1, WORLD):
                if s == ME:
                    x = tl.load(own + offs, mask=mask).to(ACC)
                else:
                    x = tl.load(slots + s * slot_stride + offs, mask=mask).to(ACC)
                acc = _combine(acc, x, OP)
            if OP == "avg":
                acc = acc / WORLD
            tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=mask)
