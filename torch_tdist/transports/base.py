"""The interface every symmetric-heap transport implements.

A transport gives each rank of a group one segment of device (or host) memory of the same
size, and maps every peer's segment into this process, so that ``torch_tdist.heap`` can lay the
heap out once and kernels can reach a peer's buffer by pointer translation. It also maps a host
page for the device (the group's abort word, read by waiting kernels) and names the calls its
device queues on a stream without a kernel (``StreamOps``).

A transport (``shm``, ``cuda``, ``nvshmem``, ``hip``, ``rocshmem``) is one module in this
package with a subclass of :class:`Transport` and one line in the registry
(``torch_tdist/transports/__init__.py``).
It implements:

- ``name`` and ``device_types`` (the tensors' ``device.type`` it serves);
- :meth:`Transport.check_available`: everything that can be known before any memory is
  allocated (vendor package importable, device present, heap not larger than the device can
  give). Groups call it when they are created, so that a transport that cannot start fails at
  ``init_process_group`` / ``new_group``, naming the transport, the reason and the fix (the
  package to install), never at the first collective;
- :meth:`Transport.create` (this rank's segment, with a ``handle`` of bytes that a peer opens)
  and :meth:`Transport.open` (a peer's segment from its handle), or a ``segment_type`` whose
  class methods do that, and :meth:`Transport.forget` (remove what a handle names once every
  peer mapped it, or when a peer died): the heap exchanges the handles through the group's
  store. A transport whose allocation is itself collective (NVSHMEM) sets
  ``collective = True`` and implements :meth:`Transport.allocate_symmetric` instead;
- :meth:`Transport.map_host_page` / :meth:`Transport.unmap_host_page`;
- :meth:`Transport.stream_ops`: a :class:`StreamOps` for its device (None on the CPU, where the
  stream is the calling thread).

Vendor packages (cuda-python, hip-python, an NVSHMEM or ROCSHMEM wheel) are imported only in
the transport's own module (or its device module, ``cuda_device``), inside functions, so that
the package imports on a machine without them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta

import torch


class TransportUnavailable(RuntimeError):
    """A transport cannot start here: its message names the transport, the reason and the fix."""


class PeersMissing(TimeoutError):
    """Ranks of the group did not arrive within its timeout while the heap was set up."""


def wait_for_peers(store, key: str, world_size: int, timeout: timedelta, what: str):
    """Wait until ``{key}/{rank}`` is in ``store`` for every rank; past ``timeout``, raise
    :class:`PeersMissing` naming the ranks that did not ``what`` ("create a segment")."""
    keys = [f"{key}/{peer}" for peer in range(world_size)]
    try:
        store.wait(keys, timeout)
    except Exception as err:  # noqa: BLE001  (the store's timeout: DistStoreError, RuntimeError)
        missing = [peer for peer, k in enumerate(keys) if not store.check([k])]
        if not missing:
            raise
        raise PeersMissing(f"rank(s) {', '.join(map(str, missing))} did not arrive (did not {what} within "
                           f"{timeout.total_seconds():g} s)") from err


class Segment(ABC):
    """One rank's segment, mapped into this process.

    ``bytes``: a uint8 tensor over the whole segment, on the transport's device (its
    ``data_ptr()`` is where the segment sits in this process). ``handle`` (own segments): the
    bytes a peer passes to :meth:`Transport.open`.
    """

    bytes: torch.Tensor | None
    handle: bytes

    def all_peers_mapped(self):
        """Every peer has opened this (own) segment, or the heap's setup is failing."""

    @abstractmethod
    def close(self):
        """Unmap (and for an own segment free) the memory; ``bytes`` becomes None."""


class StreamOps(ABC):
    """What a device queues on a stream without a kernel, as driver calls: ordering one stream
    after another, copies, zeroing, and a 64-bit store released after the stream's earlier work.

    Streams and events are the driver's handles (``stream(torch_stream)``, ``event()``). There is
    deliberately no stream-held wait for a value: a stream blocked that way cannot give up when a
    peer dies, so waits are kernels that watch the group's abort word.
    """

    @abstractmethod
    def stream(self, torch_stream):
        """The driver's handle of a torch stream."""

    @abstractmethod
    def event(self):
        """A new event (no timing)."""

    @abstractmethod
    def wait_after(self, waiter, waited, event):
        """Order stream ``waiter`` after what is queued on ``waited`` now (through ``event``)."""

    @abstractmethod
    def copy(self, stream, dst: int, src: int, nbytes: int):
        """Copy ``nbytes`` from address ``src`` to ``dst`` on ``stream``."""

    @abstractmethod
    def zero32(self, stream, address: int, words: int):
        """Zero ``words`` 32-bit words at ``address`` on ``stream``."""

    @abstractmethod
    def write_value(self, stream, address: int, value: int):
        """Store int64 ``value`` at ``address`` once ``stream``'s earlier work is done and visible."""


class Transport(ABC):
    """One way of making a symmetric heap (see the module's docstring for what to implement)."""

    name: str = ""
    device_types: tuple[str, ...] = ()
    collective = False  # allocation is one collective call (allocate_symmetric), not handle exchange
    # the Segment class whose create(nbytes, device) and open(handle, nbytes, device) class
    # methods serve create and open (or override those)
    segment_type: type | None = None

    def check_available(self, device_type: str, heap_bytes: int | None = None):
        """Raise :class:`TransportUnavailable` (or ValueError for a device it does not serve)
        when this transport cannot start for tensors of ``device_type`` with a heap of
        ``heap_bytes`` per rank (None: the default). Cheap: it allocates nothing."""
        if device_type not in self.device_types:
            raise ValueError(
                f"tdist: transport {self.name!r} cannot serve {device_type} tensors")

    def create(self, nbytes: int, device: torch.device) -> Segment:
        """This rank's new segment of ``nbytes`` (zeroed), with its ``handle``."""
        return self.segment_type.create(nbytes, device)

    def open(self, handle: bytes, nbytes: int, device: torch.device) -> Segment:
        """A peer's segment of ``nbytes``, mapped from its ``handle``."""
        return self.segment_type.open(handle, nbytes, device)

    def forget(self, handle: bytes):
        """Remove whatever name ``handle`` gives a segment (every peer mapped it, or one died)."""

    def allocate_symmetric(self, store, key: str, rank: int, world_size: int, nbytes: int,
                           device: torch.device, timeout: timedelta) -> list[Segment]:
        """(``collective`` transports) every rank's segment as mapped here, in rank order."""
        raise NotImplementedError(f"tdist: transport {self.name!r} allocates through create/open")

    def map_host_page(self, address: int, nbytes: int, device: torch.device) -> int:
        """Map host memory at ``address`` (page-aligned) for ``device``; returns the address
        the device reads it at."""
        return address

    def unmap_host_page(self, address: int, device: torch.device):
        """Undo :meth:`map_host_page`."""

    def stream_ops(self) -> StreamOps | None:
        """The device's stream calls (None: the CPU, where the stream is the calling thread)."""
        return None
