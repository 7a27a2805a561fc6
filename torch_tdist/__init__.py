"""torch-tdist: a torch.distributed backend whose collectives are Triton kernels over a
symmetric heap.

    import torch_tdist
    dist.init_process_group("tdist")
"""

from . import language
from .backend import get_executor, register, stats

__version__ = "0.1.0"
__all__ = ["language", "register", "stats", "get_heap", "__version__"]

register()


def get_heap(group=None):
    """The symmetric heap of a tdist group (created on first use): allocate buffers with
    ``get_heap(group).empty(shape, dtype)`` and pass ``get_heap(group).ctx`` to your kernels."""
    return get_executor(group).heap
