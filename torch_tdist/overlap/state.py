"""One group's overlap state: what the fused ops keep between calls, made on the group's first
overlapped call and closed with the group (``Executor.attached``)."""

from __future__ import annotations

import collections

import torch

from .. import _C
from .replay import OPS, ProgramReplay
from .tuning import Tuning


class OverlapState:
    """The overlap ops' context for one group: its executor (used only through the interface the
    package docstring lists), the shape classes tuned (``tuning``), the recorded programs and
    their CUDA graphs (``replays``) and ``fused_calls``: calls the overlapped ways served, by op.
    ``issued``: the calls the C++ backend issued (``csrc/fused_calls.cpp``), by way."""

    def __init__(self, executor):
        self.executor = executor
        self.tuning = Tuning()
        self.issued = _C.FusedCounts()
        self.replays = ProgramReplay(executor, self.issued)
        self._fused_calls = collections.Counter()

    @property
    def fused_calls(self) -> collections.Counter:
        """Calls the overlapped ways served, by op: in Python and issued from C++."""
        issued = self.issued
        return self._fused_calls + collections.Counter(
            {op: issued.program[i] + issued.graph[i] for i, op in enumerate(OPS)})

    def replay_program(self, op: str, program, roles: list[torch.Tensor]):
        """A recorded program's call that C++ issued where it has no CUDA graph at ``roles``'
        addresses: ``ProgramReplay.run_program``, which may capture one."""
        self.executor.run_unplanned(op, lambda: self.replays.run_program(program, roles))

    def rounds(self, op: str, a: torch.Tensor, rows: int, row_len: int, pulled: bool = False,
               most_rows: int | None = None):
        """(first row, rows) of each round of an overlapped op whose part per rank is ``rows``
        rows of ``row_len`` elements: as many rows as the bulk area holds (each rank's part in
        its own slot, or ``pulled``: in the whole area; at most ``most_rows``). None, counting
        nothing, when not one row fits (``row_len`` is the same on every rank: they all decide
        alike). Starts the call (``Executor.begin_call``)."""
        self.executor.begin_call(op, a)
        bulk = self.executor.bulk
        capacity = bulk.pull_capacity if pulled else bulk.part_capacity
        per_round = capacity(a.dtype) // row_len if row_len else 0
        per_round = min(per_round, most_rows or per_round)
        if per_round == 0:
            return None
        self._fused_calls[op] += 1
        return [(row0, min(per_round, rows - row0)) for row0 in range(0, rows, per_round)]

    def close(self):
        """The group closes (before its heap goes): its CUDA graphs and scratch memory go."""
        self.replays.close()


def state_of(executor) -> OverlapState:
    """``executor``'s group's overlap state (made on the first call)."""
    return executor.attached("overlap", OverlapState)
