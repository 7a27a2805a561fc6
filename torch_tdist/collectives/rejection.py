"""A call that one rank rejected while its peers wait for it.

The C++ checks run on each rank's own arguments, so the root's bad ``scatter_list`` or
``gather_list`` (or a list on a rank other than the root) is seen by that rank alone, while its
peers, whose arguments are right, have launched the call and wait for it. So the rejecting rank
stands in for the call before it raises: it runs the first round of the call as its peers run
it (the tensor every rank has sizes it, and the checks do not question it), on zeros, under the
call code ``rejected`` (base.CALL_CODE). The staged kernels compare every peer's header they
read, skip the data of a different call and raise on the host; every rank ran one round's
launches, so the group's signals stay in step for later calls, as after any mismatched call.
The reason waits in the group's store under :func:`key`, for the peers' messages.

Only where calls are compared (the interpreter, or ``TDIST_CHECK_CALLS=1`` on GPUs): elsewhere a
stand-in would leave the peers' outputs untouched without an error, so the peers wait out the
timeout instead (docs/reliability.md). Other ops have no tensor the checks leave unquestioned
(an all-gather's input or output may be the wrong one), so their peers learn at the timeout.
"""

from __future__ import annotations

import torch

from .base import Call


def key(call_number: int, rank: int) -> str:
    """The store key of ``rank``'s reason for rejecting the group's call ``call_number`` (one per
    rejected call: a few bytes each, kept as long as the group's store)."""
    return f"tdist_rejected/{call_number}/{rank}"


def stand_in(op: str, tensor: torch.Tensor, root: int, world: int, rank: int) -> Call | None:
    """The scatter or gather ``op`` as the peers run it, on zeros: ``tensor`` is this rank's
    output (scatter) or input (gather). None for another op or a root out of range."""
    if op not in ("scatter", "gather") or not 0 <= root < world:
        return None
    dtype = torch.uint8 if tensor.dtype == torch.bool else tensor.dtype

    def zeros(n):
        return torch.zeros(n, dtype=dtype, device=tensor.device)

    n = tensor.numel()
    if op == "scatter":
        return Call("rejected", op, zeros(world * n) if rank == root else None, zeros(n), n, root=root)
    return Call("rejected", op, zeros(n), zeros(world * n) if rank == root else None, n, root=root)
