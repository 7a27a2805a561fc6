"""Host side of every collective: staging layout, segment lists, launches.

The C++ backend (``torch_tdist._C.ProcessGroupTDist``) validates arguments, counts calls and
hands each served op to an :class:`Executor` method of the same name as torch.distributed's
function. Every op is the publish/pull pair of ``triton_kernels/staged.py``.
"""

import os
from datetime import timedelta

import torch
import triton.language as tl

from . import language
from .heap import SymmetricHeap, heap_options
from .triton_kernels import staged

# Elements one program moves per loop step, and the most programs a launch gets. The
# interpreter runs programs one after another, so there one program with wide steps is fastest.
BLOCK = 8192 if language.INTERPRET else 4096
MAX_PROGRAMS = 1 if language.INTERPRET else 528  # 4 per H200 SM

# What a rank writes into its header, so that peers can tell a mismatched call from data
# (variants of one collective, like all_gather and all_gather_into_tensor, share a code).
_CALL_CODE = {"all_gather_into_tensor": 1, "all_gather": 1, "reduce_scatter_tensor": 2,
              "reduce_scatter": 2, "all_reduce": 3, "reduce": 4, "all_to_all_single": 5,
              "all_to_all": 5, "broadcast": 6, "scatter": 7, "gather": 8, "barrier": 9}
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
        # GPU kernels are correct but not yet faster than NCCL, so CUDA tensors go to NCCL
        # unless TDIST_GPU_KERNELS=1 asks for tdist's kernels (the demo and benchmarks do).
        gpu_kernels = os.environ.get("TDIST_GPU_KERNELS") == "1"
        self.served_devices = ["cpu"] if language.INTERPRET else ["cuda"] if gpu_kernels else []
        self.transport, self.heap_bytes = heap_options(options)
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self._heap = None
        self._stage_views = {}
        self._tables = {}
        self._stopped = None  # why this group can serve no more collectives
        self._check_calls = language.INTERPRET or os.environ.get("TDIST_CHECK_CALLS") == "1"

    # ---- state -------------------------------------------------------------------------
    def _ensure_heap(self, device: torch.device, op: str):
        if self._heap is not None:
            if device != self._heap.device:
                raise ValueError(
                    f"tdist {op}: tensors are on {device}, but this group's symmetric heap is on "
                    f"{self._heap.device} (one device per rank and group)")
            return
        heap = SymmetricHeap(self.store, self.rank, self.world_size, self.heap_bytes, self.timeout,
                             device=device, transport=self.transport)
        world = self.world_size
        self._signals = heap.empty(staged.signal_slots(world), torch.int64)
        self._header = heap.empty(staged.HEADER_FIXED.value + 2 * world, torch.int64)
        # Collectives stage through half of the heap; the other half is for users' own
        # symmetric buffers (torch_tdist.get_heap(group).empty(...)).
        self._stage_bytes = heap.nbytes // 2
        self._stage_offset = heap.alloc(self._stage_bytes)
        self._empty_header = torch.zeros(1, dtype=torch.int64, device=heap.device)
        self._heap = heap

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
        view = self._stage_views.get(dtype)
        if view is None:
            view = self._heap.view(self._stage_offset, (self._stage_bytes // dtype.itemsize,), dtype)
            self._stage_views[dtype] = view
        return view

    def _table(self, values, device) -> torch.Tensor:
        """An int64 table (segments, a header) on the device; cached, so a repeated op costs no copy."""
        key = tuple(values)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= 256:
                self._tables.clear()
            table = torch.tensor(values, dtype=torch.int64, device=device)
            self._tables[key] = table
        return table

    def _begin(self, op: str, tensor: torch.Tensor | None):
        if self._stopped:
            raise RuntimeError(f"tdist {op}: this group stopped after {self._stopped}; destroy it "
                               f"and create a new one")
        device = self._default_device() if tensor is None else _canonical(tensor.device)
        self._ensure_heap(device, op)

    # ---- the two phases ----------------------------------------------------------------
    def _publish(self, op: str, src: torch.Tensor, count: int, header: list[int] | None = None):
        """Stage ``src``; ``count`` goes into the header for peers to compare with their own."""
        stage = self._stage(src.dtype, src.numel(), op)
        hdr_src = self._empty_header if header is None else self._table(header, src.device)
        self._launch(op, staged.publish_kernel, (_programs(src.numel()),),
                     self._heap.ctx, src, stage, src.numel(), hdr_src, self._header,
                     0 if header is None else len(header), self._signals,
                     _CALL_CODE[op], _DTYPE_CODE[src.dtype], count, WORLD=self.world_size, BLOCK=BLOCK)

    def _rounds(self, numel: int, dtype: torch.dtype, parts: int = 1) -> list[tuple[int, int]]:
        """(start, length) pieces of ``numel`` elements per part such that ``parts`` pieces fit
        the staging area together: messages larger than the heap go in several rounds."""
        capacity = self._stage_bytes // dtype.itemsize // parts
        if capacity == 0:
            raise ValueError(f"tdist: the symmetric heap is too small to stage {parts} elements of "
                             f"{dtype}; raise TDIST_HEAP_SIZE (or the backend option 'heap_size')")
        return [(s, min(capacity, numel - s)) for s in range(0, numel, capacity)] or [(0, 0)]

    def _pull_copy(self, op: str, out: torch.Tensor, segments, count: int, from_header=False):
        """``count``: how many elements each peer read from must have published."""
        segments = list(segments) or [(self.rank, 0, 0, 0)]  # still signals done
        segs = self._table(segments, out.device)
        stage = self._stage(out.dtype, 0, op)
        longest = max(s[3] for s in segments)
        grid = (_programs(longest, per=len(segments)), len(segments))
        vector = max(16 // out.element_size(), 1)  # elements in a 16-byte access
        aligned = not from_header and all(v % vector == 0 for s in segments for v in s[1:])
        self._launch(op, staged.pull_copy_kernel, grid,
                     self._heap.ctx, stage, self._header, out, segs, self._signals,
                     _CALL_CODE[op], _DTYPE_CODE[out.dtype], count,
                     WORLD=self.world_size, BLOCK=BLOCK, SRC_FROM_HEADER=from_header,
                     ALIGN=vector if aligned else 1)
        self._check_status(op, out.dtype, count)

    def _pull_reduce(self, op: str, out: torch.Tensor, src_offset: int, n: int, reduce_op: str,
                     count: int):
        stage = self._stage(out.dtype, 0, op)
        self._launch(op, staged.pull_reduce_kernel, (_programs(n),),
                     self._heap.ctx, stage, self._header, out, src_offset, n, self._signals,
                     _CALL_CODE[op], _DTYPE_CODE[out.dtype], count,
                     WORLD=self.world_size, BLOCK=BLOCK, OP=reduce_op, ACC=_ACCUMULATOR[out.dtype])
        self._check_status(op, out.dtype, count)

    def _launch(self, op: str, kernel, grid, *args, **meta):
        try:
            kernel[grid](*args, **meta)
        except Exception as err:
            cause = err
            while cause is not None and not isinstance(cause, language.PeerTimeoutError):
                cause = cause.__cause__
            if cause is not None:
                # peers and this rank now disagree on where the group is: refuse further work
                self._stopped = f"{op} timed out waiting for a peer"
                raise TimeoutError(f"tdist {op} (rank {self.rank} of {self.world_size}): {cause}") from err
            raise

    def _check_status(self, op: str, dtype: torch.dtype, count: int):
        """Raise if a pull saw a peer whose call differs from ours (on GPUs this reads device
        memory, so it runs only with TDIST_CHECK_CALLS=1)."""
        if not self._check_calls:
            return
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
            f"another collective, dtype or element count. Every rank of a group must make the "
            f"same calls in the same order with matching tensors")

    # ---- the collectives (names as in torch.distributed) ---------------------------------
    def all_gather_into_tensor(self, output, input):
        self._gather_to_all("all_gather_into_tensor", [output], input)

    def all_gather(self, outputs, input):
        self._gather_to_all("all_gather", list(outputs), input)

    def _gather_to_all(self, op, targets, input):
        self._begin(op, input)
        src = _flat(input)
        out = _Output(targets)
        n = src.numel()
        order = [(self.rank + i) % self.world_size for i in range(self.world_size)]
        for start, length in self._rounds(n, src.dtype):
            self._publish(op, src[start:start + length], count=n)
            self._pull_copy(op, out.flat, [(p, 0, p * n + start, length) for p in order], count=n)
        out.finish()

    def reduce_scatter_tensor(self, output, input, op):
        self._reduce_scatter("reduce_scatter_tensor", output, _flat(input), op)

    def reduce_scatter(self, output, inputs, op):
        self._reduce_scatter("reduce_scatter", output, torch.cat([_flat(t) for t in inputs]), op)

    def _reduce_scatter(self, name, output, src, reduce_op):
        self._begin(name, output)
        out = _Output([output])
        n = output.numel()
        for start, length in self._rounds(n, src.dtype, parts=self.world_size):
            self._publish(name, _columns(src, self.world_size, start, length), count=src.numel())
            self._pull_reduce(name, out.flat[start:start + length], self.rank * length, length,
                              reduce_op, count=src.numel())
        out.finish()

    def all_reduce(self, tensor, op):
        self._reduce("all_reduce", tensor, op, dst=None)

    def reduce(self, tensor, dst, op):
        self._reduce("reduce", tensor, op, dst=dst)

    def _reduce(self, name, tensor, reduce_op, dst):
        self._begin(name, tensor)
        src = _flat(tensor)
        out = _Output([tensor])
        keeps_result = dst is None or dst == self.rank
        for start, length in self._rounds(src.numel(), src.dtype):
            self._publish(name, src[start:start + length], count=src.numel())
            self._pull_reduce(name, out.flat[start:start + length], 0, length if keeps_result else 0,
                              reduce_op, count=src.numel())
        if keeps_result:
            out.finish()

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes):
        rows_in, rows_out = max(input.shape[0], 1), max(output.shape[0], 1)
        row_in = input.numel() // rows_in if input.shape[0] else _row_numel(input)
        row_out = output.numel() // rows_out if output.shape[0] else _row_numel(output)
        self._exchange("all_to_all_single", [output], [row_out * s for s in output_split_sizes],
                       _flat(input), [row_in * s for s in input_split_sizes])

    def all_to_all(self, outputs, inputs):
        src = torch.cat([_flat(t) for t in inputs])
        self._exchange("all_to_all", list(outputs), [t.numel() for t in outputs],
                       src, [t.numel() for t in inputs])

    def _exchange(self, op, targets, recv_counts, src, send_counts):
        self._begin(op, src)
        send_offsets = _offsets(send_counts)
        self._publish(op, src, count=NO_COUNT, header=send_offsets + send_counts)
        out = _Output(targets)
        recv_offsets = _offsets(recv_counts)
        order = [(self.rank + i) % self.world_size for i in range(self.world_size)]
        self._pull_copy(op, out.flat,
                        [(p, 0, recv_offsets[p], recv_counts[p]) for p in order],
                        count=NO_COUNT, from_header=True)
        out.finish()

    def broadcast(self, tensor, src):
        self._begin("broadcast", tensor)
        count = tensor.numel()
        if self.rank == src:
            data = _flat(tensor)
            for start, length in self._rounds(count, tensor.dtype):
                self._publish("broadcast", data[start:start + length], count=count)
                self._pull_copy("broadcast", data, [], count=count)
            return
        out = _Output([tensor])
        for start, length in self._rounds(count, tensor.dtype):
            self._pull_copy("broadcast", out.flat, [(src, 0, start, length)], count=count)
        out.finish()

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

    def barrier(self):
        self._begin("barrier", None)
        nothing = torch.empty(0, dtype=torch.uint8, device=self._heap.device)
        self._publish("barrier", nothing, count=0)
        self._pull_copy("barrier", nothing, [(p, 0, 0, 0) for p in range(self.world_size)], count=0)

    def close(self):
        if self._heap is not None:
            self._stage_views.clear()
            self._tables.clear()
            self._heap.close()
            self._heap = None


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
