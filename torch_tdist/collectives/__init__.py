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
  launch plans for C++ to replay. The fused ops (``torch_tdist.overlap``) use the executor through
  the small interface marked in ``executor.py``.

docs/architecture.md walks through a call and shows how to add an algorithm.
"""

from .executor import Executor
from .lowlatency import LOWLATENCY_SLOT_WORDS
from .oneshot import ONESHOT_TILE_BYTES
from .routing import GPU_SIZE_LIMITS

__all__ = ["Executor", "GPU_SIZE_LIMITS", "LOWLATENCY_SLOT_WORDS", "ONESHOT_TILE_BYTES"]
