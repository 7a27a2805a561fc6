"""torch-tdist: a torch.distributed backend whose collectives are Triton kernels over a
symmetric heap.

    import torch_tdist
    dist.init_process_group("tdist")
"""

from . import language, ops
from .backend import get_executor, register, stats

__version__ = "0.1.0"
__all__ = ["language", "ops", "register", "stats", "get_heap", "hierarchical_all_gather", "__version__"]

register()


def get_heap(group=None):
    """The symmetric heap of a tdist group (created on first use): allocate buffers with
    ``get_heap(group).empty(shape, dtype)`` and pass ``get_heap(group).ctx`` to your kernels."""
    return get_executor(group).heap


def hierarchical_all_gather(output, input, ranks_per_node: int, group=None):
    """``all_gather_into_tensor`` as a multi-node job does it: the group's ranks form nodes
    of ``ranks_per_node`` consecutive ranks, chunks cross between nodes once with NVSHMEM
    puts and spread inside a node with P2P stores. On GPUs the group must use the nvshmem
    transport (``TDIST_TRANSPORT=nvshmem``). Synchronous, on the current stream."""
    get_executor(group).hierarchical_all_gather(output, input, ranks_per_node)
