"""The fused and pipelined overlap ops' part of the executor (torch_tdist.ops calls these
methods), their state and their constants, as a mixin the Executor inherits."""

import collections

import torch

from .. import language
from ..bulk import KMAX
from ..bulk import aligned as _aligned
from ..bulk import vector as _vector
from ..triton_kernels import overlap
from .base import LAUNCH_ROLE_PTR

# How torch_tdist.ops run: "sequential" (the collective, then torch.matmul), "pipelined" (copy
# engines and torch.matmul chunk by chunk, PIPELINE_CHUNKS[0] chunks), "fused" (the overlapping
# kernels of triton_kernels/overlap.py, first tile config), "tune" (on a shape's first call the
# group times the sequential path and every way of the other two, and keeps the fastest),
# "auto": tune on GPUs, sequential on the CPU (the interpreter's kernels are slow).
OVERLAPS = ("auto", "fused", "pipelined", "sequential", "tune")
PIPELINE_CHUNKS = (2,) if language.INTERPRET else (2, 1, 4)  # chunks per rank's part; the first is "pipelined"'s
# A pipelined op's matmul that overlaps no transfer (all_gather_matmul: the last chunk's;
# matmul_reduce_scatter: the first chunk's) goes in END_PIECES pieces of rows where the transfer
# outlasts the matmul (estimated at an H200's copy-engine and bf16 matmul rates below): there it
# adds to the op's time. Where the matmul is longer it does not, and smaller matmuls only cost.
# 4 H200s, M 8192, 4 pieces against 1 (replayed step by step): all_gather_matmul 8192x4096x12288 and 8192x3584x14336
# 618 -> 578 and 707 -> 654 us, matmul_reduce_scatter 8192x14336x4096 734 -> 679 us (transfer
# longer); 8192x28672x8192 1546 -> 1608 and 1766 -> 1823 us (matmul longer).
END_PIECES = 4
COPY_BYTES_PER_US = 300e3
MATMUL_FLOP_PER_US = 600e6
# A recorded pipelined op (Executor._run_program) is replayed from a CUDA graph once it has been
# replayed at the same tensor addresses before (from its third call in a loop: the first is
# recorded). At most PROGRAM_GRAPHS graphs are kept per group, the least recently used going; past
# that many captures, another is made only while graph replays number CAPTURE_PAYBACK per capture
# (more address sets in turn than graphs would otherwise capture on every call). On one H200 host
# a 2048-row all_gather_matmul (4 ranks) took 187 us of host time per call replayed step by step,
# 41 us as a graph (and 622 -> 549 us on the GPU; a throwaway probe, not kept).
PROGRAM_GRAPHS = 0 if language.INTERPRET else 64
CAPTURE_PAYBACK = 8
# Tile configs of the overlapped matmuls: small under the interpreter; on GPUs the usual
# H100/H200 bf16 shapes, the first the default of "fused".
GEMM_CONFIGS = ([{"BM": 16, "BN": 16, "BK": 16}] if language.INTERPRET else
                [{"BM": 128, "BN": 128, "BK": 64, "num_stages": 3},
                 {"BM": 128, "BN": 256, "BK": 64, "num_stages": 3},
                 {"BM": 256, "BN": 128, "BK": 64, "num_stages": 3}])
GEMM_PROGRAMS = 1 if language.INTERPRET else 132  # persistent, one per H200 SM


class OverlapPart:
    """State and methods of the overlap ops; the Executor calls ``_init_overlap_state``."""

    def _init_overlap_state(self):
        self.tuned = {}  # torch_tdist.ops: shape class -> the fastest way found ("tune")
        self.tuning_us = {}  # torch_tdist.ops: shape class -> {way: its time there, us per call}
        self.uneven_classes = set()  # torch_tdist.ops: shape classes whose B widths differ between ranks
        self._programs = {}  # pipelined ops: key -> recorded StreamProgram, or False (cannot be)
        # CUDA graphs of recorded programs by their roles' addresses (_run_program), most recent
        # last; the addresses they were replayed at once
        self._program_graphs, self._program_addresses = collections.OrderedDict(), collections.OrderedDict()
        self._graph_stream = self._graph_pool = None
        self._captures = 0
        self.graph_calls = 0  # pipelined calls replayed as a CUDA graph
        self._scratch_buffers = {}  # dtype -> _scratch's memory
        self.fused_calls = collections.Counter()  # torch_tdist.ops calls the overlapping kernels served
        self.replayed_calls = collections.Counter()  # of those, pipelined calls C++ replayed (_recorded)

    # ---- fused ops (torch_tdist.ops) ----------------------------------------------------
    def _overlap_rounds(self, op: str, a: torch.Tensor, rows: int, row_len: int, pulled: bool = False,
                        most_rows: int | None = None):
        """(first row, rows) of each round of an overlapped op whose part per rank is ``rows``
        rows of ``row_len`` elements: as many rows as the bulk area holds (each rank's part in
        its own slot, or ``pulled``: in the whole area; at most ``most_rows``). None, counting
        nothing, when not one row fits (``row_len`` is the same on every rank: they all decide
        alike)."""
        self._begin(op, a)
        capacity = self._bulk.pull_capacity if pulled else self._bulk.part_capacity
        per_round = capacity(a.dtype) // row_len if row_len else 0
        per_round = min(per_round, most_rows or per_round)
        if per_round == 0:
            return None
        self.fused_calls[op] += 1
        return [(row0, min(per_round, rows - row0)) for row0 in range(0, rows, per_round)]

    def _pipelined_rounds(self, op: str, a: torch.Tensor, rows: int, row_len: int, chunks: int,
                          pulled: bool = False):
        """``_overlap_rounds`` of a pipelined op, each with its elements per chunk: the round's
        rows in ``chunks`` pieces (at most KMAX)."""
        rounds = self._overlap_rounds(op, a, rows, row_len, pulled)
        if rounds is None:
            return None
        return [(row0, n, max(-(-n // chunks), -(-n // KMAX)) * row_len) for row0, n in rounds]

    def all_gather_matmul(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                          a_out: torch.Tensor, tiles: dict = GEMM_CONFIGS[0]) -> bool:
        """``out`` = all_gather(``a``) @ ``b`` and ``a_out`` = all_gather(``a``), the matmul taking
        each peer's rows as they land (``triton_kernels/overlap.py``); ``a`` [m, K] and ``out``
        [world * m, N], ``a_out`` contiguous. On the caller's stream; in rounds of as many rows
        as the bulk area holds. False, having done nothing, when not one row fits."""
        op = "all_gather_matmul"
        m, k = a.shape
        n, dtype = b.shape[1], a.dtype
        rounds = self._overlap_rounds(op, a, m, k)
        if rounds is None:
            return False
        for row0, rows in rounds:

            def consume(own, slots, slot_stride, ready, chunk, n_chunks, grid, push_args, pushers):
                aligned = _aligned(dtype, (slot_stride, chunk, push_args[1], row0 * k))
                self._launch(op, overlap.ag_gemm_kernel, (grid,), self._heap.ctx, own, slots, slot_stride, ready,
                             b, out, a_out, rows, row0, m, n, k, b.stride(0), b.stride(1), chunk, n_chunks,
                             *push_args, **self._bulk.kernel_meta(dtype), **tiles,
                             ALIGN=_vector(dtype) if aligned else 1, PUSHERS=pushers,
                             IEEE=dtype == torch.float32, UPCAST=language.INTERPRET)

            self._bulk_call(op, lambda op_, word, _, flat: self._bulk.all_gather_consumed(op_, word, flat, consume),
                            out, a[row0:row0 + rows].reshape(-1))
        return True

    def matmul_reduce_scatter(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                              reduce_op: str, tiles: dict = GEMM_CONFIGS[0]) -> bool:
        """``out`` [m, N] = rows [rank * m, (rank + 1) * m) of OP over ranks of ``a`` [world * m,
        K] @ ``b`` [K, N], each rank's rows sent as the matmul makes them
        (``triton_kernels/overlap.py``). On the caller's stream; in rounds of as many rows as the
        bulk area holds (at most KMAX row blocks). False, having done nothing, when not one row
        fits."""
        op = "matmul_reduce_scatter"
        m, n = out.shape
        rounds = self._overlap_rounds(op, a, m, n, most_rows=KMAX * tiles["BM"])
        if rounds is None:
            return False
        warps = {} if language.INTERPRET else {"num_warps": 8}
        for row0, rows in rounds:

            def produce(slots, slot_stride, ready, counters):
                self._launch(op, overlap.gemm_rs_kernel, (GEMM_PROGRAMS,), self._heap.ctx, a, b, slots,
                             slot_stride, ready, counters, rows, row0, m, n, a.shape[1], a.stride(0), a.stride(1),
                             b.stride(0), b.stride(1), ME=self.rank, WORLD=self.world_size, KMAX=KMAX,
                             IEEE=out.dtype == torch.float32, UPCAST=language.INTERPRET, **tiles, **warps)

            self._bulk_call(op, lambda op_, word, flat, _: self._bulk.reduce_scatter_produced(
                op_, word, flat, rows, tiles["BM"] * n, reduce_op, produce), out[row0:row0 + rows].view(-1), a)
        return True

    @staticmethod
    def _end_pieces(moved_bytes: int, flop: int) -> int:
        """How many pieces the pipelined op's exposed matmul goes in (END_PIECES)."""
        return END_PIECES if moved_bytes / COPY_BYTES_PER_US > flop / MATMUL_FLOP_PER_US else 1

    def all_gather_matmul_pipelined(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                                    a_out: torch.Tensor, chunks: int) -> bool:
        """What ``all_gather_matmul`` makes, by the copy engines and torch.matmul: each peer's
        rows, in ``chunks`` pieces, are pulled into ``a_out`` and multiplied on the caller's
        stream as they land (``BulkPath.all_gather_pulled``); this rank's own first."""
        op = "all_gather_matmul"
        m, k = a.shape
        rounds = self._pipelined_rounds(op, a, m, k, chunks, pulled=True)
        if rounds is None:
            return False
        world = self.world_size
        pieces = self._end_pieces((world - 1) * a.numel() * a.element_size(), 2 * world * a.numel() * b.shape[1])

        def calls():
            for row0, rows, chunk in rounds:

                def consume(rank, start, piece, stream):
                    r0, count = rank * m + row0 + start // k, piece.numel() // k
                    self._bulk.matmul(piece.view(count, k), b, out[r0:r0 + count], stream)

                a_round = a[row0:row0 + rows].reshape(-1)
                # a_out's rows of this round, rank by rank: contiguous per rank, so a strided view
                gathered = a_out.view(self.world_size, m * k)[:, row0 * k:(row0 + rows) * k]
                self._bulk_call(op, lambda op_, word, _, flat: self._bulk.all_gather_pulled(
                    op_, word, flat, gathered, chunk, consume, row=k, end_pieces=pieces), out, a_round)

        self._recorded(op, (op, chunks), [a, b, out, a_out], calls)
        return True

    def matmul_reduce_scatter_pipelined(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                                        reduce_op: str, chunks: int) -> bool:
        """What ``matmul_reduce_scatter`` makes, by torch.matmul and the copy engines: the
        partial products for each peer, in ``chunks`` pieces, are pushed while the next are
        made, this rank's own last, then summed as they land (``BulkPath.reduce_scatter_pipelined``;
        torch.matmul writing them straight into the peers' heaps was 1.2x to 1.35x slower on
        H200s: benchmarks/results/overlap_NVIDIA_H200-x4-rs-remote-write.json)."""
        op = "matmul_reduce_scatter"
        m, n = out.shape
        rounds = self._pipelined_rounds(op, a, m, n, chunks)
        if rounds is None:
            return False
        world = self.world_size
        staging = self._scratch(out, world * max(rows for _, rows, _ in rounds) * n)
        pieces = self._end_pieces((world - 1) * out.numel() * out.element_size(), 2 * world * out.numel() * a.shape[1])

        def calls():
            for row0, rows, chunk in rounds:

                def produce(rank, start, dst):
                    r0, count = rank * m + row0 + start // n, dst.numel() // n
                    self._bulk.matmul(a[r0:r0 + count], b, dst.view(count, n))

                self._bulk_call(op, lambda op_, word, flat, _: self._bulk.reduce_scatter_pipelined(
                    op_, word, flat, chunk, reduce_op, produce, staging, row=n, end_pieces=pieces),
                    out[row0:row0 + rows].view(-1), a)

        self._recorded(op, (op, chunks, reduce_op), [a, b, out, staging], calls)
        return True

    def _scratch(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """``numel`` elements of ``like``'s dtype and device, the same memory from call to call
        (a group's calls run in one stream order), so that a replayed op finds it where its CUDA
        graph does (``_run_program``)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return like.new_empty(numel)  # (the caller's graph keeps it; a later call may not free it)
        buffer = self._scratch_buffers.get(like.dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch_buffers[like.dtype] = None  # the old one goes before the new is made
            buffer = self._scratch_buffers[like.dtype] = like.new_empty(numel)
        return buffer[:numel]

    def _recorded(self, op: str, key: tuple, roles: list[torch.Tensor], calls):
        """``calls()``: a pipelined op's bulk calls, made in Python. On GPUs the first call of
        ``key`` and of these ``roles``' shapes is recorded (``Streams.recording``), and later
        ones replay it from C++ with their own ``roles`` (csrc/stream_program.hpp): the same
        steps without Python's tens of microseconds each."""
        # (the kernels were compiled for their pointers' 16-byte alignment; a float32 matmul
        # captured in a graph keeps the TF32 setting of its capture)
        key = (*key, *((t.dtype, t.shape, t.stride(), t.data_ptr() % 16) for t in roles),
               _fp32_matmul_precision() if roles[0].dtype == torch.float32 else None)
        program = self._programs.get(key)
        if program:
            self._replay(op, program, roles)
            return
        streams = self._bulk.streams
        record = program is None and self._heap.device.type == "cuda" and not self._check_calls
        streams.recording = [] if record else None
        try:
            calls()
            steps = streams.recording
        finally:
            streams.recording = None
        if record:
            self._programs[key] = self._stream_program(steps, roles) or False

    def _replay(self, op: str, program, roles: list[torch.Tensor]):
        self._replayable = False
        self.replayed_calls[op] += 1
        try:
            self._run_program(program, roles)
        except Exception as err:
            self._stopped = f"{op} failed part-way ({type(err).__name__})"  # flags may be left on peers
            raise

    def _run_program(self, program, roles: list[torch.Tensor]):
        """One replay of a recorded ``program``: from a CUDA graph of it where ``roles`` are at
        addresses it was replayed at before (one launch instead of tens of driver calls and
        matmuls, each a few to tens of microseconds of host time), else step by step. A caller
        capturing its own graph gets the steps."""
        if not PROGRAM_GRAPHS or torch.cuda.is_current_stream_capturing():
            program.run(roles)
            return
        where = (id(program), *(t.data_ptr() for t in roles))
        graph = self._program_graphs.get(where)
        if graph is None and where not in self._program_addresses:
            self._program_addresses[where] = None
            while len(self._program_addresses) > 4 * PROGRAM_GRAPHS:
                self._program_addresses.popitem(last=False)
        elif graph is None and (self._captures < PROGRAM_GRAPHS
                                or self.graph_calls >= CAPTURE_PAYBACK * self._captures):
            graph = self._program_graphs[where] = self._capture(program, roles)
            while len(self._program_graphs) > PROGRAM_GRAPHS:
                self._program_graphs.popitem(last=False)
        if graph is None:
            program.run(roles)
            return
        self._program_graphs.move_to_end(where)
        graph.replay()
        self.graph_calls += 1

    def _capture(self, program, roles: list[torch.Tensor]):
        """``program`` on ``roles`` as a CUDA graph (nothing runs yet)."""
        if self._graph_stream is None:
            self._graph_stream = torch.cuda.Stream(self._heap.device)
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self._captures += 1
        with torch.cuda.stream(self._graph_stream):
            # (thread_local: the watchdog thread's CUDA calls do not void this capture)
            graph.capture_begin(pool=self._graph_pool, capture_error_mode="thread_local")
            try:
                program.run(roles)
            finally:
                graph.capture_end()
        return graph

    def _stream_program(self, steps: list, roles: list[torch.Tensor]):
        """The recorded ``steps`` as a ``_C.StreamProgram``, every address in one of ``roles``
        bound to it; None if one is neither in a role nor in the heap (a tensor of this call
        only, which a replay must not reuse)."""
        from .. import _C

        heap = self._heap
        extents = [(t.data_ptr(), t.numel() * t.element_size(), t.dtype) for t in roles]
        lasting = {heap.ctx.data_ptr()}

        def locate(address: int, dtype=None):
            """(role, bytes from its first) or (-1, address); None if it may not last."""
            for role, (first, nbytes, role_dtype) in enumerate(extents):
                if 0 <= address - first < nbytes and dtype in (None, role_dtype):
                    return role, address - first
            in_heap = any(0 <= address - heap.base_address(p) < heap.nbytes for p in range(self.world_size))
            return (-1, address) if in_heap or address in lasting else None

        def view(t: torch.Tensor):
            found = locate(t.data_ptr(), t.dtype)
            if found is None:
                return None
            role, offset = found
            return role, t if role < 0 else None, offset // t.element_size(), list(t.shape), list(t.stride())

        program = []
        for kind, *step in steps:
            if kind == "copy":
                stream, dst, src = step
                where = (locate(dst.data_ptr()), locate(src.data_ptr()))
                if None in where:
                    return None
                program.append((kind, stream, *where, src.numel() * src.element_size()))
            elif kind == "zero":
                stream, t = step
                where = locate(t.data_ptr())
                if where is None:
                    return None
                program.append((kind, stream, where, t.numel()))
            elif kind == "write":
                stream, address, value = step
                where = locate(address)
                if where is None:
                    return None
                program.append((kind, stream, where, value))
            elif kind == "after":
                program.append((kind, *step))
            elif kind == "mm":
                stream, *operands = step
                views = [view(t) for t in operands]
                if None in views:
                    return None
                program.append((kind, stream, *views))
            else:  # launch
                stream, kernel, compiled, grid, args, meta = step

                def bind(name, value):
                    found = locate(value.data_ptr())
                    if found is None:
                        return None
                    role, offset = found
                    return (0, offset) if role < 0 else (LAUNCH_ROLE_PTR + role, offset)
                launch = self._launch_tuple(kernel, compiled, grid, args, meta, bind)
                if launch is None:
                    return None
                program.append((kind, stream, launch))
        return _C.StreamProgram(program, self._bulk.streams.side_streams)


def _fp32_matmul_precision() -> str:
    """What float32 matmuls on CUDA run in now ("ieee" or "tf32"), by torch's new API (reading
    the legacy ``allow_tf32`` raises once both APIs were used)."""
    precision = torch.backends.cuda.matmul.fp32_precision
    return precision if precision != "none" else torch.backends.fp32_precision
