"""The ``shm`` transport: POSIX shared memory on the CPU, one segment per rank.

Segments live in /dev/shm with mode 0600 and are unlinked as soon as every peer mapped them, so
nothing stays there after a crash. Handles pass through the group's store.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

import torch

from .base import Segment, Transport, TransportUnavailable

SHM_DIR = "/dev/shm"


class ShmSegment(Segment):
    """One POSIX shared-memory segment mapped into this process.

    Its handle is ``name:token``. The owner writes the random token into the segment's first
    bytes (the heap keeps them out of allocations), and a peer that opens the name checks the
    owner, the mode and the token before using it: a file that is not this job's is refused.
    The name is unlinked once every peer mapped it; it carries its creator's pid (and pid
    namespace), so that the name of one whose creator was killed before that (a peer died
    during the heap's rendezvous and the launcher stopped the rest) is removed by the next
    segment made on the machine (``_remove_dead_creators_segments``).
    """

    TOKEN_BYTES = 16

    def __init__(self, path: str, nbytes: int, create: bool):
        flags = os.O_RDWR | os.O_NOFOLLOW | ((os.O_CREAT | os.O_EXCL) if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            else:
                info = os.fstat(fd)
                if info.st_size != nbytes or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                    raise ValueError(f"tdist: shared-memory segment {path} is not this job's "
                                     f"(size, owner or mode differ)")
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path = path
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> "ShmSegment":
        _remove_dead_creators_segments()
        path = os.path.join(SHM_DIR, f"tdist-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(16)}")
        try:
            segment = cls(path, nbytes, create=True)
        except BaseException:
            _unlink(path)
            raise
        token = secrets.token_bytes(cls.TOKEN_BYTES)
        segment.bytes[:cls.TOKEN_BYTES] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
        segment.handle = os.path.basename(path).encode() + b":" + token.hex().encode()
        return segment

    @classmethod
    def open(cls, handle: bytes, nbytes: int, device: torch.device) -> "ShmSegment":
        name, _, token = handle.decode().partition(":")
        segment = cls(os.path.join(SHM_DIR, name), nbytes, create=False)
        if bytes(segment.bytes[:cls.TOKEN_BYTES].tolist()).hex() != token:
            segment.close()
            raise ValueError(f"tdist: shared-memory segment {name} does not carry this job's token")
        return segment

    def all_peers_mapped(self):
        _unlink(self.path)  # nothing stays in /dev/shm, whatever happens to the job later

    @staticmethod
    def forget(handle: bytes):
        """Remove the name of a peer's segment (its handle) from /dev/shm."""
        name = handle.decode().partition(":")[0]
        if SEGMENT_NAME.fullmatch(name):
            _unlink(os.path.join(SHM_DIR, name))

    def close(self):
        self.bytes = None
        try:
            self._map.close()
        except BufferError:
            pass  # views handed out still hold it; the mapping goes with the last of them


# what ShmSegment names its segments: tdist-<creator's pid namespace>-<creator's pid>-<random>
SEGMENT_NAME = re.compile(r"tdist-(\d+)-(\d+)-[0-9a-f]{32}")


def shm_segment_names() -> set[str]:
    """The tdist segments now named in /dev/shm. Each is unlinked as soon as every peer mapped
    it, so none should stay between calls, after an error, or after a process exits."""
    return {name for name in os.listdir(SHM_DIR) if SEGMENT_NAME.fullmatch(name)}


def is_segment_mapping(line: str) -> bool:
    """Whether a line of /proc/<pid>/maps maps a tdist segment (named or already unlinked);
    other files whose path merely contains ``tdist-`` (a library of an environment in a folder
    so named) are not segments."""
    path = line.rstrip("\n").split(None, 5)[5:]
    if not path:
        return False
    path = path[0].removesuffix(" (deleted)")
    return os.path.dirname(path) == SHM_DIR and bool(SEGMENT_NAME.fullmatch(os.path.basename(path)))


def mapped_segments(maps: str = "/proc/self/maps") -> int:
    """How many mappings of tdist segments the process of ``maps`` holds."""
    with open(maps) as f:
        return sum(1 for line in f if is_segment_mapping(line))


def _pid_namespace() -> int:
    """This process's pid namespace (its inode): pids name processes only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _remove_dead_creators_segments():
    """Unlinks the segment names of this user whose creator, in this pid namespace, is gone
    (no peer can be waiting to map them: their heap's rendezvous ended with the creator)."""
    namespace = _pid_namespace()
    for name in shm_segment_names():
        match = SEGMENT_NAME.fullmatch(name)
        if int(match.group(1)) != namespace or not namespace:
            continue
        try:
            os.kill(int(match.group(2)), 0)
            continue  # alive (or its pid reused: left alone)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid == os.geteuid():
                os.unlink(path)
        except OSError:
            pass  # gone already, or not ours to remove


def _unlink(path: str):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmTransport(Transport):
    """POSIX shared memory for CPU tensors (the Triton interpreter reads peers through it)."""

    name = "shm"
    device_types = ("cpu",)
    segment_type = ShmSegment

    def check_available(self, device_type: str, heap_bytes: int | None = None):
        super().check_available(device_type, heap_bytes)
        if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)):
            raise TransportUnavailable(
                f"tdist: transport 'shm' cannot start: {SHM_DIR} is missing or not writable by "
                f"this user; mount a tmpfs there (in a container: --shm-size or a /dev/shm volume)")

    def forget(self, handle: bytes):
        ShmSegment.forget(handle)
