"""What the bulk path queues on streams without a kernel: an int64 written at a heap address (this
rank's heap or a peer's) once the stream's earlier work is done, copies, zeroing, and one
stream ordered after another.

On GPUs these are the device's driver calls, the ``StreamOps`` of its transports
(``torch_tdist.transports``; on CUDA ``cuStreamWriteValue64`` with its memory barrier,
``cuMemcpyAsync``, events), a few microseconds of host time each, and CUDA graphs capture them.
On the CPU the same interface works where the stream is the calling thread: stores and torch
copies. Waits are not here: a stream held by ``cuStreamWaitValue64`` could not give up when a
peer dies, so the bulk path waits with a kernel (``BulkPath._wait_for_peers``).

While ``recording`` is a list, every step is also appended to it for C++ to replay
(``torch_tdist/overlap/replay.py``, csrc/stream_program.hpp): ``("copy", stream, dst, src)``,
``("zero", stream, tensor)``, ``("write", stream, address, value)``,
``("after", waiter, waited)`` (stream ``waiter`` after what is queued on ``waited``); the
bulk path adds its matmuls and launches (``BulkPath.matmul``, ``BulkPath._kernel``), each
with its stream.
"""

import contextlib
import ctypes

import torch

from . import transports


class Streams:
    """One rank's streams for a bulk call: index 0 is the caller's current stream, the others
    side streams (created once, reused)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = []  # (torch stream, the driver's stream, its event)
        self._main_event = None
        self._ops = None  # the device's StreamOps (on the first call, not on the CPU)
        self.recording = None

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def begin(self, sides: int):
        """Start a call on the current stream that may use ``sides`` side streams."""
        if self.on_cpu:
            return
        if self._ops is None:
            self._ops = transports.stream_ops(self.device.type)
        ops = self._ops
        self._main = ops.stream(torch.cuda.current_stream(self.device))
        while len(self._side) < sides:
            # high priority, like the group's stream
            stream = torch.cuda.Stream(self.device, priority=-1)
            event = ops.event()
            self._side.append((stream, ops.stream(stream), event))
        if self._main_event is None:
            self._main_event = ops.event()

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
        event = self._main_event if waited == 0 else self._side[waited - 1][2]
        self._ops.wait_after(self._handle(waiter), self._handle(waited), event)

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
        self._ops.copy(self._handle(stream), dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())

    def zero(self, stream: int, t: torch.Tensor):
        """Zero int64 tensor ``t`` on ``stream``."""
        if self.on_cpu:
            t.zero_()
            return
        self.record("zero", stream, t)
        self._ops.zero32(self._handle(stream), t.data_ptr(), 2 * t.numel())

    def write(self, stream: int, address: int, value: int):
        """Store int64 ``value`` at ``address`` once ``stream``'s earlier work is done (and
        visible)."""
        if self.on_cpu:
            ctypes.c_int64.from_address(address).value = value
            return
        self.record("write", stream, address, value)
        self._ops.write_value(self._handle(stream), address, value)

