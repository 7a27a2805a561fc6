"""A call that one rank rejected while its peers wait for it.

The C++ checks run on each rank's own arguments, so a bad ``scatter_list`` on the root, or an
output of the wrong size on one rank, is seen by that rank alone. Its peers have launched the
call and wait for it. So the rejecting rank stands in for the call before it raises: it runs
the algorithm its peers chose, on zeros of the sizes they expect, under the call code
``rejected`` (base.CALL_CODE). Every kernel that compares calls (the one-shot call words, the
staged headers) then sees a different call, skips the data and raises on the host, and because
every rank ran the same launches, the group's signals stay in step for later calls, as after any
mismatched call. The reason waits in the group's store under :func:`key`, for the peers'
messages.

Only where calls are compared (the interpreter, or ``TDIST_CHECK_CALLS=1`` on GPUs), and by an
algorithm whose kernels compare them (``Algorithm.compares_calls``; not the low-latency kernel,
whose receivers wait for lines flagged with their own call word): elsewhere the peers wait out
the timeout instead (docs/reliability.md).
"""

from __future__ import annotations

import torch

from .base import Call

# torch.distributed op -> the family its peers' call is served as
FAMILY = {"all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
          "all_reduce": "all_reduce", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
          "reduce": "reduce", "scatter": "scatter", "gather": "gather"}


def key(call_number: int, rank: int) -> str:
    """The store key of ``rank``'s reason for rejecting the group's call ``call_number``."""
    return f"tdist_rejected/{call_number}/{rank}"


def stand_in(op: str, tensor: torch.Tensor, root: int, reduce_op: str, world: int, rank: int) -> Call | None:
    """The call ``op`` as the peers run it, on zeros: ``tensor`` is this rank's tensor that sizes
    it (all-gather: the input; reduce-scatter: the output; all_to_all_single: the input; the
    rest: their one tensor). None where no stand-in can match the peers' call."""
    family = FAMILY.get(op)
    if family is None or not -1 <= root < world or (family == "all_to_all" and tensor.numel() % world):
        return None
    dtype = torch.uint8 if tensor.dtype == torch.bool else tensor.dtype

    def zeros(n):
        return torch.zeros(n, dtype=dtype, device=tensor.device)

    n = tensor.numel()
    if family == "all_gather":
        return Call("rejected", family, zeros(n), zeros(world * n), n)
    if family == "reduce_scatter":
        return Call("rejected", family, zeros(world * n), zeros(n), n, reduce_op)
    if family == "all_to_all":
        return Call("rejected", family, zeros(n), zeros(n), n // world)
    if family == "scatter":
        return Call("rejected", family, zeros(world * n) if rank == root else None, zeros(n), n, root=root)
    if family == "gather":
        return Call("rejected", family, zeros(n), zeros(world * n) if rank == root else None, n, root=root)
    return Call("rejected", family, zeros(n), zeros(n), n, reduce_op, root=max(root, 0))
