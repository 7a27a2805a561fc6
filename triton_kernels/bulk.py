"""The kernels of the bulk path (``torch_tdist/bulk.py``): peers copy chunks of a message into
this rank's slots and raise a flag per chunk; the gather and reduce kernels take each chunk as
soon as its flags are up, so their work overlaps the copies still in flight.

Who pushes: the copy engines (the host queues copies and flag writes on side streams, and the
kernels get ``PUSHERS=0``), or the kernel's own first ``PUSHERS`` programs, which push this
rank's data to its peers while the other programs take what arrives. One grid for both roles:
programs of one grid no larger than the GPU are resident together, while two kernels that wait on
each other's work across ranks could each fill the GPU and wait forever.

Slots: ``slots + s * slot_stride`` is where rank ``s`` puts its part; ``ready + s * KMAX + k`` is
the flag rank ``s`` raises (to 1) once chunk ``k`` (elements ``[k * chunk, (k + 1) * chunk)``)
of its part is there. The host zeroes the flags after the kernel.
"""

import triton.language as tl

from torch_tdist import language as tdl

from .staged import _combine


@tdl.jit
def _copy(dst, src, n, pid, nprog, BLOCK: tl.constexpr):
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@tdl.jit
def _push(ctx, src, src_stride, part_len, limit, slots, slot_stride, ready, chunk, n_chunks, pid, nprog,
          ME: tl.constexpr, WORLD: tl.constexpr, KMAX: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``pid`` of ``nprog`` pushers: for every peer ``p`` and chunk ``k``, elements ``[k *
    chunk, (k + 1) * chunk)`` of ``p``'s part (``src + p * src_stride``, ``min(part_len, limit - p
    * src_stride)`` elements, at least 0) go to slot ``ME`` on ``p``, then ``p``'s flag ``ready +
    ME * KMAX + k`` is raised. Chunk-major, so every peer's first chunks land first."""
    src_stride = src_stride.to(tl.int64)  # (int64: peer * stride may pass 2**31)
    mine = slots + ME * slot_stride.to(tl.int64)
    for item in range(pid, (WORLD - 1) * n_chunks, nprog):
        k = item // (WORLD - 1)
        peer = (ME + item % (WORLD - 1) + 1) % WORLD
        length = tl.maximum(tl.minimum(part_len, limit - peer * src_stride), 0)
        count = tl.maximum(tl.minimum(chunk, length - k * chunk), 0)
        remote = tdl.symm_at(ctx, mine, peer) + k * chunk
        local = src + peer * src_stride + k * chunk
        for start in range(0, count, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < count
            tl.store(remote + offs, tl.load(local + offs, mask=mask), mask=mask)
        tl.debug_barrier()  # every thread's stores before the (one-thread) release below
        tdl.notify(ctx, ready + ME * KMAX + k, peer, 1)


@tdl.jit
def _pushers_first(ctx, push_src, push_stride, push_len, push_limit, slots, slot_stride, ready, chunk,
                   n_chunks, ME: tl.constexpr, WORLD: tl.constexpr, KMAX: tl.constexpr,
                   BLOCK: tl.constexpr, ALIGN: tl.constexpr, PUSHERS: tl.constexpr):
    """Programs below ``PUSHERS`` push ``push_src`` (see ``_push``). Returns (this program's index
    among the receiving programs, -1 for a pusher; how many receive; ``slot_stride`` and ``chunk``
    as int64 multiples of ALIGN, for the receivers' addressing: s * stride may pass 2**31)."""
    pid = tl.program_id(0)
    slot_stride = tl.multiple_of(slot_stride.to(tl.int64), ALIGN)
    chunk = tl.multiple_of(chunk.to(tl.int64), ALIGN)
    if pid < PUSHERS:
        _push(ctx, push_src, tl.multiple_of(push_stride, ALIGN), push_len, push_limit, slots, slot_stride,
              ready, chunk, n_chunks, pid, PUSHERS, ME, WORLD, KMAX, BLOCK)
    return tl.where(pid < PUSHERS, -1, pid - PUSHERS), tl.num_programs(0) - PUSHERS, slot_stride, chunk


@tdl.jit
def gather_chunks_kernel(ctx, own, slots, slot_stride, ready, out, part_stride, part_len, limit,
                         chunk, n_chunks, push_src, push_stride, push_len, push_limit,
                         ME: tl.constexpr, WORLD: tl.constexpr, KMAX: tl.constexpr,
                         BLOCK: tl.constexpr, ALIGN: tl.constexpr, PUSHERS: tl.constexpr):
    """``out + s * part_stride`` gets rank ``s``'s part (``own`` for this rank), of
    ``min(part_len, limit - s * part_stride)`` elements (at least 0). With ``PUSHERS``, those
    programs first push ``push_src`` (see ``_push``)."""
    pid, nprog, slot_stride, chunk = _pushers_first(ctx, push_src, push_stride, push_len, push_limit, slots,
                                                    slot_stride, ready, chunk, n_chunks, ME, WORLD, KMAX,
                                                    BLOCK, ALIGN, PUSHERS)
    part_stride = tl.multiple_of(part_stride.to(tl.int64), ALIGN)
    if pid >= 0:
        mine = tl.maximum(tl.minimum(part_len, limit - ME * part_stride), 0)
        _copy(out + ME * part_stride, own, mine, pid, nprog, BLOCK)
        for k in range(n_chunks):
            for i in tl.static_range(1, WORLD):
                s = (ME + i) % WORLD
                tdl.wait(ctx, ready + s * KMAX + k, 1)
                length = tl.maximum(tl.minimum(part_len, limit - s * part_stride), 0)
                count = tl.maximum(tl.minimum(chunk, length - k * chunk), 0)
                _copy(out + s * part_stride + k * chunk, slots + s * slot_stride + k * chunk, count, pid,
                      nprog, BLOCK)


@tdl.jit
def reduce_chunks_kernel(ctx, own, slots, slot_stride, ready, dst, n, chunk, n_chunks,
                         push_src, push_stride, push_len, push_limit,
                         ME: tl.constexpr, WORLD: tl.constexpr, KMAX: tl.constexpr,
                         BLOCK: tl.constexpr, ALIGN: tl.constexpr, OP: tl.constexpr,
                         ACC: tl.constexpr, PUSHERS: tl.constexpr):
    """``dst[i] = OP over ranks s (in rank order) of part_s[i]`` for i < n, part ``ME`` being
    ``own``. Every rank combines in the same order, so results are bit-identical across ranks.
    With ``PUSHERS``, those programs first push ``push_src`` (see ``_push``)."""
    pid, nprog, slot_stride, chunk = _pushers_first(ctx, push_src, push_stride, push_len, push_limit, slots,
                                                    slot_stride, ready, chunk, n_chunks, ME, WORLD, KMAX,
                                                    BLOCK, ALIGN, PUSHERS)
    if pid >= 0:
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


@tdl.jit
def wait_peers_kernel(ctx, flags, stride, value, ME: tl.constexpr, WORLD: tl.constexpr):
    """One program: holds its stream until every peer ``p``'s flag ``flags + p * stride`` is
    ``value``, or the group is aborted (the bulk path's barriers on GPUs)."""
    for i in tl.static_range(1, WORLD):
        tdl.wait_equal(ctx, flags + ((ME + i) % WORLD) * stride, value)
