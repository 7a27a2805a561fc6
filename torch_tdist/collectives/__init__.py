"""Host side of every collective: algorithms in a registry, one routing policy, a thin executor.

- ``base.py``: the :class:`~.base.Algorithm` interface, the heap :class:`~.base.Area` an
  algorithm declares and the :class:`~.base.Call` it serves;
- one module per algorithm: ``oneshot.py``, ``twoshot.py``, ``streamed.py``, ``lowlatency.py``,
  ``bulk.py``, ``staged.py`` (reduce, scatter, gather), ``hierarchical.py``;
- ``registry.py``: name -> algorithm, in routing's order;
- ``routing.py``: the size tables and the rule that picks an algorithm for a call;
- ``context.py``: the heap laid out from what the algorithms declare, and the call context
  they launch through;
- ``executor.py``: the :class:`Executor` the C++ backend calls, one per group; ``plans.py``:
  launch plans for C++ to replay; ``overlap_part.py``: the overlap ops' part of it.

docs/architecture.md walks through a call and shows how to add an algorithm.
"""

from .executor import Executor
from .lowlatency import LOWLATENCY_SLOT_WORDS
from .oneshot import ONESHOT_TILE_BYTES
from .overlap_part import GEMM_CONFIGS, OVERLAPS, PIPELINE_CHUNKS
from .routing import GPU_SIZE_LIMITS

__all__ = ["Executor", "GEMM_CONFIGS", "GPU_SIZE_LIMITS", "LOWLATENCY_SLOT_WORDS", "ONESHOT_TILE_BYTES",
           "OVERLAPS", "PIPELINE_CHUNKS"]
