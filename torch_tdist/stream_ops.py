"""What the bulk path queues on streams without a kernel: an int64 written at a heap address (this
rank's heap or a peer's) once the stream's earlier work is done, copies, zeroing, and one
stream ordered after another.

On GPUs these are CUDA driver calls (``cuStreamWriteValue64`` with its memory barrier,
``cuMemcpyAsync``, events), a few microseconds of host time each, and CUDA graphs capture them.
On the CPU the same interface works where the stream is the calling thread: stores and torch
copies. Waits are not here: a stream held by ``cuStreamWaitValue64`` could not give up when a
peer dies, so the bulk path waits with a kernel (``BulkPath._wait_for_peers``).

While ``recording`` is a list, every step is also appended to it for C++ to replay
(``Executor._stream_program``, csrc/stream_program.hpp): ``("copy", stream, dst, src)``,
``("zero", stream, tensor)``, ``("write", stream, address, value)``,
``("after", waiter, waited)`` (stream ``waiter`` after what is queued on ``waited``); the
bulk path adds its matmuls and launches (``BulkPath.matmul``, ``BulkPath._kernel``), each
with its stream.
"""

import contextlib
import ctypes

import torch


class Streams:
    """One rank's streams for a bulk call: index 0 is the caller's current stream, the others
    side streams (created once, reused)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = []  # (torch stream, CUstream, CUevent)
        self._main_event = None
        self.recording = None

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def begin(self, sides: int):
        """Start a call on the current stream that may use ``sides`` side streams."""
        if self.on_cpu:
            return
        cu = _driver()
        self._main = cu.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        while len(self._side) < sides:
            # high priority, like the group's stream
            stream = torch.cuda.Stream(self.device, priority=-1)
            event = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            self._side.append((stream, cu.CUstream(stream.cuda_stream), event))
        if self._main_event is None:
            self._main_event = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    @property
    def side_streams(self) -> list[tuple[int, int, int]]:
        """The side streams as (stream_id, device_index, device_type), what C++ makes a
        c10::Stream of."""
        return [(s.stream_id, s.device_index, s.device_type) for s, _, _ in self._side]

    def record(self, *step):
        """Append ``step`` to ``recording`` while it is a list."""
        if self.recording is not None:
            self.recording.append(step)

    def on(self, stream: int):
        """A context in which torch ops and kernel launches go to ``stream``."""
        if self.on_cpu or stream == 0:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._side[stream - 1][0])

    def after(self, waiter: int, waited: int):
        """Order stream ``waiter`` after everything queued on stream ``waited`` so far (0: the
        main stream, i > 0: side stream i)."""
        if self.on_cpu:
            return
        self.record("after", waiter, waited)
        cu = _driver()
        event = self._main_event if waited == 0 else self._side[waited - 1][2]
        _check(cu.cuEventRecord(event, self._handle(waited)), "cuEventRecord")
        _check(cu.cuStreamWaitEvent(self._handle(waiter), event, 0), "cuStreamWaitEvent")

    def fork(self, sides: int, waited: int = 0):
        """Order the first ``sides`` side streams (but ``waited``) after everything queued on
        stream ``waited``."""
        for stream in range(1, sides + 1):
            if stream != waited:
                self.after(stream, waited)

    def join(self, sides: int):
        """Order the main stream after everything queued on the first ``sides`` side streams."""
        for stream in range(1, sides + 1):
            self.after(0, stream)

    def _handle(self, stream: int):
        return self._main if stream == 0 else self._side[stream - 1][1]

    def copy(self, stream: int, dst: torch.Tensor, src: torch.Tensor):
        """``dst.copy_(src)`` (same dtype and size, contiguous) on ``stream``."""
        if self.on_cpu:
            dst.copy_(src)
            return
        self.record("copy", stream, dst, src)
        cu = _driver()
        _check(cu.cuMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(),
                                self._handle(stream)), "cuMemcpyAsync")

    def zero(self, stream: int, t: torch.Tensor):
        """Zero int64 tensor ``t`` on ``stream``."""
        if self.on_cpu:
            t.zero_()
            return
        self.record("zero", stream, t)
        cu = _driver()
        _check(cu.cuMemsetD32Async(t.data_ptr(), 0, 2 * t.numel(), self._handle(stream)), "cuMemsetD32Async")

    def write(self, stream: int, address: int, value: int):
        """Store int64 ``value`` at ``address`` once ``stream``'s earlier work is done (and
        visible)."""
        if self.on_cpu:
            ctypes.c_int64.from_address(address).value = value
            return
        self.record("write", stream, address, value)
        cu = _driver()
        _check(cu.cuStreamWriteValue64(self._handle(stream), address, value, 0), "cuStreamWriteValue64")


_DRIVER = None  # cuda.bindings.driver, imported on the first GPU call (host time: once, not per call)


def _driver():
    global _DRIVER
    if _DRIVER is None:
        from cuda.bindings import driver

        _DRIVER = driver
    return _DRIVER


def _check(result, call: str):
    _driver()
    err, *value = result if isinstance(result, tuple) else (result,)
    if err != _DRIVER.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"tdist: {call} failed: {_driver().cuGetErrorString(err)[1]}")
    return value[0] if value else None
