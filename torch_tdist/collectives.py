"""Host side of every collective: heap layout, algorithm choice, launches.

The C++ backend (``torch_tdist._C.ProcessGroupTDist``) validates arguments, counts calls and
hands each served op to an :class:`Executor` method of the same name as torch.distributed's
function. all_gather, reduce_scatter, all_reduce, broadcast, all-to-all and barrier are one
launch each of ``triton_kernels/oneshot.py`` (several rounds when a message is larger than a
mailbox slot); large all_gathers, reduce_scatters and all_reduces, and even all-to-alls, are
one launch each of ``triton_kernels/streamed.py`` (pushes, reductions and copies overlapped in
steps; all_reduce two-shot; see STREAMED_FROM_BYTES); middle-sized all_reduces on GPUs are one
launch of ``triton_kernels/twoshot.py`` (TWOSHOT_FROM_BYTES); the bulk path (``bulk.py``: copies between
heaps, see BULK_FROM_BYTES) serves large messages on the CPU and the fused overlap ops; small
all_gathers, all_reduces and even all-to-alls on GPUs are one launch of
``triton_kernels/lowlatency.py`` (LOWLATENCY_UP_TO_BYTES), and floating-point all_reduces may
be one launch of ``triton_kernels/sentinel.py`` (SENTINEL_UP_TO_BYTES); reduce, scatter and
gather are the publish/pull pair of ``triton_kernels/staged.py``.
"""

import contextlib
import ctypes
import mmap
import os
import warnings
from datetime import timedelta

import torch
import triton
import triton.language as tl

from . import language
from .bulk import PUSHERS, BulkPath
from .bulk import aligned as _aligned
from .bulk import vector as _vector
from .heap import DEFAULT_HEAP_BYTES, SymmetricHeap, heap_options
from .triton_kernels import hierarchical, lowlatency, oneshot, sentinel, staged, streamed, twoshot

# Elements one program moves per loop step, and the most programs a launch gets. The
# interpreter runs programs one after another, so there one program with wide steps is fastest.
BLOCK = 8192 if language.INTERPRET else 4096
MAX_PROGRAMS = 1 if language.INTERPRET else 528  # 4 per H200 SM
# One-shot launches: bytes one program moves per step (every rank's share together, so a rank's
# block is 1/LANES of it), and programs (at most one per SM, so that every program of a launch is
# resident while it waits for its peers). On 4 H200s 16 KB and 32 KB did alike in CUDA graphs
# from 8 KB to 1 MB (within 1 us; 32 KB ahead on all_gather, reduce_scatter and all_reduce),
# 64 KB up to 2.5 us slower (benchmarks/results/collectives_NVIDIA_H200-x4-oneshot-tiles.json).
ONESHOT_TILE_BYTES = 32768
ONESHOT_PROGRAMS = 1 if language.INTERPRET else 132  # H200: 132 SMs
ONESHOT_WARPS = 8
# A message of fewer than ONESHOT_PROGRAMS full tiles is spread over every program instead, in
# tiles down to one 16-byte access per thread. On 4 H200s, bf16, CUDA graphs: reduce_scatter
# 8 KB to 1 MB 4.8-7.5 -> 4.4-7.2 us a call; the streamed kernel gained nothing from the same
# rule (all_reduce 512 KB to 16 MB; all_gather, reduce_scatter, all-to-all at 4 and 16 MB).
ONESHOT_MIN_TILE_BYTES = 16 * 32 * ONESHOT_WARPS
# Launch options of the one-shot, streamed and low-latency kernels. They may start while the
# kernel before them runs (programmatic dependent launch: they wait for it in the kernel,
# tdl.wait_prior_kernels); in CUDA graphs on 4 H200s that took an 8 KB all_gather from 6.1 to
# 5.4 us, kernel start to kernel start.
SIGNALLING_META = {} if language.INTERPRET else {"num_warps": ONESHOT_WARPS,
                                                 **({"launch_pdl": True} if language.DEPENDENT_LAUNCH else {})}
# Streamed launches: the same programs and blocks on GPUs; under the interpreter small blocks, so
# that the tests' messages take several steps. Blocks per step and program: on H200s 1 did best
# at 64 and 256 MB (benchmarks/results/collectives_NVIDIA_H200-x4-streamed.json, against 2 and
# 4); TDIST_STREAMED_STEP_BLOCKS sets it, to measure others.
STREAMED_BLOCK = 256 if language.INTERPRET else None  # None: by the rule in _streamed_block
STREAMED_BLOCK_BYTES = 16384
STREAMED_STEP_BLOCKS = 1
# A share too short to give every program a block of STREAMED_BLOCK_BYTES (an all_reduce's
# quarter of a few MB) is cut into smaller blocks, down to this many bytes, so that more programs
# (SMs) move it; TDIST_STREAMED_MIN_BLOCK_BYTES sets it, to measure others (at 16384 every
# block is 16 KB).
STREAMED_MIN_BLOCK_BYTES = 16384
# All-to-alls with split sizes: smaller blocks, more to a step (the same bytes per step), so that
# a small share spreads over more programs (SMs).
UNEVEN_BLOCK_BYTES = 4096
UNEVEN_STEP_BLOCKS = 4
NO_TURNS = 1 << 30  # a ring larger than any share's blocks: no turns (and no acks)
NO_SHARE_LIMIT = 1 << 62


def _streamed_block(dtype: torch.dtype, longest: int, min_bytes: int) -> int:
    """Elements per block of a streamed launch whose longest share is ``longest`` elements: the
    power of two that spreads it over every program, between ``min_bytes`` and
    STREAMED_BLOCK_BYTES."""
    if STREAMED_BLOCK:
        return STREAMED_BLOCK
    spread = 1 << max(-(-longest * dtype.itemsize // ONESHOT_PROGRAMS) - 1, 1).bit_length()
    return max(min_bytes, min(spread, STREAMED_BLOCK_BYTES)) // dtype.itemsize


def _uneven_block(dtype: torch.dtype) -> int:
    return STREAMED_BLOCK or UNEVEN_BLOCK_BYTES // dtype.itemsize


def _turns_slot_bytes(dtype: torch.dtype) -> int:
    """The smallest mailbox slot in which streamed_all_to_all_v_kernel moves shares larger than a
    slot in turns: room for two steps of every program."""
    return 2 * UNEVEN_STEP_BLOCKS * ONESHOT_PROGRAMS * _uneven_block(dtype) * dtype.itemsize


# GPU messages (bytes per rank) up to which tdist's kernels serve each op; larger ones go to
# NCCL (counted as fallback in stats()), because there tdist measured slower than 0.9x NCCL.
# Measured on a quiet host, where NCCL's small calls take 17-21 us back to back (on busier
# hosts its host overhead, 35-47 us, made it look slower; benchmarks/results/
# collectives_NVIDIA_H200-x4-small-{1,2}.json, every size through tdist): broadcast dropped to
# 0.80x-0.90x at 1 MB there; since the kernel signals every rank at once it did 0.99x at 1 MB in
# CUDA graphs (1.48x eager) and 0.73x at 4 MB (collectives_NVIDIA_H200-x4-a2a-bcast.json), so it
# is served up to 1 MB. Even all_to_all_single is tdist's at every size (here and
# STREAMED_FROM_BYTES). all_reduce did 0.80x-0.90x at 1 MB there too, before the kernel signalled every rank at once; since then
# it did 1.07x-1.26x of NCCL's speed from 512 KB to 1 MB in CUDA graphs (no host time,
# collectives_NVIDIA_H200-x4-all-reduce-512k-1m.json), and the streamed kernel serves it above
# 1 MB. All-to-alls whose split sizes are given are tdist's at every size (TDIST_UNEVEN_ALL_TO_ALL=0
# hands them to NCCL; since ranks' sizes differ no size test could do it on every rank alike):
# the streamed kernel for them (132 programs whatever the counts; shares larger than a mailbox
# in turns) did 1.04x-1.90x of NCCL's speed eager, 1.05x-1.53x in CUDA graphs, for routed MoE
# dispatch of 0.1 to 470 MB a rank on 4 H100s (collectives_NVIDIA_H100_80GB_HBM3-x4-uneven-a2a.json).
# TDIST_GPU_SIZE_LIMITS=0 lifts the limits, to measure tdist's kernels at every size.
GPU_SIZE_LIMITS = {
    "all_gather_into_tensor": 1 << 20, "all_gather": 1 << 20,
    "reduce_scatter_tensor": None, "all_reduce": 1 << 20,
    "broadcast": 1 << 20, "all_to_all_single": 1 << 20,
}
# the key of each op in BULK_FROM_BYTES and STREAMED_FROM_BYTES
_FAMILY = {"all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce",
           "all_to_all_single": "all_to_all"}

# Messages (bytes per rank; reduce_scatter: its input) from which all_gather, reduce_scatter and
# all_reduce take the bulk path (None: never); on GPUs that overrides GPU_SIZE_LIMITS from there
# on. On the CPU it beats the interpreted one-shot kernel from a few MB for all_gather and
# reduce_scatter, not for all_reduce. On H200s the pushes of reduce_scatter and all_reduce were
# 0.53x to 1.01x of NCCL's speed from 16 to 256 MB (benchmarks/results/collectives_NVIDIA_H200-
# x4-bulk-sm.json, bulk_sm_tuning_NVIDIA_H200-x4.json); all_gather's copy-engine pulls
# (collectives_NVIDIA_H200-x4-bulk-pull.json) match NCCL from 64 MB, where the streamed kernel
# (below) is 3-13% faster still, so GPUs take the bulk path only when TDIST_ALGORITHM=bulk.
# TDIST_ALGORITHM=oneshot|bulk|streamed forces one path at every size, with no size handed to
# NCCL (to measure them; streamed: all_gather, reduce_scatter, all_reduce and even all-to-alls,
# the other ops one-shot).
BULK_FROM_BYTES = {
    "cpu": {"all_gather": 4 << 20, "reduce_scatter": 4 << 20, "all_reduce": None},
    "cuda": {"all_gather": None, "reduce_scatter": None, "all_reduce": None},
}
# Messages (bytes per rank; reduce_scatter: its input) from which all_gather, reduce_scatter and
# all_reduce take the streamed kernel (None: never), below the bulk path's sizes. On H200s (4
# ranks, bf16, benchmarks/results/collectives_NVIDIA_H200-x4-streamed.json), NCCL time / tdist
# time: all_gather one-shot 1.96x, 1.29x, 0.98x, 0.89x, 0.83x at 1, 4, 16, 64, 256 MB, streamed
# 2.08x, 1.28x, 1.17x, 1.10x, 1.03x (the bulk path's pulls: 0.98x and 1.00x at 64 and 256 MB);
# reduce_scatter's one-shot kernel and the streamed one even up to 16 MB, the streamed one
# 14-16% faster at 64 and 256 MB; all_reduce one-shot 0.4-0.9x from 4 MB, streamed (two-shot)
# 1.0-1.3x from 1 MB (up to 8 MB the two-shot kernel, TWOSHOT_FROM_BYTES, is faster still); even all_to_all_single (no split sizes) streamed 1.08x-1.53x in CUDA graphs
# at 8 KB to 64 MB, one-shot 0.27x-0.57x. Since the one-shot kernel moves every rank's share at
# once (collectives_NVIDIA_H200-x4-oneshot-tiles.json) it serves 1 MB all_gathers and
# all_reduces (19.0 and 18.1 us in CUDA graphs, streamed 21.2 and 20.4 us), and matches the
# streamed kernel on even all-to-alls from 8 KB to 4 MB; spread over every program
# (ONESHOT_MIN_TILE_BYTES) it beats it on those from 256 KB to 1 MB (5.7-8.0 against 7.3-8.2 us
# in CUDA graphs; smaller ones go to the low-latency kernel). Between one-shot's limit
# (GPU_SIZE_LIMITS) and these sizes, NCCL serves.
# All-to-alls with split sizes ("all_to_all_v") take one kernel whatever their sizes (ranks'
# sizes differ, so no size test agrees across ranks): on GPUs the streamed one, 0 bytes up.
STREAMED_FROM_BYTES = {
    "cpu": {"all_gather": None, "reduce_scatter": None, "all_reduce": None, "all_to_all": None,
            "all_to_all_v": None},
    "cuda": {"all_gather": (1 << 20) + 1, "reduce_scatter": 64 << 20, "all_reduce": (8 << 20) + 1,
             "all_to_all": (1 << 20) + 1, "all_to_all_v": 0},
}
# Messages (bytes per rank) from which all_reduce takes the two-shot kernel (triton_kernels/
# twoshot.py; None: never), below the streamed kernel's sizes. On 4 H200s, bf16, in CUDA graphs
# (benchmarks/results/all_reduce_two_shot_NVIDIA_H200-x4.log), one-shot or streamed -> two-shot
# per call: 640 KB 10.9 -> 11.1 us, 768 KB 12.0 -> 11.7, 1 MB 14.3 -> 12.9, 3 MB 23.9 -> 22.6,
# 4 MB 28.2 -> 27.3, 8 MB 46.9 -> 45.2, 16 MB 80.5 -> 81.5: so it serves 768 KB to 8 MB.
# TDIST_ALGORITHM=twoshot serves every all_reduce with it (the other ops one-shot).
TWOSHOT_FROM_BYTES = {"cpu": {"all_reduce": None}, "cuda": {"all_reduce": 768 << 10}}
# Set in the op byte of a two-shot launch's call word: it shares the one-shot kernel's flags and
# mailboxes but lays shares out otherwise, so a peer that served the same call one-shot (another
# TDIST_ALGORITHM) must see a different call, not sum half-written slots.
TWOSHOT_CALL_BIT = 1 << 7
_FROM_BYTES = {"bulk": BULK_FROM_BYTES, "streamed": STREAMED_FROM_BYTES, "twoshot": TWOSHOT_FROM_BYTES}
# The low-latency kernel (triton_kernels/lowlatency.py) serves messages up to these bytes per
# rank pair (all_gather and all_reduce: the input, all-to-all: a share) whose shares are whole
# 4-byte words. On 4 H200s, bf16, 100 calls in a CUDA graph (a throwaway probe), one-shot
# (even all-to-all: streamed) -> low-latency per call: all_gather 8 and 64 KB 5.9 -> 4.3 and 7.2 -> 5.2 us,
# all_reduce 6.1 -> 5.0 and 7.3 -> 5.5 us, all-to-all 8 and 64 KB (2 and 16 KB a share) 6.9 ->
# 4.2 and 8.9 -> 4.5 us; reduce_scatter was slower (8 KB input: 5.4 -> 7.0 us), so it stays
# one-shot. TDIST_ALGORITHM=lowlatency serves every call that fits a slot with it (the others
# one-shot). A slot (per sender and parity) holds up to LOWLATENCY_SLOT_WORDS words, at most a
# 16th of the heap in all; a program moves LOWLATENCY_BLOCK words of every share.
LOWLATENCY_UP_TO_BYTES = {
    "cpu": {},
    "cuda": {"all_gather": 64 << 10, "all_reduce": 64 << 10, "all_to_all": 16 << 10},
}
# (the interpreter: one program, whose tl.reduce calls its combine function per element, so a
# block of 4096 words took a 4-rank test 3 minutes)
LOWLATENCY_SLOT_WORDS = 512 if language.INTERPRET else 16384
LOWLATENCY_BLOCK = 512 if language.INTERPRET else 256
_LOWLATENCY_REDUCES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                       torch.int32: tl.int32}
# The flag-free two-shot kernel (triton_kernels/sentinel.py) serves float16, bfloat16 and float32
# all_reduces up to these bytes per rank (and only where every rank's share has elements, and a
# share fits SENTINEL_SHARE_BYTES); TDIST_ALGORITHM=sentinel serves every all_reduce it can with it
# (the other calls one-shot). On GPUs a program moves one block of a share, SENTINEL_BLOCK_BYTES
# (least, most), and a launch has at most SENTINEL_PROGRAMS. Experimental on GPUs (a warning says
# so): calls stall until the group's timeout at times (4 H200s: a few of the calls with a rank
# 0.5 s late; 4 H100s: most calls) (README, "flag-free two-shot"; benchmarks/results/sentinel_*.log).
SENTINEL_UP_TO_BYTES = {"cpu": 0, "cuda": 0}
SENTINEL_BLOCK_BYTES = (1024, 1024) if language.INTERPRET else (2048, 8192)
SENTINEL_PROGRAMS = 1 if language.INTERPRET else int(os.environ.get("TDIST_SENTINEL_PROGRAMS", "128"))
SENTINEL_SHARE_BYTES = 64 << 10 if language.INTERPRET else SENTINEL_PROGRAMS * SENTINEL_BLOCK_BYTES[1]
_SENTINEL_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
# (every launch of these kernels counts its epoch in a slot per program)
assert max(ONESHOT_PROGRAMS, LOWLATENCY_SLOT_WORDS // LOWLATENCY_BLOCK) <= oneshot.EPOCH_SLOTS.value
ALGORITHMS = ("auto", "oneshot", "bulk", "streamed", "twoshot", "lowlatency", "sentinel")
# How torch_tdist.ops run: "sequential" (the collective, then torch.matmul), "pipelined" (copy
# engines and torch.matmul chunk by chunk), "fused" (the overlapping
# kernels of triton_kernels/overlap.py, first tile config), "tune" (on a shape's first call the
# group times the sequential path and every way of the other two, and keeps the fastest),
# "auto": tune on GPUs, sequential on the CPU (the interpreter's kernels are slow).
OVERLAPS = ("auto", "fused", "pipelined", "sequential", "tune")
# A replayed launch's pointer parameter (kind, value): kind LAUNCH_ROLE_PTR + r is the call's
# tensor r plus value bytes, kind 0 the address value (csrc/device_path.hpp, LaunchPlan::Kind).
LAUNCH_ROLE_PTR = 2

# What a rank writes into its header, so that peers can tell a mismatched call from data
# (variants of one collective, like all_gather and all_gather_into_tensor, share a code).
_CALL_CODE = {"all_gather_into_tensor": 1, "all_gather": 1, "reduce_scatter_tensor": 2,
              "reduce_scatter": 2, "all_reduce": 3, "reduce": 4, "all_to_all_single": 5,
              "all_to_all": 5, "broadcast": 6, "scatter": 7, "gather": 8, "barrier": 9,
              "all_gather_matmul": 10, "matmul_reduce_scatter": 11}
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(
    (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
     torch.int8, torch.uint8), start=1)}
NO_COUNT = staged.NO_COUNT.value

_ACCUMULATOR = {
    torch.float16: tl.float32,
    torch.bfloat16: tl.float32,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().view(-1)
    return t.view(torch.uint8) if t.dtype == torch.bool else t


class _Output:
    """A flat contiguous buffer to write an op's result into, copied out at the end."""

    def __init__(self, targets: list[torch.Tensor]):
        self.targets = targets
        if len(targets) == 1 and targets[0].is_contiguous():
            self.flat = _flat(targets[0])
        else:
            total = sum(t.numel() for t in targets)
            self.flat = _flat(torch.empty(total, dtype=targets[0].dtype, device=targets[0].device))

    def finish(self):
        if len(self.targets) == 1 and self.targets[0].is_contiguous():
            return
        start = 0
        for t in self.targets:
            chunk = self.flat[start:start + t.numel()]
            t.copy_(chunk.view(t.dtype if t.dtype != torch.bool else torch.uint8).view(t.shape))
            start += t.numel()


class Executor:
    """Runs one process group's collectives on its symmetric heap (created on first use)."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta, options=None):
        # TDIST_GPU_KERNELS=0 sends every CUDA tensor to NCCL (counted as fallback).
        gpu_kernels = os.environ.get("TDIST_GPU_KERNELS", "1") != "0"
        self.served_devices = ["cpu"] if language.INTERPRET else ["cuda"] if gpu_kernels else []
        self.transport, self.heap_bytes = heap_options(options)
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self._lanes = triton.next_power_of_2(world_size)  # kernels signal every rank at once, a lane each
        self.group_name = "?"  # set by the C++ backend once torch names the group
        self._heap = None
        self._heaps_made = 0
        self._views = {}
        self._tables = {}
        self._captured_tables = {}  # values -> (pinned values or None, device table): tables CUDA graphs use
        self._stopped = None  # why this group can serve no more collectives
        # The group's abort word, a page of its own (a GPU can map it): the C++ backend sets it
        # (ProcessGroupTDist.abort()), waits give up and calls refuse once it is set.
        self._abort_page = mmap.mmap(-1, mmap.PAGESIZE)
        self._abort_word = ctypes.c_int64.from_buffer(self._abort_page)
        self.abort_word_address = ctypes.addressof(self._abort_word)
        # the rest of the page (language.PAGE_REGIONS), for the C++ watchdog: (word of the first
        # region, regions, word of the first stuck record, records)
        self.abort_page_layout = (language.PAGE_REGIONS.value, language.MAX_REGIONS.value,
                                  language.PAGE_STUCK.value, language.STUCK_RECORDS.value)
        self._launched = []  # (kernel, compiled, grid, args, meta) of the call being served
        self._replayable = True  # whether the call is only what _launched holds
        self._planned = []  # tensors that launch plans point to
        self._check_calls = language.INTERPRET or os.environ.get("TDIST_CHECK_CALLS") == "1"
        self.algorithm = os.environ.get("TDIST_ALGORITHM", "auto").lower()
        self._sentinel_warned = False
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"tdist: TDIST_ALGORITHM={self.algorithm!r}; expected one of "
                             f"{', '.join(ALGORITHMS)}")
        self.bulk_pusher = os.environ.get("TDIST_BULK_PUSH", "").lower() or None  # None: the device's default
        if self.bulk_pusher not in (None, *PUSHERS):
            raise ValueError(f"tdist: TDIST_BULK_PUSH={self.bulk_pusher!r}; expected one of "
                             f"{', '.join(PUSHERS)}")
        steps = os.environ.get("TDIST_STREAMED_STEP_BLOCKS", str(STREAMED_STEP_BLOCKS))
        if not steps.isdigit() or int(steps) < 1:  # ranks must agree on it too (they wait per step)
            raise ValueError(f"tdist: TDIST_STREAMED_STEP_BLOCKS={steps!r}; expected a whole number from 1")
        self.streamed_step_blocks = int(steps)
        least = os.environ.get("TDIST_STREAMED_MIN_BLOCK_BYTES", str(STREAMED_MIN_BLOCK_BYTES))
        if not least.isdigit() or not 16 <= int(least) <= STREAMED_BLOCK_BYTES or int(least) & (int(least) - 1):
            raise ValueError(f"tdist: TDIST_STREAMED_MIN_BLOCK_BYTES={least!r}; expected a power of two "
                             f"from 16 to {STREAMED_BLOCK_BYTES}")
        self.streamed_min_block_bytes = int(least)  # ranks must agree on it (blocks are cut alike)
        self.overlap = os.environ.get("TDIST_OVERLAP", "auto").lower()
        if self.overlap not in OVERLAPS:
            raise ValueError(f"tdist: TDIST_OVERLAP={self.overlap!r}; expected one of {', '.join(OVERLAPS)}")
        limited = os.environ.get("TDIST_GPU_SIZE_LIMITS", "1") != "0" and self.algorithm == "auto"
        # op -> (most bytes the one-shot kernels serve, bytes from which the bulk path does)
        self.gpu_size_limits = {op: (limit, _served_from(_FAMILY.get(op)))
                                for op, limit in GPU_SIZE_LIMITS.items()} if limited else {}
        uneven = os.environ.get("TDIST_UNEVEN_ALL_TO_ALL", "1")
        if uneven not in ("0", "1"):  # (every rank must choose the same)
            raise ValueError(f"tdist: TDIST_UNEVEN_ALL_TO_ALL={uneven!r}; expected 0 or 1")
        self.gpu_uneven_all_to_all = uneven == "1" or not limited
        handling = os.environ.get("TDIST_ASYNC_ERROR_HANDLING", "1")
        if handling not in ("0", "1"):
            raise ValueError(f"tdist: TDIST_ASYNC_ERROR_HANDLING={handling!r}; expected 0 or 1")
        # read by the C++ backend: a GPU call past the timeout takes the process down (README)
        self.tear_down_on_timeout = handling == "1"

    @property
    def mailbox_bytes(self) -> int:
        """Bytes of a mailbox slot: what one rank may send another in one turn."""
        return self._slot_bytes

    def _turns_ring(self, dtype: torch.dtype) -> int | None:
        """Blocks of each program's ring in a mailbox slot where streamed_all_to_all_v_kernel
        moves shares larger than a slot in turns (it needs room for two steps); None where it
        takes none (the one-shot kernel serves, or the heap is too small)."""
        if not self._takes("streamed", "all_to_all_v", 0) or self._slot_bytes < _turns_slot_bytes(dtype):
            return None
        return self._slot_bytes // dtype.itemsize // (ONESHOT_PROGRAMS * _uneven_block(dtype))

    def uneven_share_limit(self, tensor: torch.Tensor) -> int:
        """The most elements an all-to-all with split sizes of ``tensor``'s dtype may send one rank:
        any number where larger shares go in turns, else a slot's worth."""
        dtype = tensor.dtype
        return NO_SHARE_LIMIT if self._turns_ring(dtype) else self._slot_bytes // dtype.itemsize

    # ---- state -------------------------------------------------------------------------
    def _ensure_heap(self, device: torch.device, op: str):
        if self._heap is not None:
            if device != self._heap.device:
                raise ValueError(
                    f"tdist {op}: tensors are on {device}, but this group's symmetric heap is on "
                    f"{self._heap.device} (one device per rank and group)")
            return
        nbytes = self.heap_bytes or DEFAULT_HEAP_BYTES[device.type]
        # each heap its own store keys: a peer could still read the handles of one that failed
        self._heaps_made += 1
        heap = SymmetricHeap(self.store, self.rank, self.world_size, nbytes, self.timeout, device=device,
                             transport=self.transport, key=f"tdist_heap_{self._heaps_made}",
                             abort_address=self.abort_word_address)
        try:
            self._lay_out(heap, nbytes)
        except BaseException:  # (a heap too small for the group's own buffers)
            heap.close()
            raise
        self._heap = heap
        self._publish_signal_regions()

    def _lay_out(self, heap: SymmetricHeap, nbytes: int):
        """Allocate the group's own buffers on a new heap."""
        world = self.world_size
        self._signals = heap.empty(staged.signal_slots(world), torch.int64)
        self._header = heap.empty(staged.HEADER_FIXED.value, torch.int64)
        self._flags = heap.empty(oneshot.flag_slots(world, ONESHOT_PROGRAMS), torch.int64)
        self._words = heap.empty(oneshot.word_slots(world, ONESHOT_PROGRAMS), torch.int64)
        self._counter = heap.empty(oneshot.COUNTER_SLOTS, torch.int64)
        self._call_status = self._counter[oneshot.STATUS_SLOT.value:oneshot.STATUS_SLOT.value + 1]
        self._streamed_flags = heap.empty(oneshot.flag_slots(world, ONESHOT_PROGRAMS), torch.int64)
        self._streamed_acks = heap.empty(oneshot.flag_slots(world, ONESHOT_PROGRAMS), torch.int64)
        self._gathered_flags = heap.empty(oneshot.flag_slots(world, ONESHOT_PROGRAMS), torch.int64)
        self._lowlatency_words = max(4, min(LOWLATENCY_SLOT_WORDS, nbytes // 16 // (16 * world) // 4 * 4))
        self._lines = heap.empty(2 * world * self._lowlatency_words, torch.int64)
        # sentinel.py's mail: per peer an inbox and an outbox of two shares each, then its lines
        # (none on heaps too small for a share of 256 bytes: that kernel serves no call there)
        self._sentinel_share = min(SENTINEL_SHARE_BYTES, nbytes // 128 // world) // 256 * 256
        self._sentinel_peer = 4 * self._sentinel_share + 8 * 2 * ONESHOT_PROGRAMS if self._sentinel_share else 0
        self._mail = heap.empty(world * self._sentinel_peer // 8, torch.int64)
        self._tree_signals = heap.empty(world, torch.int64)
        self._tree_epoch = 0
        # A quarter each: the mailboxes (two slots per peer), the bulk path's area, staging,
        # and users' own symmetric buffers (torch_tdist.get_heap(group).empty(...)).
        self._slot_bytes = nbytes // 8 // world // 256 * 256
        self._box_offset = heap.alloc(2 * world * self._slot_bytes)
        bulk_bytes = nbytes // 4 // 256 * 256
        self._bulk = BulkPath(heap, heap.alloc(bulk_bytes), bulk_bytes, self._launch,
                              lambda dtype: _ACCUMULATOR.get(dtype, tl.float32), self.bulk_pusher)
        self._stage_bytes = nbytes // 4
        self._stage_offset = heap.alloc(self._stage_bytes)
        self._empty_header = torch.zeros(1, dtype=torch.int64, device=heap.device)

    def _default_device(self) -> torch.device:
        if self._heap is not None:
            return self._heap.device
        if self.served_devices == ["cuda"]:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def heap(self) -> SymmetricHeap:
        self._ensure_heap(self._default_device(), "get_heap")
        return self._heap

    def _stage(self, dtype: torch.dtype, numel: int, op: str) -> torch.Tensor:
        if numel * dtype.itemsize > self._stage_bytes:
            raise ValueError(
                f"tdist {op}: {numel * dtype.itemsize} bytes to stage but the symmetric heap "
                f"holds {self._stage_bytes}; raise TDIST_HEAP_SIZE (or the backend option 'heap_size')")
        return self._view(self._stage_offset, self._stage_bytes, dtype)

    def _box(self, dtype: torch.dtype) -> torch.Tensor:
        return self._view(self._box_offset, 2 * self.world_size * self._slot_bytes, dtype)

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat ``dtype`` view of heap bytes; cached, since every call asks for one."""
        view = self._views.get((offset, dtype))
        if view is None:
            view = self._heap.view(offset, (nbytes // dtype.itemsize,), dtype)
            self._views[(offset, dtype)] = view
        return view

    def _table(self, values, device) -> torch.Tensor:
        """An int64 table (segments, a header) on the device; cached, so a repeated op costs no copy."""
        key = tuple(values)
        table = self._tables.get(key)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing:
            kept = self._captured_tables.get(key)
            if kept is None:
                if table is not None:  # written already; the cache may drop it before a graph's last replay
                    kept = (None, table)
                else:  # written by a copy each graph makes at each replay (a blocking one may not be captured)
                    kept = (torch.tensor(values, dtype=torch.int64).pin_memory(),
                            torch.empty(len(values), dtype=torch.int64, device=device))
                self._captured_tables[key] = kept  # as long as the group; graphs share it (same values)
            host, table = kept
            if host is not None:
                table.copy_(host, non_blocking=True)
        elif table is None:
            if len(self._tables) >= 256:
                self._tables.clear()
            table = torch.tensor(values, dtype=torch.int64, device=device)
            self._tables[key] = table
        if table.is_cuda:  # calls on other streams may use it: not freed before their work is done
            table.record_stream(torch.cuda.current_stream(device))
        return table

    def _begin(self, op: str, tensor: torch.Tensor | None):
        if self._abort_word.value:
            raise RuntimeError(f"tdist {op}: this group was aborted; destroy it and create a new one")
        if self._stopped:
            raise RuntimeError(f"tdist {op}: this group stopped after {self._stopped}; destroy it "
                               f"and create a new one")
        device = self._default_device() if tensor is None else _canonical(tensor.device)
        self._ensure_heap(device, op)
        self._launched = []
        self._replayable = True

    # ---- the two phases ----------------------------------------------------------------
    def _publish(self, op: str, src: torch.Tensor, count: int):
        """Stage ``src``; ``count`` goes into the header for peers to compare with their own."""
        stage = self._stage(src.dtype, src.numel(), op)
        self._launch(op, staged.publish_kernel, (_programs(src.numel()),),
                     self._heap.ctx, src, stage, src.numel(), self._empty_header, self._header,
                     0, self._signals,
                     _CALL_CODE[op], _DTYPE_CODE[src.dtype], count, WORLD=self.world_size, BLOCK=BLOCK)

    def _rounds(self, numel: int, dtype: torch.dtype, parts: int = 1) -> list[tuple[int, int]]:
        """(start, length) pieces of ``numel`` elements per part such that ``parts`` pieces fit
        the staging area together: messages larger than the heap go in several rounds."""
        capacity = self._stage_bytes // dtype.itemsize // parts
        if capacity == 0:
            raise ValueError(f"tdist: the symmetric heap is too small to stage {parts} elements of "
                             f"{dtype}; raise TDIST_HEAP_SIZE (or the backend option 'heap_size')")
        return [(s, min(capacity, numel - s)) for s in range(0, numel, capacity)] or [(0, 0)]

    def _pull_copy(self, op: str, out: torch.Tensor, segments, count: int):
        """``count``: how many elements each peer read from must have published."""
        segments = list(segments) or [(self.rank, 0, 0, 0)]  # still signals done
        segs = self._table(segments, out.device)
        stage = self._stage(out.dtype, 0, op)
        longest = max(s[3] for s in segments)
        grid = (_programs(longest, per=len(segments)), len(segments))
        aligned = _aligned(out.dtype, [v for s in segments for v in s[1:]])
        self._launch(op, staged.pull_copy_kernel, grid,
                     self._heap.ctx, stage, self._header, out, segs, self._signals,
                     _CALL_CODE[op], _DTYPE_CODE[out.dtype], count,
                     WORLD=self.world_size, BLOCK=BLOCK,
                     ALIGN=_vector(out.dtype) if aligned else 1)
        self._check_status(op, out.dtype, count)

    def _pull_reduce(self, op: str, out: torch.Tensor, src_offset: int, n: int, reduce_op: str,
                     count: int):
        stage = self._stage(out.dtype, 0, op)
        self._launch(op, staged.pull_reduce_kernel, (_programs(n),),
                     self._heap.ctx, stage, self._header, out, src_offset, n, self._signals,
                     _CALL_CODE[op], _DTYPE_CODE[out.dtype], count,
                     WORLD=self.world_size, BLOCK=BLOCK, OP=reduce_op, ACC=_ACCUMULATOR[out.dtype])
        self._check_status(op, out.dtype, count)

    def _oneshot_grid(self, dtype: torch.dtype, n: int | None) -> tuple[int, int]:
        """(elements per tile, programs) of a one-shot or two-shot launch that moves ``n``
        elements per rank pair: on GPUs tiles of ONESHOT_TILE_BYTES in all, or spread over every
        program in tiles down to ONESHOT_MIN_TILE_BYTES (whole 16-byte accesses). None: every
        program, full tiles."""
        block = BLOCK if language.INTERPRET else max(ONESHOT_TILE_BYTES // dtype.itemsize // self._lanes, 16)
        if n is None:
            return block, ONESHOT_PROGRAMS
        if not language.INTERPRET:
            smallest = max(ONESHOT_MIN_TILE_BYTES // dtype.itemsize // self._lanes, 16)
            block = max(smallest, min(block, triton.next_power_of_2(-(-n // ONESHOT_PROGRAMS))))
        return block, max(1, min(ONESHOT_PROGRAMS, -(-n // block)))

    def _oneshot(self, op: str, mode: str, src: torch.Tensor, dst: torch.Tensor, n: int,
                 stride: int = 0, reduce_op: str = "sum", root: int = 0, tables=None,
                 offsets=(), rounds_left: int = 1):
        """One launch of ``oneshot_kernel`` (arguments as there); ``offsets``: the element
        offsets the kernel adds to ``src`` or ``dst``, for the alignment it may assume."""
        dtype = dst.dtype
        # (all-to-alls whose counts come in a table: ranks' counts may differ, the grid must not)
        block, programs = self._oneshot_grid(dtype, None if mode == "all_to_all" and n == 0 else n)
        copy = mode in ("all_gather", "broadcast", "all_to_all")
        self._launch(op, oneshot.oneshot_kernel, (programs,),
                     self._heap.ctx, src, dst, self._box(dtype), self._slot_bytes // dtype.itemsize,
                     self._flags, self._words, self._counter, n, stride, root,
                     _call_word(op, dtype, rounds_left),
                     self._empty_header if tables is None else tables,
                     MODE=mode, WORLD=self.world_size, BLOCK=block,
                     ALIGN=_vector(dtype) if _aligned(dtype, offsets) else 1,
                     OP="sum" if copy else reduce_op,
                     ACC=_ACCUMULATOR.get(dtype, tl.float32) if not copy else tl.float32, MAXP=ONESHOT_PROGRAMS,
                     LANES=self._lanes, **SIGNALLING_META)
        self._check_status(op, dtype, n, self._call_status)

    def _twoshot(self, op: str, src: torch.Tensor, dst: torch.Tensor, n: int, reduce_op: str,
                 rounds_left: int):
        """One launch of ``twoshot_all_reduce_kernel``: an all_reduce of ``n`` elements, shared out
        in parts of whole 16-byte accesses, each part's blocks spread as one-shot reduce_scatter's
        (``_oneshot_grid``)."""
        dtype, vector = dst.dtype, _vector(dst.dtype)
        part = -(-n // self.world_size // vector) * vector
        block, programs = self._oneshot_grid(dtype, part)
        self._launch(op, twoshot.twoshot_all_reduce_kernel, (programs,),
                     self._heap.ctx, src, dst, self._box(dtype), self._slot_bytes // dtype.itemsize,
                     self._flags, self._gathered_flags, self._words, self._counter, n, part,
                     _call_word(op, dtype, rounds_left) | TWOSHOT_CALL_BIT,
                     WORLD=self.world_size, BLOCK=block, ALIGN=vector, OP=reduce_op,
                     ACC=_ACCUMULATOR.get(dtype, tl.float32), MAXP=ONESHOT_PROGRAMS, LANES=self._lanes,
                     **SIGNALLING_META)
        self._check_status(op, dtype, n, self._call_status)

    def _streamed(self, op: str, mode: str, src: torch.Tensor, dst: torch.Tensor, n: int,
                  stride: int = 0, reduce_op: str = "sum", rounds_left: int = 1):
        """One launch of ``streamed_kernel`` (arguments as there): all_gather ``n`` input
        elements, ranks' parts ``stride`` apart in ``dst``; reduce_scatter ``n`` output elements,
        ranks' parts ``stride`` apart in ``src``; all_to_all ``n`` per rank pair, ``stride``
        apart in both; all_reduce ``n`` elements, shared out in parts
        of whole 16-byte accesses."""
        dtype = dst.dtype
        reducing = mode in ("reduce_scatter", "all_reduce")
        part = -(-n // self.world_size)
        part = -(-part // _vector(dtype)) * _vector(dtype) if mode == "all_reduce" else 0
        longest = part if mode == "all_reduce" else n
        block = _streamed_block(dtype, longest, self.streamed_min_block_bytes)
        programs = max(1, min(ONESHOT_PROGRAMS, -(-longest // block)))
        self._launch(op, streamed.streamed_kernel, (programs,),
                     self._heap.ctx, src, dst, self._box(dtype), self._slot_bytes // dtype.itemsize,
                     self._streamed_flags, self._words, self._counter, n, stride, part,
                     _call_word(op, dtype, rounds_left),
                     MODE=mode, WORLD=self.world_size, BLOCK=block, STEP=self.streamed_step_blocks,
                     ALIGN=_vector(dtype) if _aligned(dtype, (stride, part)) else 1,
                     OP=reduce_op if reducing else "sum",
                     ACC=_ACCUMULATOR.get(dtype, tl.float32) if reducing else tl.float32,
                     MAXP=ONESHOT_PROGRAMS, LANES=self._lanes, **SIGNALLING_META)
        self._check_status(op, dtype, n, self._call_status)

    def _streamed_v(self, op: str, src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, offsets):
        """One launch of ``streamed_all_to_all_v_kernel``: the rank pairs' offsets and counts
        (``offsets``, elements) in ``table``; the same grid on every rank."""
        dtype = dst.dtype
        self._launch(op, streamed.streamed_all_to_all_v_kernel, (ONESHOT_PROGRAMS,),
                     self._heap.ctx, src, dst, self._box(dtype), self._slot_bytes // dtype.itemsize,
                     self._turns_ring(dtype) or NO_TURNS,
                     self._streamed_flags, self._streamed_acks, self._words, self._counter,
                     _call_word(op, dtype, SPLIT_SIZES_ROUNDS), table,
                     WORLD=self.world_size, BLOCK=_uneven_block(dtype),
                     STEP=UNEVEN_STEP_BLOCKS, ALIGN=_vector(dtype) if _aligned(dtype, offsets) else 1,
                     MAXP=ONESHOT_PROGRAMS, LANES=self._lanes, **SIGNALLING_META)
        self._check_status(op, dtype, NO_COUNT, self._call_status)

    def _suits_lowlatency(self, mode: str, src: torch.Tensor, dst: torch.Tensor, n: int, stride: int = 0) -> bool:
        """Whether the low-latency kernel serves a call of ``n`` elements per rank pair (see
        ``_lowlatency``)."""
        if self.algorithm not in ("auto", "lowlatency"):
            return False
        dtype, nbytes = src.dtype, n * src.element_size()
        limit = 4 * self._lowlatency_words
        if self.algorithm == "auto":
            limit = min(limit, LOWLATENCY_UP_TO_BYTES[self._heap.device.type].get(mode, 0))
        reducing = mode in ("all_reduce", "reduce_scatter")
        return (0 < nbytes <= limit
                and nbytes % 4 == 0 and stride * src.element_size() % 4 == 0
                and src.element_size() <= 4 and src.data_ptr() % 4 == 0 and dst.data_ptr() % 4 == 0
                and (not reducing or dtype in _LOWLATENCY_REDUCES))

    def _lowlatency(self, op: str, mode: str, src: torch.Tensor, dst: torch.Tensor, n: int,
                    stride: int = 0, reduce_op: str = "sum"):
        """One launch of ``lowlatency_kernel``: ``n`` elements per rank pair, ranks' parts
        ``stride`` elements apart (as ``_oneshot``'s), moved as 4-byte words."""
        dtype, per_word = src.dtype, 4 // src.element_size()
        words, word_stride = n // per_word, stride // per_word
        block = LOWLATENCY_BLOCK
        copy = mode not in ("all_reduce", "reduce_scatter")
        self._launch(op, lowlatency.lowlatency_kernel, (-(-words // block),),
                     self._heap.ctx, src.view(torch.int32), dst.view(torch.int32), self._lines,
                     self._counter, words, word_stride,
                     _call_word(op, dtype) + (words << oneshot.COUNT_SHIFT.value),
                     MODE=mode, WORLD=self.world_size, SLOT=self._lowlatency_words, BLOCK=block,
                     ALIGN=4 if _aligned(torch.int32, (word_stride,)) else 1,
                     OP="sum" if copy else reduce_op, ACC=_ACCUMULATOR.get(dtype, tl.float32),
                     DTYPE=_LOWLATENCY_REDUCES.get(dtype, tl.int32), PACK=per_word if not copy else 1,
                     LANES=self._lanes, **SIGNALLING_META)

    def _sentinel_part(self, src: torch.Tensor) -> int | None:
        """Elements per rank's share where the sentinel kernel serves an all_reduce of ``src``
        (see ``_sentinel``), else None."""
        if self.algorithm not in ("auto", "sentinel") or src.dtype not in _SENTINEL_BITS:
            return None
        nbytes, n = src.numel() * src.element_size(), src.numel()
        if self.algorithm == "auto" and nbytes > SENTINEL_UP_TO_BYTES[self._heap.device.type]:
            return None
        vector = _vector(src.dtype)
        part = -(-n // self.world_size // vector) * vector
        fits = part * src.element_size() <= self._sentinel_share and n > (self.world_size - 1) * part
        if fits and self._heap.device.type == "cuda" and not self._sentinel_warned:
            self._sentinel_warned = True
            warnings.warn("tdist: TDIST_ALGORITHM=sentinel is experimental on GPUs: on 4 H200s and 4 H100s "
                          "some calls waited until the group's timeout and aborted the group",
                          RuntimeWarning, stacklevel=2)
        return part if fits else None

    def _sentinel(self, op: str, src: torch.Tensor, dst: torch.Tensor, part: int, reduce_op: str):
        """One launch of ``sentinel_all_reduce_kernel``: an all_reduce of ``src`` into ``dst``, rank
        ``d``'s share ``[d * part, (d + 1) * part)``."""
        dtype, ints = src.dtype, _SENTINEL_BITS[src.dtype]
        least, most = SENTINEL_BLOCK_BYTES
        spread = triton.next_power_of_2(-(-part * src.element_size() // SENTINEL_PROGRAMS))
        block_bytes = max(least, min(spread, most))
        block = block_bytes // src.element_size()
        meta = dict(SIGNALLING_META)
        if "num_warps" in meta:  # a 16-byte access per thread per share
            meta["num_warps"] = max(1, min(ONESHOT_WARPS, block_bytes // 512))
        self._launch(op, sentinel.sentinel_all_reduce_kernel, (min(SENTINEL_PROGRAMS, -(-part // block)),),
                     self._heap.ctx, src.view(ints), dst.view(ints), self._mail.view(ints), self._mail,
                     self._counter, src.numel(), part, _call_word(op, dtype) + (src.numel() << oneshot.COUNT_SHIFT.value),
                     WORLD=self.world_size, SHARE=self._sentinel_share // src.element_size(),
                     PEER=self._sentinel_peer // src.element_size(), BLOCK=block, OP=reduce_op,
                     DTYPE=_LOWLATENCY_REDUCES[dtype], ACC=_ACCUMULATOR[dtype], MAXP=ONESHOT_PROGRAMS,
                     LANES=self._lanes, **meta)

    def _bulk_call(self, op: str, method, out: torch.Tensor, src: torch.Tensor, *args):
        """``method(op, call word, out, src, *args)`` of the bulk path. It is copies and stream
        signals besides its launches, so C++ never replays it; one that fails after its start
        barrier leaves flags behind on its peers, so the group stops."""
        self._replayable = False
        with self._peer_timeouts(op):
            try:
                method(op, _CALL_CODE[op] | _DTYPE_CODE[src.dtype] << 8, out, src, *args)
            except Exception as err:
                if self._bulk.in_flight:
                    self._bulk.in_flight = False
                    self._stopped = f"{op} failed part-way ({type(err).__name__})"
                raise

    def _takes(self, path: str, family: str, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` of ``family`` takes ``path`` ("bulk", "streamed")."""
        if self.algorithm != "auto":
            return self.algorithm == path
        threshold = _FROM_BYTES[path][self._heap.device.type].get(family)
        return threshold is not None and nbytes >= threshold

    def _slot_rounds(self, numel: int, dtype: torch.dtype, capacity: int | None = None):
        """(start, length, rounds left) of the pieces of ``numel`` elements, ``capacity`` each
        (None: a mailbox slot's). Rounds left go into the call words (_call_word)."""
        capacity = self._slot_bytes // dtype.itemsize if capacity is None else capacity
        starts = range(0, numel, capacity)
        return [(s, min(capacity, numel - s), len(starts) - i) for i, s in enumerate(starts)] or [(0, 0, 1)]

    def _launch(self, op: str, kernel, grid, *args, **meta):
        with self._peer_timeouts(op):
            compiled = kernel[grid](*args, **meta)
            if not language.INTERPRET and self._replayable:
                self._launched.append((kernel, compiled, grid, args, meta))
            return compiled

    @contextlib.contextmanager
    def _peer_timeouts(self, op: str):
        """A peer that never signalled ends this group: peers and this rank now disagree on
        where the group is, so it refuses further work."""
        try:
            yield
        except _GroupStopped:
            raise
        except Exception as err:
            cause = err
            while cause is not None and not isinstance(cause, language.PeerTimeoutError):
                cause = cause.__cause__
            if cause is None:
                raise
            aborted = isinstance(cause, language.GroupAbortedError)
            self._stopped = f"{op} was aborted" if aborted else f"{op} timed out waiting for a peer"
            missing = self._missing_peers(cause)
            arrived = f"rank(s) {', '.join(map(str, missing))} did not arrive; " if missing else ""
            raise _GroupStopped(f"tdist {op} (rank {self.rank} of {self.world_size}, group "
                                f"'{self.group_name}'): {arrived}{cause}") from err

    def _signal_regions(self):
        """(first slot's address, slots per peer, peers) of every signal array the kernels wait
        on, each peer's slots together (the layouts in triton_kernels/)."""
        world = self.world_size
        signals = self._signals.data_ptr()
        yield self._flags.data_ptr(), ONESHOT_PROGRAMS, world
        yield self._streamed_flags.data_ptr(), ONESHOT_PROGRAMS, world
        yield self._streamed_acks.data_ptr(), ONESHOT_PROGRAMS, world
        yield self._gathered_flags.data_ptr(), ONESHOT_PROGRAMS, world
        yield self._lines.data_ptr(), 2 * self._lowlatency_words, world
        yield self._mail.data_ptr(), self._sentinel_peer // 8, world
        yield signals, 1, world
        yield signals + 8 * world, 1, world
        yield self._tree_signals.data_ptr(), 1, world
        yield from self._bulk.signal_regions()

    def _publish_signal_regions(self):
        """Writes ``_signal_regions`` into the abort word's page (language.PAGE_REGIONS)."""
        words = [v for region in self._signal_regions() for v in region]
        first, most = language.PAGE_REGIONS.value, language.MAX_REGIONS.value
        if len(words) > 3 * most:
            raise RuntimeError(f"tdist: {len(words) // 3} signal regions; the abort page holds {most}")
        page = (ctypes.c_int64 * (first + 3 * most)).from_buffer(self._abort_page)
        page[first:first + 3 * most] = words + [0] * (3 * most - len(words))

    def _missing_peers(self, timeout: language.PeerTimeoutError) -> list[int]:
        """The peers whose slot, in the signal array and position a timed-out wait watched, does
        not hold what the wait wanted (CPU heaps: the slots are host memory)."""
        if timeout.address is None or self._heap is None or self._heap.device.type != "cpu":
            return []
        for first, stride, peers in self._signal_regions():
            index = (timeout.address - first) // 8
            if 0 <= index < stride * peers and (timeout.address - first) % 8 == 0:
                position = index % stride
                return [p for p in range(peers) if p != self.rank and not timeout.satisfied(
                    ctypes.c_int64.from_address(first + 8 * (p * stride + position)).value)]
        return []

    def _plan(self, src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor | None = None):
        """The call's launch as C++ can replay it for the next call of this shape (see
        ``csrc/device_path.hpp``): ``(function, grid, threads, shared bytes, params, dependent
        launch)``, each param ``(kind, value)`` with kind 0/1 a 64/32-bit literal, LAUNCH_ROLE_PTR the input's
        address, LAUNCH_ROLE_PTR + 1 the output's and LAUNCH_ROLE_PTR + 2 the all-to-all ``table``'s
        (C++ writes each call's own). None when the call was not one plain launch on ``src``
        and ``dst``."""
        if language.INTERPRET or self._check_calls or len(self._launched) != 1 or not self._replayable:
            return None
        (kernel, compiled, grid, args, meta), = self._launched
        self._launched = []
        roles = {"src": (src.data_ptr(), LAUNCH_ROLE_PTR), "dst": (dst.data_ptr(), LAUNCH_ROLE_PTR + 1)}
        if table is not None:
            roles["tables"] = (table.data_ptr(), LAUNCH_ROLE_PTR + 2)

        def bind(name, value):
            if name not in roles:
                return 0, value.data_ptr()
            if value.data_ptr() != roles[name][0] or value.data_ptr() % 16:
                return None  # a copy of the caller's tensor, or unaligned
            return roles[name][1], 0
        return self._launch_tuple(kernel, compiled, grid, args, meta, bind)

    def _launch_tuple(self, kernel, compiled, grid, args, meta, bind):
        """A recorded launch as ``LaunchPlan`` takes it: ``(function, grid, threads, shared
        bytes, params, dependent launch)``; ``bind(name, tensor)`` says what a pointer parameter
        holds, ``(kind, value)``, or None when it cannot be replayed (then None: neither can the
        launch). The tensors of literal pointers are kept alive."""
        md = compiled.metadata
        if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "global_scratch_size", 0)
                or getattr(md, "profile_scratch_size", 0) or getattr(md, "launch_cooperative_grid", False)
                or compiled.function is None):
            return None
        bound = dict(zip(kernel.arg_names, args), **meta)
        params, pinned = [], []
        for name, kind in compiled.src.signature.items():
            value = bound[name]
            if kind == "constexpr":
                continue
            if kind.startswith("*"):
                param = bind(name, value)
                if param is None:
                    return None
                params.append(param)
                if param[0] == 0:
                    pinned.append(value)
            elif kind in ("i32", "u32"):
                params.append((1, int(value) & 0xFFFFFFFF))
            elif kind in ("i64", "u64"):
                params.append((0, int(value) & 0xFFFFFFFFFFFFFFFF))
            else:
                return None
        params += [(0, 0), (0, 0)]  # Triton's global and profile scratch pointers: none
        self._planned.extend(pinned)
        return (compiled.function, (grid + (1, 1))[:3], 32 * md.num_warps, md.shared, params,
                bool(getattr(md, "launch_pdl", False)))

    def _check_status(self, op: str, dtype: torch.dtype, count: int, status_slot=None):
        """Raise if a kernel saw a peer whose call differs from ours (on GPUs this reads device
        memory, so it runs only with TDIST_CHECK_CALLS=1)."""
        if not self._check_calls:
            return
        if status_slot is None:
            status_slot = self._signals[2 * self.world_size + 2:2 * self.world_size + 3]
        status = int(status_slot[0])
        if status == staged.STATUS_OK.value:
            return
        status_slot.zero_()
        peer, kind = status // 4 - 1, status % 4
        if kind == staged.STATUS_SIZE_MISMATCH.value:
            raise ValueError(
                f"tdist {op}: rank {peer} sends this rank a different number of elements than this "
                f"rank's output sizes expect (split sizes must agree across ranks)")
        what = f"{count} {str(dtype).replace('torch.', '')} elements" if count != NO_COUNT else str(dtype)
        raise ValueError(
            f"tdist {op}: rank {peer} made a different call than this rank ({op} of {what}): "
            f"another collective, dtype or element count (or another TDIST_ALGORITHM). Every rank of "
            f"a group must make the same calls in the same order with matching tensors")

    # ---- the collectives (names as in torch.distributed) ---------------------------------
    def all_gather_into_tensor(self, output, input):
        self._gather_to_all("all_gather_into_tensor", [output], input)
        return self._plan(input, output)

    def all_gather(self, outputs, input):
        self._gather_to_all("all_gather", list(outputs), input)

    def _gather_to_all(self, op, targets, input):
        self._begin(op, input)
        src = _flat(input)
        out = _Output(targets)
        n = src.numel()
        nbytes = src.numel() * src.element_size()
        if self._suits_lowlatency("all_gather", src, out.flat, n, n):
            self._lowlatency(op, "all_gather", src, out.flat, n, stride=n)
        elif self._takes("bulk", "all_gather", nbytes):
            self._bulk_call(op, self._bulk.all_gather, out.flat, src)
        elif self._takes("streamed", "all_gather", nbytes):
            for start, length, left in self._slot_rounds(n, src.dtype):
                self._streamed(op, "all_gather", src[start:], out.flat[start:], length, stride=n,
                               rounds_left=left)
        else:
            for start, length, left in self._slot_rounds(n, src.dtype):
                self._oneshot(op, "all_gather", src[start:], out.flat[start:], length, stride=n,
                              offsets=(n,), rounds_left=left)
        out.finish()

    def reduce_scatter_tensor(self, output, input, op):
        self._reduce_scatter("reduce_scatter_tensor", output, _flat(input), op)
        return self._plan(input, output)

    def reduce_scatter(self, output, inputs, op):
        self._reduce_scatter("reduce_scatter", output, torch.cat([_flat(t) for t in inputs]), op)

    def _reduce_scatter(self, name, output, src, reduce_op):
        self._begin(name, output)
        out = _Output([output])
        n = output.numel()
        nbytes = src.numel() * src.element_size()
        if self._suits_lowlatency("reduce_scatter", src, out.flat, n, n):
            self._lowlatency(name, "reduce_scatter", src, out.flat, n, stride=n, reduce_op=reduce_op)
        elif self._takes("bulk", "reduce_scatter", nbytes):
            self._bulk_call(name, self._bulk.reduce_scatter, out.flat, src, reduce_op)
        elif self._takes("streamed", "reduce_scatter", nbytes):
            for start, length, left in self._slot_rounds(n, src.dtype):
                self._streamed(name, "reduce_scatter", src[start:], out.flat[start:], length,
                               stride=n, reduce_op=reduce_op, rounds_left=left)
        else:
            for start, length, left in self._slot_rounds(n, src.dtype):
                self._oneshot(name, "reduce_scatter", src[start:], out.flat[start:], length,
                              stride=n, reduce_op=reduce_op, offsets=(n,), rounds_left=left)
        out.finish()

    def all_reduce(self, tensor, op):
        self._reduce("all_reduce", tensor, op, dst=None)
        return self._plan(tensor, tensor)

    def reduce(self, tensor, dst, op):
        self._reduce("reduce", tensor, op, dst=dst)

    def _reduce(self, name, tensor, reduce_op, dst):
        self._begin(name, tensor)
        src = _flat(tensor)
        out = _Output([tensor])
        if dst is None:
            nbytes = src.numel() * src.element_size()
            part = self._sentinel_part(src)
            if part is not None:
                self._sentinel(name, src, out.flat, part, reduce_op)
            elif self._suits_lowlatency("all_reduce", src, out.flat, src.numel()):
                self._lowlatency(name, "all_reduce", src, out.flat, src.numel(), reduce_op=reduce_op)
            elif self._takes("bulk", "all_reduce", nbytes):
                self._bulk_call(name, self._bulk.all_reduce, out.flat, src, reduce_op)
            elif self._takes("streamed", "all_reduce", nbytes):  # a share per rank: half a slot each
                shares = self.world_size * (self._slot_bytes // src.element_size() // 2)
                for start, length, left in self._slot_rounds(src.numel(), src.dtype, shares):
                    self._streamed(name, "all_reduce", src[start:], out.flat[start:], length,
                                   reduce_op=reduce_op, rounds_left=left)
            elif self._takes("twoshot", "all_reduce", nbytes):  # (slots are whole 256 bytes: halves hold whole shares)
                shares = self.world_size * (self._slot_bytes // src.element_size() // 2)
                for start, length, left in self._slot_rounds(src.numel(), src.dtype, shares):
                    self._twoshot(name, src[start:], out.flat[start:], length, reduce_op, left)
            else:
                for start, length, left in self._slot_rounds(src.numel(), src.dtype):
                    self._oneshot(name, "all_reduce", src[start:], out.flat[start:], length,
                                  reduce_op=reduce_op, rounds_left=left)
            out.finish()
            return
        keeps_result = dst == self.rank
        for start, length in self._rounds(src.numel(), src.dtype):
            self._publish(name, src[start:start + length], count=src.numel())
            self._pull_reduce(name, out.flat[start:start + length], 0, length if keeps_result else 0,
                              reduce_op, count=src.numel())
        if keeps_result:
            out.finish()

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes):
        """No split sizes: even splits, called so on every rank (the C++ backend passes none then)."""
        if not output_split_sizes and not input_split_sizes:
            self._exchange_even("all_to_all_single", output, _flat(input))
            return self._plan(input, output)
        rows_in, rows_out = max(input.shape[0], 1), max(output.shape[0], 1)
        row_in = input.numel() // rows_in if input.shape[0] else _row_numel(input)
        row_out = output.numel() // rows_out if output.shape[0] else _row_numel(output)
        table = self._exchange("all_to_all_single", [output], [row_out * s for s in output_split_sizes],
                               _flat(input), [row_in * s for s in input_split_sizes])
        return self._plan(input, output, table)

    def all_to_all(self, outputs, inputs):
        src = torch.cat([_flat(t) for t in inputs])
        self._exchange("all_to_all", list(outputs), [t.numel() for t in outputs],
                       src, [t.numel() for t in inputs])

    def _exchange_even(self, op, output, src):
        """An all-to-all where every rank sends every rank the same count, and every rank knows
        it: the grid may follow the count, and a large message goes in rounds (streamed, or
        one-shot launches of a slot's worth per pair)."""
        self._begin(op, src)
        out = _Output([output])
        n = src.numel() // self.world_size
        if self._suits_lowlatency("all_to_all", src, out.flat, n, n):
            self._lowlatency(op, "all_to_all", src, out.flat, n, stride=n)
            out.finish()
            return
        streams = self._takes("streamed", "all_to_all", src.numel() * src.element_size())
        for start, length, left in self._slot_rounds(n, src.dtype):
            if streams:
                self._streamed(op, "all_to_all", src[start:], out.flat[start:], length, stride=n,
                               rounds_left=left)
                continue
            parts = [d * n for d in range(self.world_size)]
            tables = (parts + [length] * self.world_size) * 2
            self._oneshot(op, "all_to_all", src[start:], out.flat[start:], length,
                          tables=self._table(tables, src.device), offsets=tables, rounds_left=left)
        out.finish()

    def _exchange(self, op, targets, recv_counts, src, send_counts) -> torch.Tensor:
        """An all-to-all of the given counts (elements) through a kernel that reads them from a
        table (the streamed one for split sizes, or the one-shot one); returns the table."""
        self._begin(op, src)
        out = _Output(targets)
        capacity = self.uneven_share_limit(src)
        # A pair too large for its mailbox (where no turns are taken) moves nothing, and both of its
        # ranks raise after the launch: the group's other ranks cannot know, and must not wait for
        # them in vain.
        sent = [0 if c > capacity else c for c in send_counts]
        received = [0 if c > capacity else c for c in recv_counts]
        tables = _offsets(send_counts) + sent + _offsets(recv_counts) + received
        table = self._table(tables, src.device)
        if self._takes("streamed", "all_to_all_v", 0):  # (every rank alike: no size test)
            self._streamed_v(op, src, out.flat, table, offsets=tables)
        else:
            self._oneshot(op, "all_to_all", src, out.flat, 0, tables=table, offsets=tables)
        out.finish()
        if sent != send_counts or received != recv_counts:
            turns = ""
            if self._takes("streamed", "all_to_all_v", 0):
                heap = _turns_slot_bytes(src.dtype) * 8 * self.world_size
                turns = (f", and from {-(-heap // (1 << 20))} MB on larger shares go in "
                         f"turns, whatever their size")
            too_large = {r for r, c in enumerate(send_counts) if c > capacity}
            too_large |= {r for r, c in enumerate(recv_counts) if c > capacity}
            raise ValueError(
                f"tdist {op}: {max(send_counts + recv_counts)} elements between rank {self.rank} and "
                f"rank(s) {', '.join(map(str, sorted(too_large)))}, but a mailbox holds {capacity} "
                f"{str(src.dtype).replace('torch.', '')} elements, so nothing moved between them (the "
                f"other ranks' shares did); raise TDIST_HEAP_SIZE (or the backend option 'heap_size'): "
                f"a mailbox is 1/(8 x world size) of the heap{turns}")
        return table

    def broadcast(self, tensor, src):
        self._begin("broadcast", tensor)
        data = _flat(tensor)
        out = _Output([tensor])
        for start, length, left in self._slot_rounds(data.numel(), data.dtype):
            self._oneshot("broadcast", "broadcast", data[start:], out.flat[start:], length, root=src,
                          rounds_left=left)
        if self.rank != src:
            out.finish()
        return self._plan(tensor, tensor)

    def scatter(self, output, inputs, src):
        self._begin("scatter", output)
        packed = torch.cat([_flat(t) for t in inputs]) if self.rank == src else None
        out = _Output([output])
        n = output.numel()
        for start, length in self._rounds(n, output.dtype, parts=self.world_size):
            if packed is not None:
                self._publish("scatter", _columns(packed, self.world_size, start, length),
                              count=self.world_size * n)
            self._pull_copy("scatter", out.flat, [(src, self.rank * length, start, length)],
                            count=self.world_size * n)
        out.finish()

    def gather(self, outputs, input, dst):
        self._begin("gather", input)
        src = _flat(input)
        n = src.numel()
        out = _Output(list(outputs)) if self.rank == dst else None
        for start, length in self._rounds(n, src.dtype):
            self._publish("gather", src[start:start + length], count=n)
            if out is None:
                self._pull_copy("gather", src, [], count=n)
            else:
                self._pull_copy("gather", out.flat,
                                [(p, 0, p * n + start, length) for p in range(self.world_size)], count=n)
        if out is not None:
            out.finish()

    # ---- interface for torch_tdist.overlap ----
    # What the overlap ops (torch_tdist/overlap/) use of a group's executor besides rank,
    # world_size, overlap and heap; they read nothing else of it.
    def attached(self, key: str, make):
        """The object ``make(self)`` made for this group under ``key`` on the first call and kept
        with the group (the overlap ops' state); each one's ``close()`` runs when the group
        closes, before its heap goes."""
        attached = self.__dict__.setdefault("_attached", {})
        found = attached.get(key)
        if found is None:
            found = attached[key] = make(self)
        return found

    def close_attached(self):
        """Close what ``attached`` made (from ``close``, while the heap is still there)."""
        for found in self.__dict__.get("_attached", {}).values():
            found.close()

    def begin_call(self, op: str, tensor: torch.Tensor):
        """Start serving ``op`` on ``tensor``'s device, as every collective starts: raises once
        the group was aborted or stopped, makes the heap on first use."""
        self._begin(op, tensor)

    @property
    def bulk(self) -> BulkPath:
        """The group's bulk path (made with the heap: after ``begin_call``)."""
        return self._bulk

    def bulk_call(self, op: str, method, out: torch.Tensor, src: torch.Tensor, *args):
        """``method(op, call word, out, src, *args)`` of the bulk path, as the collectives call it
        (``_bulk_call``: a peer that never signals, or a failure part-way, stops the group)."""
        self._bulk_call(op, method, out, src, *args)

    def launch(self, op: str, kernel, grid, *args, **meta):
        """Launch ``kernel`` for ``op`` as the collectives do (``_launch``)."""
        return self._launch(op, kernel, grid, *args, **meta)

    def replayable_launch(self, kernel, compiled, grid, args, meta, bind):
        """A recorded launch as C++ replays it (``_launch_tuple``), or None."""
        return self._launch_tuple(kernel, compiled, grid, args, meta, bind)

    @property
    def checks_calls(self) -> bool:
        """Whether calls are checked against the peers' (TDIST_CHECK_CALLS=1, the interpreter)."""
        return self._check_calls

    def run_unplanned(self, op: str, run):
        """``run()``: work of ``op`` that is not one launch C++ could replay as the call's plan (a
        recorded stream program); where it raises, the group stops (peers may be left part-way)."""
        self._replayable = False
        try:
            return run()
        except Exception as err:
            self._stopped = f"{op} failed part-way ({type(err).__name__})"
            raise
    # ---- end of the interface for torch_tdist.overlap ----

    def hierarchical_all_gather(self, output, input, ranks_per_node: int):
        """all_gather_into_tensor as between nodes of ``ranks_per_node`` ranks: NVSHMEM puts
        between nodes, P2P stores inside (triton_kernels/hierarchical.py). Runs on the
        caller's stream."""
        op = "hierarchical_all_gather"
        world = self.world_size
        if ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"tdist {op}: ranks_per_node={ranks_per_node} does not divide the "
                             f"group's {world} ranks")
        if output.dtype != input.dtype or output.numel() != world * input.numel():
            raise ValueError(f"tdist {op}: output must hold {world} x {input.numel()} elements of "
                             f"{input.dtype}; got {output.numel()} of {output.dtype}")
        self._begin(op, input)
        if self._heap.device.type == "cuda" and self._heap.transport != "nvshmem":
            raise ValueError(f"tdist {op}: its puts between nodes are NVSHMEM calls; create the "
                             f"group with TDIST_TRANSPORT=nvshmem (this one uses {self._heap.transport})")
        src = _flat(input)
        n = src.numel()
        gathered = self._stage(src.dtype, world * n, op)[:world * n]
        self.barrier()  # every peer is done with the staging area this call writes into
        self._tree_epoch += 1
        meta = {} if language.INTERPRET else {"num_warps": ONESHOT_WARPS}
        self._launch(op, hierarchical.hierarchical_all_gather_kernel, (1,), self._heap.ctx, src, gathered,
                     self._tree_signals, n, self._tree_epoch, RANKS_PER_NODE=ranks_per_node,
                     BLOCK=BLOCK, **meta)
        output.copy_(gathered.view(output.shape))
        self.barrier()  # no peer writes the next call's chunks here before the copy above

    def barrier(self):
        self._begin("barrier", None)
        nothing = torch.empty(0, dtype=torch.uint8, device=self._heap.device)
        self._oneshot("barrier", "all_reduce", nothing, nothing, 0)

    def close(self):
        if self._heap is not None:
            self.close_attached()  # (interface for torch_tdist.overlap)
            self._views.clear()
            self._planned.clear()
            self._tables.clear()
            self._heap.close()
            self._heap = None


class _GroupStopped(TimeoutError):
    """A collective timed out waiting for a peer; the group serves no more calls."""


# the rounds left in the call words of streamed_all_to_all_v_kernel (even calls count down to 1):
# an even all-to-all on another rank, whose streamed kernel shares the flags and words but lays
# blocks out otherwise, then differs at once instead of delivering the wrong blocks
SPLIT_SIZES_ROUNDS = 0


def _call_word(op: str, dtype: torch.dtype, rounds_left: int = 1) -> int:
    """What a one-shot or streamed launch writes beside its data for its peers to compare (the
    kernel adds its element count at bit 16): the op, the dtype, and the rounds of the call left
    (at bit 48), so ranks whose calls take different numbers of rounds differ at the first one."""
    return _CALL_CODE[op] | _DTYPE_CODE[dtype] << 8 | (rounds_left & 0x7FFF) << 48


def _served_from(family: str | None) -> int | None:
    """GPU bytes from which a larger message of ``family`` is served again (by the streamed
    kernel or the bulk path), past GPU_SIZE_LIMITS; None: never."""
    starts = [table["cuda"].get(family) for table in _FROM_BYTES.values()]
    starts = [v for v in starts if v is not None]
    return min(starts) if starts else None


def _programs(numel: int, per: int = 1) -> int:
    """Programs for a launch that moves ``numel`` elements (``per``: launches share the budget)."""
    return max(1, min(-(-numel // BLOCK), MAX_PROGRAMS // per))


def _canonical(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _columns(src: torch.Tensor, parts: int, start: int, length: int) -> torch.Tensor:
    """Elements [start, start + length) of each of the ``parts`` equal parts of flat ``src``."""
    if length * parts == src.numel():
        return src
    return src.view(parts, -1)[:, start:start + length].reshape(-1)


def _offsets(counts):
    offsets, total = [], 0
    for c in counts:
        offsets.append(total)
        total += c
    return offsets


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n
