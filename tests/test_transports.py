"""Symmetric-heap transports behind one interface: the registry, the shm transport across real
processes, and the errors a transport that cannot start raises when the group is created."""

import importlib.util
import os

import pytest
import torch

from tests import jobs_transports as J
from tests.helpers import ws_param
from tests.multiproc import PoolStartError, RankPool, backend_under_test
from torch_tdist import heap, transports
from torch_tdist.transports import cuda_device, nvshmem, shm


def _has_cuda_python() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:  # (no "cuda" package at all)
        return False


HAS_CUDA_PYTHON = _has_cuda_python()


def test_the_registry_names_every_transport_and_resolves_auto():
    assert transports.names() == ("shm", "cuda", "nvshmem")
    assert heap.TRANSPORTS == ("auto", "shm", "cuda", "nvshmem")
    for name in transports.names():
        transport = transports.get(name)
        assert isinstance(transport, transports.Transport) and transport.name == name
        assert transports.get(name) is transport
    assert transports.get("shm").device_types == ("cpu",)
    assert transports.get("nvshmem").collective and not transports.get("cuda").collective
    assert transports.resolve("auto", "cpu") == "shm"
    assert transports.resolve("auto", "cuda") == "cuda"
    assert transports.resolve("auto", "cuda", spans_nodes=True) == "nvshmem"
    assert transports.resolve("nvshmem", "cuda") == "nvshmem"
    with pytest.raises(ValueError, match="unknown transport 'bogus'.*auto, shm, cuda, nvshmem"):
        transports.get("bogus")
    with pytest.raises(ValueError, match="no symmetric-heap transport for meta tensors"):
        transports.resolve("auto", "meta")
    assert transports.stream_ops("cpu") is None
    assert transports.stream_ops("cuda") is cuda_device.STREAM_OPS


@pytest.mark.tdist_only
@ws_param([2, 3])
@pytest.mark.parametrize("nbytes", [1 << 16, 3 * 4096 + 512], ids=["64K", "12.5K"])
def test_shm_segments_through_the_interface(pool, world_size, seed, nbytes):
    before = shm.shm_segment_names()
    results = pool.run(J.shm_segments_through_the_interface, seed, nbytes)
    for rank, r in enumerate(results):
        assert r["wrong_peers"] == [], f"rank {rank}: read wrong bytes of peers {r['wrong_peers']}"
        assert r["peer_write_seen"], f"rank {rank}: a peer's write to its segment did not land"
        assert r["named_after_forget"] == [] and r["still_named"] == [], f"rank {rank}: {r}"
        assert r["mapped_while_open"] == world_size, f"rank {rank}: {r['mapped_while_open']} mappings"
        assert r["mapped_after_close"] == 0, f"rank {rank}: {r['mapped_after_close']} mappings after close"
        assert r["host_page"] == 4096 * 7 and r["stream_ops"] is None, f"rank {rank}: {r}"
    assert not shm.shm_segment_names() - before, "segments left in /dev/shm"


def test_segment_mappings_are_told_from_files_that_merely_contain_tdist_in_their_path():
    name = f"tdist-4026531836-{os.getpid()}-{'0123456789abcdef' * 2}"
    lines = [
        f"7f0000000000-7f0000100000 rw-s 00000000 00:1a 123  /dev/shm/{name} (deleted)\n",
        f"7f0000000000-7f0000100000 rw-s 00000000 00:1a 123  /dev/shm/{name}\n",
        "7f0000000000-7f0000100000 r-xp 00000000 08:01 456  /tmp/tdist-venv x/lib/python3/torch/lib/libtorch.so\n",
        "7f0000000000-7f0000100000 r-xp 00000000 08:01 456  /opt/tdist-1-2-3/libfoo.so\n",
        "7f0000000000-7f0000100000 rw-s 00000000 00:1a 789  /dev/shm/tdist-not-a-segment\n",
        "7f0000000000-7f0000100000 rw-p 00000000 00:00 0\n",
    ]
    assert [shm.is_segment_mapping(line) for line in lines] == [True, True, False, False, False, False]


# ---- errors at group creation -------------------------------------------------------------------

def _refused_at_init(env: dict) -> list:
    """Start a 2-rank pool with ``env``: init_process_group must raise, and no rank may get
    past it; returns the errors the ranks reported (a rank still importing when the pool gives
    up, 10 s after the first error, reports none)."""
    pool = RankPool(2, backend_under_test(), env=env, start_timeout=120, name=f"RankPool(ws=2, {env})")
    try:
        with pytest.raises(PoolStartError) as info:
            pool.start()
    finally:
        pool.shutdown()
    replies = info.value.replies
    assert "ready" not in replies, f"init_process_group did not raise on every rank: {info.value}"
    errors = [err for err in replies if err is not None]
    assert errors, str(info.value)
    for err in errors:
        assert err.phase == "init_process_group", f"raised during {err.phase}: {err.message}"
    return errors


@pytest.mark.tdist_only
@pytest.mark.parametrize("transport", ["cuda", "nvshmem"])
def test_a_gpu_transport_on_a_machine_without_cuda_raises_at_init_process_group(transport):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for err in _refused_at_init({"TDIST_TRANSPORT": transport}):
        assert err.isinstance_of(ValueError), f"{err.type_name}: {err.message}"
        for words in (f"transport '{transport}'", "cannot serve cpu tensors", "no CUDA device", "use shm"):
            assert words in err.message, f"{words!r} not in {err.message}"


@pytest.mark.tdist_only
def test_an_unknown_transport_raises_at_init_process_group():
    for err in _refused_at_init({"TDIST_TRANSPORT": "infiniband"}):
        assert err.isinstance_of(ValueError) and "unknown transport 'infiniband'" in err.message, \
            f"{err.type_name}: {err.message}"


@pytest.mark.tdist_only
def test_new_group_raises_for_a_transport_that_cannot_start_and_the_pool_goes_on(pool2, seed):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    pool2.run_expect_error(J.new_group_with_transport, "cuda", exc_types=ValueError,
                           match=["transport 'cuda' cannot serve cpu tensors", "use shm"], max_seconds=20)
    pool2.run_expect_error(J.new_group_with_transport, "bogus", exc_types=ValueError,
                           match=["unknown transport 'bogus'"], max_seconds=20)
    if not HAS_CUDA_PYTHON:
        pool2.run_expect_error(J.new_group_as_on_a_gpu_without_cuda_python, exc_types=RuntimeError,
                               match=["transport 'cuda' cannot start", "cuda-python",
                                      'pip install "torch-tdist[cuda]"'], max_seconds=20)
    assert pool2.run(J.all_reduce_on_a_new_group, seed) == [True, True]


# ---- each transport's own checks, in this process ----------------------------------------------

@pytest.fixture
def a_gpu_here(monkeypatch):
    """torch sees a GPU of 80 GB (this machine has none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_device, "total_memory", lambda device_index=None: 80 << 30)


@pytest.mark.skipif(HAS_CUDA_PYTHON, reason="cuda-python is installed here")
@pytest.mark.parametrize("transport", ["cuda", "nvshmem", "auto"])
def test_a_gpu_without_cuda_python_names_the_package(a_gpu_here, transport):
    with pytest.raises(transports.TransportUnavailable) as info:
        transports.check_available(transport, "cuda")
    message = str(info.value)
    chosen = "cuda" if transport == "auto" else transport
    for words in (f"transport '{chosen}' cannot start", "cuda-python", 'pip install "torch-tdist[cuda]"'):
        assert words in message, message


def test_nvshmem_without_its_host_library_names_the_wheel(a_gpu_here, monkeypatch):
    monkeypatch.setattr(cuda_device, "require", lambda transport: None)
    monkeypatch.setattr(nvshmem, "host_library", lambda: "/nonexistent/libnvshmem_host.so.3")
    with pytest.raises(transports.TransportUnavailable) as info:
        transports.check_available("nvshmem", "cuda")
    message = str(info.value)
    for words in ("transport 'nvshmem' cannot start", "/nonexistent/libnvshmem_host.so.3",
                  "nvidia-nvshmem-cu13", 'pip install "torch-tdist[cuda]"', "TDIST_TRANSPORT=cuda"):
        assert words in message, message


@pytest.mark.parametrize("transport", ["cuda", "nvshmem"])
def test_a_heap_larger_than_the_gpu_is_refused_before_anything_is_allocated(a_gpu_here, monkeypatch, transport):
    monkeypatch.setattr(cuda_device, "require", lambda transport: None)
    monkeypatch.setattr(nvshmem, "host_library", lambda: "libc.so.6")  # (any library that loads)
    transports.check_available(transport, "cuda", 1 << 30)
    transports.check_available(transport, "cuda")  # (the default heap)
    with pytest.raises(transports.TransportUnavailable) as info:
        transports.check_available(transport, "cuda", 81 << 30)
    message = str(info.value)
    for words in (f"transport '{transport}' cannot start", str(81 << 30), "TDIST_HEAP_SIZE"):
        assert words in message, message


def test_shm_without_dev_shm_says_so(monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", "/nonexistent/shm")
    with pytest.raises(transports.TransportUnavailable, match="transport 'shm' cannot start: /nonexistent/shm"):
        transports.check_available("auto", "cpu")
    monkeypatch.undo()
    transports.check_available("shm", "cpu", 1 << 40)  # (sparse: a large heap is fine)
