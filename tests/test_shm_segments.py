"""Shared-memory segments: only this job's segment is attached (owner, mode and token checked)."""

import os

import pytest
import torch

from torch_tdist.heap import _ShmSegment

CPU = torch.device("cpu")


@pytest.fixture
def segment():
    seg = _ShmSegment.create(1 << 16, CPU)
    yield seg
    seg.all_peers_mapped()
    seg.close()


def test_a_peer_attaches_with_the_handle(segment):
    assert oct(os.stat(segment.path).st_mode & 0o777) == oct(0o600)
    peer = _ShmSegment.open(segment.handle, 1 << 16, CPU)
    data = torch.randint(0, 255, (100,), dtype=torch.uint8)
    segment.bytes[1000:1100] = data
    assert torch.equal(peer.bytes[1000:1100], data), "the peer does not see the owner's bytes"
    peer.close()


def test_a_wrong_token_is_refused(segment):
    name, _, token = segment.handle.decode().partition(":")
    forged = f"{name}:{'0' * len(token)}".encode()
    with pytest.raises(ValueError, match="token"):
        _ShmSegment.open(forged, 1 << 16, CPU)


def test_a_segment_others_can_read_is_refused(segment):
    os.chmod(segment.path, 0o644)
    with pytest.raises(ValueError, match="not this job's"):
        _ShmSegment.open(segment.handle, 1 << 16, CPU)


def test_a_segment_of_another_size_is_refused(segment):
    with pytest.raises(ValueError, match="not this job's"):
        _ShmSegment.open(segment.handle, 1 << 15, CPU)
