"""Recorded stream programs: a pipelined op's steps recorded on its first call and replayed from
C++ on later ones (``csrc/stream_program.hpp``), from a CUDA graph once its tensors come back to
addresses it ran at before."""

from __future__ import annotations

import collections

import torch

from .. import language
from ..collectives.base import LAUNCH_ROLE_PTR

# A recorded pipelined op (ProgramReplay.run_program) is replayed from a CUDA graph once it has
# been replayed at the same tensor addresses before (from its third call in a loop: the first is
# recorded). At most PROGRAM_GRAPHS graphs are kept per group, the least recently used going; past
# that many captures, another is made only while graph replays number CAPTURE_PAYBACK per capture
# (more address sets in turn than graphs would otherwise capture on every call). On one H200 host
# a 2048-row all_gather_matmul (4 ranks) took 187 us of host time per call replayed step by step,
# 41 us as a graph (and 622 -> 549 us on the GPU).
PROGRAM_GRAPHS = 0 if language.INTERPRET else 64
CAPTURE_PAYBACK = 8
OPS = ("all_gather_matmul", "matmul_reduce_scatter")  # (the order of _C.FusedCounts' entries)


def _fp32_matmul_precision() -> str:
    """What float32 matmuls on CUDA run in now ("ieee" or "tf32"), by torch's new API (reading
    the legacy ``allow_tf32`` raises once both APIs were used)."""
    precision = torch.backends.cuda.matmul.fp32_precision
    return precision if precision != "none" else torch.backends.fp32_precision


def footprint(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (its strides' reach)."""
    if not t.numel():
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(t.shape, t.stride()))) * t.element_size()


def interleaved(tensors: list[torch.Tensor]) -> bool:
    """Whether the memory two of ``tensors`` reach (``footprint``) overlaps."""
    spans = sorted((t.data_ptr(), t.data_ptr() + footprint(t)) for t in tensors if t.numel())
    # (sorted by start, an overlap shows between neighbours)
    return any(start < end for (_, end), (start, _) in zip(spans, spans[1:]))


class ProgramReplay:
    """One group's recorded programs, their CUDA graphs and the scratch memory they use."""

    def __init__(self, executor, issued):
        self.executor = executor
        self.issued = issued  # the calls C++ issued (OverlapState.issued)
        self.programs = {}  # key -> recorded StreamProgram, or False (cannot be)
        # CUDA graphs of recorded programs by their roles' addresses (run_program), most recent
        # last; the addresses they were replayed at once
        self.graphs, self.addresses = collections.OrderedDict(), collections.OrderedDict()
        self._graph_stream = self._graph_pool = None
        self.captures = 0
        self._graph_calls = 0  # pipelined calls replayed as a CUDA graph from Python
        self._replayed_calls = collections.Counter()  # pipelined calls replayed from Python, by op
        self._scratch_buffers = {}  # dtype -> scratch's memory
        self.last = None  # (program, roles) of the last call that ran or recorded one, else None
        # while a shape class is tuned (tuning.run): its calls run step by step, capturing no
        # graphs (tuning's ways and addresses would use up PROGRAM_GRAPHS, and the calls after it
        # would find no capture left: step by step, hundreds of microseconds of host time a call)
        self.tuning = False

    @property
    def graph_calls(self) -> int:
        """Pipelined calls replayed as a CUDA graph (from Python or C++)."""
        return self._graph_calls + sum(self.issued.graph)

    @property
    def replayed_calls(self) -> collections.Counter:
        """Pipelined calls replayed from their recorded program, by op (from Python or C++)."""
        issued = self.issued
        return self._replayed_calls + collections.Counter(
            {op: issued.program[i] + issued.graph[i] for i, op in enumerate(OPS)})

    def close(self):
        for (_, *addresses), (_, program) in self.graphs.items():
            program.drop_graph(addresses)
        self.graphs.clear()
        self._scratch_buffers.clear()
        self.last = None

    def scratch(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """``numel`` elements of ``like``'s dtype and device, the same memory from call to call
        (a group's calls run in one stream order), so that a replayed op finds it where its CUDA
        graph does (``run_program``)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return like.new_empty(numel)  # (the caller's graph keeps it; a later call may not free it)
        buffer = self._scratch_buffers.get(like.dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch_buffers[like.dtype] = None  # the old one goes before the new is made
            buffer = self._scratch_buffers[like.dtype] = like.new_empty(numel)
        return buffer[:numel]

    def recorded(self, op: str, key: tuple, roles: list[torch.Tensor], calls):
        """``calls()``: a pipelined op's bulk calls, made in Python. On GPUs the first call of
        ``key`` and of these ``roles``' shapes is recorded (``Streams.recording``), and later
        ones replay it from C++ with their own ``roles`` (csrc/stream_program.hpp): the same
        steps without Python's tens of microseconds each."""
        # (the kernels were compiled for their pointers' 16-byte alignment; a float32 matmul
        # captured in a graph keeps the TF32 setting of its capture)
        key = (*key, *((t.dtype, t.shape, t.stride(), t.data_ptr() % 16) for t in roles),
               _fp32_matmul_precision() if roles[0].dtype == torch.float32 else None)
        program = self.programs.get(key)
        executor = self.executor
        self.last = None
        if program:
            self._replay(op, program, roles)
            self.last = (program, roles)
            return
        streams = executor.bulk.streams
        # (roles whose memory interleaves, as the same B twice, would bind an address to the first
        # of them, which another call's tensors need not share: such a call is not recorded, and
        # the next of its key may be)
        record = program is None and executor.heap.device.type == "cuda" and not executor.checks_calls \
            and not interleaved(roles)
        streams.recording = [] if record else None
        try:
            calls()
            steps = streams.recording
        finally:
            streams.recording = None
        if record:
            program = self.programs[key] = self._stream_program(steps, roles) or False
            self.last = (program, roles) if program else None

    def _replay(self, op: str, program, roles: list[torch.Tensor]):
        self._replayed_calls[op] += 1
        self.executor.run_unplanned(op, lambda: self.run_program(program, roles))

    def run_program(self, program, roles: list[torch.Tensor]):
        """One replay of a recorded ``program``: from a CUDA graph of it where ``roles`` are at
        addresses it was replayed at before (one launch instead of tens of driver calls and
        matmuls, each a few to tens of microseconds of host time), else step by step. A caller
        capturing its own graph gets the steps."""
        if not PROGRAM_GRAPHS or self.tuning or torch.cuda.is_current_stream_capturing():
            program.run(roles)
            return
        where = (id(program), *(t.data_ptr() for t in roles))
        graph = self.graphs.get(where, (None,))[0]
        if graph is None and where not in self.addresses:
            self.addresses[where] = None
            while len(self.addresses) > 4 * PROGRAM_GRAPHS:
                self.addresses.popitem(last=False)
        elif graph is None and (self.captures < PROGRAM_GRAPHS
                                or self.graph_calls >= CAPTURE_PAYBACK * self.captures):
            graph = self._capture(program, roles)
            self.graphs[where] = (graph, program)
            # C++ launches it for the calls it issues at these addresses (csrc/fused_calls.cpp)
            program.add_graph(list(where[1:]), graph.raw_cuda_graph_exec(), graph)
            while len(self.graphs) > PROGRAM_GRAPHS:
                (_, *addresses), (_, dropped) = self.graphs.popitem(last=False)
                dropped.drop_graph(addresses)
        if graph is None:
            program.run(roles)
            return
        self.graphs.move_to_end(where)
        graph.replay()
        self._graph_calls += 1

    def _capture(self, program, roles: list[torch.Tensor]):
        """``program`` on ``roles`` as a CUDA graph (nothing runs yet)."""
        if self._graph_stream is None:
            self._graph_stream = torch.cuda.Stream(self.executor.heap.device)
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self.captures += 1
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

        executor = self.executor
        heap = executor.heap
        extents = [(t.data_ptr(), footprint(t), t.dtype) for t in roles]  # (apart: recorded only then)
        lasting = {heap.ctx.data_ptr()}

        def locate(address: int, dtype=None):
            """(role, bytes from its first) or (-1, address); None if it may not last."""
            for role, (first, nbytes, role_dtype) in enumerate(extents):
                if 0 <= address - first < nbytes and dtype in (None, role_dtype):
                    return role, address - first
            in_heap = any(0 <= address - heap.base_address(p) < heap.nbytes for p in range(executor.world_size))
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
                launch = executor.replayable_launch(kernel, compiled, grid, args, meta, bind)
                if launch is None:
                    return None
                program.append((kind, stream, launch))
        return _C.StreamProgram(program, executor.bulk.streams.side_streams)
