"""Symmetric-heap transports behind one interface: the registry, the shm transport across real
processes, and the errors a transport that cannot start raises when the group is created.

The registry and error tests run over every transport, ``hip`` (HIP IPC, AMD) included. For
``hip`` they cover its host logic: which build of PyTorch it serves and the ``auto`` choice, its
checks at group creation (package, GPU, architecture, heap size), its segment handles passed
through the store between real processes and what a peer refuses before mapping one, and the
refusal of a group mixing ROCm and CUDA builds (at group creation and at the heap). They do not cover its calls into the HIP
runtime (``transports/hip_device.py``: allocation, IPC open and close, host-page mapping, stream
calls), which need an AMD GPU: none has run them. Where a test needs torch to report a ROCm
build or a GPU that this machine lacks, its fixture says so, and the test checks only what tdist
decides from that report.
"""

import importlib.util
import os
import socket
import types

import pytest
import torch

from tests import jobs_transports as J
from tests.common import rank_gen
from tests.helpers import ws_param
from tests.multiproc import PoolStartError, RankPool, backend_under_test
from torch_tdist import heap, transports
from torch_tdist import language
from torch_tdist.transports import cuda_device, hip_device, hip_ipc, nvshmem, shm


def _has_cuda_python() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:  # (no "cuda" package at all)
        return False


HAS_CUDA_PYTHON = _has_cuda_python()
HAS_HIP_PYTHON = importlib.util.find_spec("hip") is not None
ROCM_INSTALL = 'pip install -e ".[rocm]"'


def test_the_registry_names_every_transport_and_resolves_auto():
    assert transports.names() == ("shm", "cuda", "nvshmem", "hip", "rocshmem")
    assert heap.TRANSPORTS == ("auto", "shm", "cuda", "nvshmem", "hip", "rocshmem")
    for name in transports.names():
        transport = transports.get(name)
        assert isinstance(transport, transports.Transport) and transport.name == name
        assert transports.get(name) is transport
    assert transports.get("shm").device_types == ("cpu",)
    assert transports.get("hip").device_types == ("cuda",)  # (a ROCm torch's GPUs are "cuda" devices)
    assert transports.get("nvshmem").collective and not transports.get("cuda").collective
    assert transports.get("rocshmem").collective and not transports.get("hip").collective
    assert transports.resolve("auto", "cpu") == "shm"
    assert transports.resolve("auto", "cuda") == "cuda"
    assert transports.resolve("auto", "cuda", spans_nodes=True) == "nvshmem"
    assert transports.resolve("nvshmem", "cuda") == "nvshmem"
    with pytest.raises(ValueError, match="unknown transport 'bogus'.*auto, shm, cuda, nvshmem, hip, rocshmem"):
        transports.get("bogus")
    with pytest.raises(ValueError, match="no symmetric-heap transport for meta tensors"):
        transports.resolve("auto", "meta")
    assert transports.stream_ops("cpu") is None
    assert transports.stream_ops("cuda") is cuda_device.STREAM_OPS


@pytest.fixture
def a_rocm_torch(monkeypatch):
    """torch reports a ROCm build (this one is not): ``torch.version.hip`` set."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.version, "cuda", None)


def test_a_rocm_build_picks_hip_and_refuses_the_cuda_transports(a_rocm_torch):
    assert transports.gpu_build() == "rocm"
    assert transports.resolve("auto", "cuda") == "hip"
    assert transports.resolve("auto", "cuda", spans_nodes=True) == "rocshmem"
    assert transports.resolve("auto", "cpu") == "shm"
    assert transports.resolve("hip", "cuda") == "hip"
    assert transports.stream_ops("cuda") is hip_device.STREAM_OPS
    for name in ("cuda", "nvshmem"):
        for refuse in (lambda: transports.resolve(name, "cuda"), lambda: transports.check_available(name, "cuda")):
            with pytest.raises(ValueError) as info:
                refuse()
            for words in (f"transport '{name}' cannot serve cuda tensors of a ROCm build of PyTorch",
                          "6.4.43482", "use hip"):
                assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_hip_on_a_torch_that_is_not_a_rocm_build_names_the_build_and_the_extra(device_type):
    assert transports.gpu_build() == "cuda"
    for refuse in (lambda: transports.resolve("hip", device_type), lambda: transports.check_available("hip", device_type),
                   lambda: transports.get("hip").check_available(device_type)):
        with pytest.raises(transports.TransportUnavailable) as info:
            refuse()
        for words in ("transport 'hip' cannot start", "a ROCm build of PyTorch", torch.__version__, ROCM_INSTALL):
            assert words in str(info.value), str(info.value)


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


# what each GPU transport raises on this machine (no GPU, a CPU-only torch)
WITHOUT_A_GPU = {
    "cuda": (ValueError, ["cannot serve cpu tensors", "no CUDA device", "use shm"]),
    "nvshmem": (ValueError, ["cannot serve cpu tensors", "no CUDA device", "use shm"]),
    "hip": (transports.TransportUnavailable, ["cannot start", "a ROCm build of PyTorch", ROCM_INSTALL]),
}


@pytest.mark.tdist_only
@pytest.mark.parametrize("transport", list(WITHOUT_A_GPU))
def test_a_gpu_transport_on_a_machine_without_a_gpu_raises_at_init_process_group(transport):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    error, words_of_it = WITHOUT_A_GPU[transport]
    for err in _refused_at_init({"TDIST_TRANSPORT": transport}):
        assert err.isinstance_of(error), f"{err.type_name}: {err.message}"
        for words in [f"transport '{transport}'"] + words_of_it:
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
    pool2.run_expect_error(J.new_group_with_transport, "hip", exc_types=transports.TransportUnavailable,
                           match=["transport 'hip' cannot start", "a ROCm build of PyTorch", ROCM_INSTALL],
                           max_seconds=20)
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


@pytest.fixture
def an_amd_gpu_here(a_rocm_torch, monkeypatch):
    """torch, a ROCm build, sees an MI300X with 80 GB free (this machine has neither)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(hip_device, "free_memory", lambda device_index=None: 80 << 30)
    monkeypatch.setattr(hip_device, "gpu_arch", lambda device_index=None: "gfx942:sramecc+:xnack-")


# per build of PyTorch: the GPU it sees, the package its transports need and how to install it
GPU_OF_BUILD = {"cuda": ("a_gpu_here", "cuda-python", 'pip install "torch-tdist[cuda]"', HAS_CUDA_PYTHON),
                "rocm": ("an_amd_gpu_here", "hip-python", ROCM_INSTALL, HAS_HIP_PYTHON)}


@pytest.mark.parametrize("build, transport, chosen", [
    ("cuda", "cuda", "cuda"), ("cuda", "nvshmem", "nvshmem"), ("cuda", "auto", "cuda"),
    ("rocm", "hip", "hip"), ("rocm", "auto", "hip")])
def test_a_gpu_without_its_python_package_names_the_package(request, build, transport, chosen):
    gpu, package, install, installed = GPU_OF_BUILD[build]
    if installed:
        pytest.skip(f"{package} is installed here")
    request.getfixturevalue(gpu)
    with pytest.raises(transports.TransportUnavailable) as info:
        transports.check_available(transport, "cuda")
    message = str(info.value)
    for words in (f"transport '{chosen}' cannot start", package, install):
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


@pytest.mark.parametrize("build, transport", [("cuda", "cuda"), ("cuda", "nvshmem"), ("rocm", "hip")])
def test_a_heap_larger_than_the_gpu_is_refused_before_anything_is_allocated(request, monkeypatch, build, transport):
    request.getfixturevalue(GPU_OF_BUILD[build][0])
    monkeypatch.setattr(cuda_device, "require", lambda transport: None)
    monkeypatch.setattr(hip_device, "require", lambda transport: None)
    monkeypatch.setattr(nvshmem, "host_library", lambda: "libc.so.6")  # (any library that loads)
    transports.check_available(transport, "cuda", 1 << 30)
    transports.check_available(transport, "cuda")  # (the default heap)
    with pytest.raises(transports.TransportUnavailable) as info:
        transports.check_available(transport, "cuda", 81 << 30)
    message = str(info.value)
    for words in (f"transport '{transport}' cannot start", str(81 << 30), "TDIST_HEAP_SIZE"):
        assert words in message, message


@pytest.mark.parametrize("transport", ["hip", "auto"])
def test_an_amd_gpu_the_kernels_are_not_built_for_is_refused_naming_its_architecture(an_amd_gpu_here, monkeypatch,
                                                                                      transport):
    monkeypatch.setattr(hip_device, "require", lambda transport: None)
    for arch in ("gfx942:sramecc+:xnack-", "gfx950", "gfx950:sramecc+:xnack+"):
        monkeypatch.setattr(hip_device, "gpu_arch", lambda device_index=None: arch)
        transports.check_available(transport, "cuda", 1 << 30)
    for arch in ("gfx90a:sramecc+:xnack-", "gfx1100", "gfx9420"):
        monkeypatch.setattr(hip_device, "gpu_arch", lambda device_index=None: arch)
        with pytest.raises(ValueError) as info:
            transports.check_available(transport, "cuda", 1 << 30)
        message = str(info.value)
        for words in (arch.split(":")[0], *language.AMD_ARCHS):
            assert words in message, message


def test_hip_handles_carry_what_a_peer_checks_before_mapping():
    ipc = bytes(range(7, 7 + hip_ipc.IPC_HANDLE_BYTES))
    handle = hip_ipc.pack_handle(ipc, 1 << 20)
    assert handle.startswith(hip_ipc.TAG) and hip_ipc.unpack_handle(handle, 1 << 20) == ipc
    with pytest.raises(ValueError, match="a HIP IPC handle has 64 bytes, not 63"):
        hip_ipc.pack_handle(ipc[1:], 1 << 20)
    refused = {
        "not one of the hip transport (10 bytes": b"tdisthip..",
        f"not one of the hip transport ({len(handle) - 1} bytes": handle[:-1],
        "not one of the hip transport (": b"cuda" + handle[4:],
        "has 4096 bytes and this rank's heap 1048576; every rank must use the same TDIST_HEAP_SIZE":
            hip_ipc.pack_handle(ipc, 4096),
        "is on host 'node-b', this rank on 'node-a'; HIP IPC maps the GPUs of one node":
            hip_ipc.pack_handle(ipc, 1 << 20, host="node-b"),
    }
    for words, bad in refused.items():
        with pytest.raises(ValueError) as info:
            hip_ipc.unpack_handle(bad, 1 << 20, host="node-a")
        assert "transport 'hip'" in str(info.value) and words in str(info.value), str(info.value)


def test_without_an_amd_gpu_each_hip_call_reaches_the_runtime_and_fails_naming_the_call():
    """With hip-python and HIP's runtime library but no AMD GPU (the runtime says so itself),
    every call of ``hip_device`` goes through hip-python's bindings (names, arguments and result
    tuples as tdist uses them) to the runtime, and fails naming the call. What the calls do on a
    GPU is not checked here."""
    if not HAS_HIP_PYTHON:
        pytest.skip("hip-python is not installed here")
    try:
        hip_device.require("hip")
    except transports.TransportUnavailable as err:
        pytest.skip(str(err))
    from hip import hip

    err, count = hip.hipGetDeviceCount()
    if err == hip.hipError_t.hipSuccess and count > 0:
        pytest.skip("HIP sees an AMD GPU here")
    gpu, ops = torch.device("cuda", 0), hip_device.STREAM_OPS
    stream = ops.stream(types.SimpleNamespace(cuda_stream=0))  # (the null stream)
    calls = {
        "hipSetDevice": [lambda: hip_device.malloc(1 << 20, gpu), lambda: hip_device.ipc_handle(4096, gpu),
                         lambda: hip_device.open_ipc_handle(bytes(hip_ipc.IPC_HANDLE_BYTES), gpu),
                         lambda: hip_device.map_host_page(4096, 4096, gpu)],
        "hipEventCreateWithFlags": [ops.event],
        "hipEventRecord": [lambda: ops.wait_after(stream, stream, hip.ihipEvent_t.fromObj(0))],
        "hipMemcpyAsync": [lambda: ops.copy(stream, 4096, 8192, 64)],
        "hipMemsetD32Async": [lambda: ops.zero32(stream, 4096, 16)],
        "hipStreamWriteValue64": [lambda: ops.write_value(stream, 4096, -1)],
    }
    for call, attempts in calls.items():
        for attempt in attempts:
            with pytest.raises(RuntimeError, match=f"tdist: {call} failed: "):
                attempt()


@pytest.mark.tdist_only
@ws_param([2, 3])
def test_hip_handles_pass_through_the_store_in_rank_order_and_bad_ones_are_refused(pool, world_size, seed):
    nbytes = 1 << 16
    results = pool.run(J.hip_handles_through_the_store, seed, nbytes)
    expected = [bytes(torch.randint(0, 256, (hip_ipc.IPC_HANDLE_BYTES,), dtype=torch.uint8,
                                    generator=rank_gen(seed, peer)).tolist()) for peer in range(world_size)]
    for rank, r in enumerate(results):
        assert r["unpacked"] == expected, f"rank {rank}: the peers' IPC handles came back wrong or out of rank order"
        assert f"has {2 * nbytes} bytes and this rank's heap {nbytes}" in r["refused"].get("larger", ""), r
        assert "not one of the hip transport" in r["refused"].get("shm", ""), r


@pytest.mark.tdist_only
def test_a_group_mixing_rocm_and_cuda_builds_is_refused_naming_the_ranks(pool3, seed):
    assert pool3.run(J.gpu_hosts_with_builds, seed, []) == [[socket.gethostname()] * 3] * 3
    assert pool3.run(J.gpu_hosts_with_builds, seed, [0, 1, 2]) == [[socket.gethostname()] * 3] * 3
    pool3.run_expect_error(J.gpu_hosts_with_builds, seed, [1], exc_types=ValueError,
                           match=["a group's GPUs must be all AMD or all NVIDIA",
                                  "ranks [0, 2] run a CUDA build", "ranks [1] run a ROCm build"], max_seconds=20)


def test_shm_without_dev_shm_says_so(monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", "/nonexistent/shm")
    with pytest.raises(transports.TransportUnavailable, match="transport 'shm' cannot start: /nonexistent/shm"):
        transports.check_available("auto", "cpu")
    monkeypatch.undo()
    transports.check_available("shm", "cpu", 1 << 40)  # (sparse: a large heap is fine)
