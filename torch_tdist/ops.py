"""``torch_tdist.ops``: the fused compute-communication ops under the name users import,
``all_gather_matmul`` and ``matmul_reduce_scatter``. Their code, custom-op registration
(``torch.ops.tdist.*``), overlapped ways, tuning and replay live in :mod:`torch_tdist.overlap`; this
module only re-exports its public functions, so that ``torch_tdist.ops`` stays the one name to
use while the package keeps its parts apart."""

from .overlap import all_gather_matmul, matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]
