"""What every algorithm module shares: the :class:`Algorithm` interface, the heap :class:`Area`
an algorithm declares, the :class:`Call` it serves, and the launch constants and call words.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import triton.language as tl

from .. import language
from ..triton_kernels import staged

# Elements one program moves per loop step, and the most programs a launch gets. The
# interpreter runs programs one after another, so there one program with wide steps is fastest.
BLOCK = 8192 if language.INTERPRET else 4096
MAX_PROGRAMS = 1 if language.INTERPRET else 528  # 4 per H200 SM
# Programs of a signalling launch: at most one per SM, so that every program is resident while
# it waits for its peers.
ONESHOT_PROGRAMS = 1 if language.INTERPRET else 132  # H200: 132 SMs
ONESHOT_WARPS = 8
NO_SHARE_LIMIT = 1 << 62
# A replayed launch's pointer parameter (kind, value): kind LAUNCH_ROLE_PTR + r is the call's
# tensor r plus value bytes, kind 0 the address value (csrc/device_path.hpp, LaunchPlan::Kind).
LAUNCH_ROLE_PTR = 2
NO_COUNT = staged.NO_COUNT.value  # (a call whose element counts differ between rank pairs)

# What a rank writes into its header, so that peers can tell a mismatched call from data
# (variants of one collective, like all_gather and all_gather_into_tensor, share a code).
CALL_CODE = {"all_gather_into_tensor": 1, "all_gather": 1, "reduce_scatter_tensor": 2,
             "reduce_scatter": 2, "all_reduce": 3, "reduce": 4, "all_to_all_single": 5,
             "all_to_all": 5, "broadcast": 6, "scatter": 7, "gather": 8, "barrier": 9,
             "all_gather_matmul": 10, "matmul_reduce_scatter": 11,
             "rejected": 12}  # a rank's stand-in for a call it rejected (rejection.py)
DTYPE_CODE = {dtype: code for code, dtype in enumerate(
    (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
     torch.int8, torch.uint8), start=1)}

ACCUMULATOR = {
    torch.float16: tl.float32,
    torch.bfloat16: tl.float32,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}

# The families of ops that routing tells apart (all_to_all_v: an all-to-all with split sizes).
COLLECTIVE_FAMILIES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_to_all_v",
                       "broadcast", "barrier")


def call_word(op: str, dtype: torch.dtype, rounds_left: int = 1) -> int:
    """What a signalling launch writes beside its data for its peers to compare (the kernel adds
    its element count at bit 16): the op, the dtype, and the rounds of the call left (at bit
    48), so ranks whose calls take different numbers of rounds differ at the first one."""
    return CALL_CODE[op] | DTYPE_CODE[dtype] << 8 | (rounds_left & 0x7FFF) << 48


def accumulator(dtype: torch.dtype):
    return ACCUMULATOR.get(dtype, tl.float32)


def programs(numel: int, per: int = 1) -> int:
    """Programs for a launch that moves ``numel`` elements (``per``: launches share the budget)."""
    return max(1, min(-(-numel // BLOCK), MAX_PROGRAMS // per))


def flat(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().view(-1)
    return t.view(torch.uint8) if t.dtype == torch.bool else t


@dataclasses.dataclass(frozen=True)
class Area:
    """Heap space an algorithm needs: ``nbytes(world, heap bytes)`` bytes, named so that
    algorithms that share it (the one-shot flags, the mailboxes) get one. ``words``: handed out
    as an int64 tensor (else as a byte offset). ``regions(world, heap bytes)``: the signal arrays
    in it that kernels wait on, (first int64 word, slots per peer) each, each peer's slots
    together; their number may depend on neither argument."""

    name: str
    nbytes: Callable[[int, int], int]
    words: bool = True
    regions: Callable[[int, int], tuple] = lambda world, heap_bytes: ()


def int64_area(name: str, words: Callable[[int], int], region: Callable[[int, int], int] | None = None) -> Area:
    """An int64 area of ``words(world)`` words; ``region(world, heap bytes)``: its slots per peer
    when the whole area is one signal array."""
    return Area(name, lambda world, heap_bytes: 8 * words(world),
                regions=(lambda world, heap_bytes: ((0, region(world, heap_bytes)),)) if region else
                (lambda world, heap_bytes: ()))


@dataclasses.dataclass
class Call:
    """One collective call as an algorithm serves it: ``op`` its torch.distributed name,
    ``family`` its kind (COLLECTIVE_FAMILIES), ``src`` and ``dst`` flat, ``n`` elements per rank
    pair (all_gather: the input; reduce_scatter: the output; all_reduce: all; all-to-all: a
    share; all_to_all_v: 0); ``table``/``offsets``: an all-to-all's counts table and its values;
    ``root``: broadcast's, reduce's, scatter's or gather's root rank."""

    op: str
    family: str
    src: torch.Tensor
    dst: torch.Tensor
    n: int
    reduce_op: str = "sum"
    root: int = 0
    table: torch.Tensor | None = None
    offsets: tuple = ()
    ranks_per_node: int = 1

    @property
    def message_bytes(self) -> int:
        """Bytes of this rank's input: what the size tables of routing.py compare."""
        return 0 if self.src is None else self.src.numel() * self.src.element_size()

    @property
    def pair_bytes(self) -> int:
        return self.n * (self.dst if self.src is None else self.src).element_size()

    @property
    def dtype(self) -> torch.dtype:
        return (self.dst if self.src is None else self.src).dtype


class Algorithm:
    """One way to serve collectives. A module defines a subclass and registry.py names it.

    ``serves``: the families (COLLECTIVE_FAMILIES, or others an executor method asks for by
    name); ``devices``: the device types; ``selectable``: TDIST_ALGORITHM may force it;
    ``default``: it serves whatever no other algorithm takes (routing.py). An instance lives as
    long as its group; ``areas()`` says what it needs from every heap the group makes, and
    ``attach(ctx)`` hands it the heap's context once they are laid out."""

    name = "?"
    serves: tuple = ()
    devices: tuple = ("cpu", "cuda")
    dtypes: tuple | None = None  # None: every dtype the backend serves
    selectable = True
    default = False

    def areas(self) -> list[Area]:
        return []

    def attach(self, ctx) -> None:
        """A new heap: ``ctx`` is the group's call context on it."""

    def fits(self, ctx, call: Call) -> bool:
        """Whether this algorithm can serve ``call`` (beyond family, device and dtype)."""
        return True

    def run(self, ctx, call: Call) -> None:
        raise NotImplementedError

    def share_limit(self, ctx, dtype: torch.dtype) -> int:
        """all_to_all_v: the most elements a call may send one rank (a mailbox slot's worth)."""
        return ctx.slot_bytes // dtype.itemsize

    def share_limit_note(self, ctx, dtype: torch.dtype) -> str:
        """What the error about a share past ``share_limit`` adds."""
        return ""
