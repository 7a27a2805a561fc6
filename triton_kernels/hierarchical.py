"""All-gather over nodes of P2P-connected ranks: NVSHMEM puts between nodes, stores inside.

Ranks ``node * RANKS_PER_NODE + local`` form nodes. Every rank

1. puts its chunk to the rank of the same ``local`` index on every other node
   (``shmem_device.putmem_signal_nbi_block``: data, then that chunk's signal),
2. stores its chunk into every peer of its own node (P2P) and raises the chunk's signal there,
3. forwards each chunk that arrived from another node to the peers of its own node,
4. waits until every chunk's signal has reached ``epoch``.

So each chunk crosses between two nodes once, as on a real cluster where the NVLink
domain ends at the node. One program does it all (the interpreter-safe order: it waits
only on other ranks).
"""

import triton.language as tl

from torch_tdist import language as tdl
from torch_tdist import shmem_device as shmem


@shmem.jit
def hierarchical_all_gather_kernel(ctx, src, gathered, signals, n, epoch,
                                   RANKS_PER_NODE: tl.constexpr, BLOCK: tl.constexpr):
    me = tdl.rank(ctx)
    world = tdl.num_ranks(ctx)
    node = me // RANKS_PER_NODE
    local = me % RANKS_PER_NODE
    nodes = world // RANKS_PER_NODE
    elem_bytes: tl.constexpr = gathered.dtype.element_ty.primitive_bitwidth // 8
    mine = gathered + me * n
    _copy(src, mine, n, BLOCK)  # this rank's chunk, in the heap (NVSHMEM puts from there)
    tl.debug_barrier()
    for i in range(1, nodes):  # 1. across nodes
        peer = ((node + i) % nodes) * RANKS_PER_NODE + local
        shmem.putmem_signal_nbi_block(mine, mine, n * elem_bytes, signals + me, epoch,
                                      shmem.NVSHMEM_SIGNAL_SET, peer)
    _share(ctx, mine, signals + me, n, epoch, node, local, RANKS_PER_NODE, BLOCK)  # 2.
    for i in range(1, nodes):  # 3.
        origin = ((node + i) % nodes) * RANKS_PER_NODE + local
        tdl.wait(ctx, signals + origin, epoch)
        _share(ctx, gathered + origin * n, signals + origin, n, epoch, node, local, RANKS_PER_NODE, BLOCK)
    for origin in range(0, world):  # 4.
        if origin != me:
            tdl.wait(ctx, signals + origin, epoch)
    shmem.quiet()  # this rank's puts have landed: src and the heap may be reused


@tdl.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@tdl.jit
def _share(ctx, chunk, signal, n, epoch, node, local, RANKS_PER_NODE: tl.constexpr, BLOCK: tl.constexpr):
    """Stores ``chunk`` (already in this rank's ``gathered``) into the other ranks of this
    node, then raises its ``signal`` there."""
    for j in range(1, RANKS_PER_NODE):
        peer = node * RANKS_PER_NODE + (local + j) % RANKS_PER_NODE
        tdl.putmem_block(ctx, chunk, chunk, n, peer, BLOCK)
    tl.debug_barrier()  # every thread's stores before the (one-thread) release below
    for j in range(1, RANKS_PER_NODE):
        peer = node * RANKS_PER_NODE + (local + j) % RANKS_PER_NODE
        tdl.notify(ctx, signal, peer, epoch)
