"""Shared-memory segments: only this job's segment is attached (owner, mode and token checked)."""

import os
import subprocess
import sys

import pytest
import torch

from torch_tdist.transports.shm import ShmSegment

CPU = torch.device("cpu")


@pytest.fixture
def segment():
    seg = ShmSegment.create(1 << 16, CPU)
    yield seg
    seg.all_peers_mapped()
    seg.close()


def test_a_peer_attaches_with_the_handle(segment):
    assert oct(os.stat(segment.path).st_mode & 0o777) == oct(0o600)
    peer = ShmSegment.open(segment.handle, 1 << 16, CPU)
    data = torch.randint(0, 255, (100,), dtype=torch.uint8)
    segment.bytes[1000:1100] = data
    assert torch.equal(peer.bytes[1000:1100], data), "the peer does not see the owner's bytes"
    peer.close()


def test_a_wrong_token_is_refused(segment):
    name, _, token = segment.handle.decode().partition(":")
    forged = f"{name}:{'0' * len(token)}".encode()
    with pytest.raises(ValueError, match="token"):
        ShmSegment.open(forged, 1 << 16, CPU)


def test_a_segment_others_can_read_is_refused(segment):
    os.chmod(segment.path, 0o644)
    with pytest.raises(ValueError, match="not this job's"):
        ShmSegment.open(segment.handle, 1 << 16, CPU)


def test_a_segment_of_another_size_is_refused(segment):
    with pytest.raises(ValueError, match="not this job's"):
        ShmSegment.open(segment.handle, 1 << 15, CPU)


def test_the_name_of_a_segment_whose_creator_died_is_removed_by_the_next_one_made():
    """A rank killed after making its segment and before every peer mapped it (a peer died
    during the heap's rendezvous, the launcher stopped the rest) leaves its name in /dev/shm:
    the next segment made on the machine removes it, and leaves a live creator's alone."""
    make_and_die = ("import os, signal, torch; from torch_tdist.transports.shm import ShmSegment; "
                    "print(ShmSegment.create(1 << 16, torch.device('cpu')).path, flush=True); "
                    "os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", make_and_die], capture_output=True, text=True, timeout=120)
    dead = proc.stdout.strip()
    assert proc.returncode == -9 and os.path.exists(dead), (proc.returncode, dead, proc.stderr[-2000:])
    made = [ShmSegment.create(1 << 16, CPU)]
    try:
        assert not os.path.exists(dead), "the dead creator's segment is still named"
        made.append(ShmSegment.create(1 << 16, CPU))
        assert os.path.exists(made[0].path), "a live creator's segment was removed"
    finally:
        if os.path.exists(dead):
            os.unlink(dead)
        for seg in made:
            seg.all_peers_mapped()
            seg.close()
