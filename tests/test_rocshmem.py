"""The rocshmem transport where it cannot start (no ROCm torch, or an extension built without
ROCSHMEM), and the ROCSHMEM device functions behind torch_tdist.shmem_device compiled for AMD
GPUs (no AMD GPU here: the calls are compiled, not run; linking librocshmem_device.bc and
running them needs a ROCm machine)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_tdist import language, shmem_device, transports
from torch_tdist.transports import cuda_device, rocshmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def a_gpu_here(monkeypatch):
    """torch sees a GPU of 80 GB (this machine has none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_device, "total_memory", lambda device_index=None: 80 << 30)


def _refusal(transport="rocshmem") -> str:
    with pytest.raises(transports.TransportUnavailable) as info:
        transports.check_available(transport, "cuda")
    return str(info.value)


def test_rocshmem_on_a_cuda_torch_names_what_is_missing_and_the_build_option(a_gpu_here, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    message = _refusal()
    for words in ("transport 'rocshmem' cannot start", "not a ROCm build", "TDIST_ROCSHMEM_HOME=",
                  "TDIST_TRANSPORT=nvshmem"):
        assert words in message, message


def test_rocshmem_with_an_extension_built_without_it_names_the_build_option(a_gpu_here, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.0")
    monkeypatch.setattr(rocshmem, "_extension", lambda: None)
    message = _refusal()
    for words in ("transport 'rocshmem' cannot start", "built without ROCSHMEM",
                  "TDIST_ROCSHMEM_HOME=/opt/rocm", ".[rocm]"):
        assert words in message, message
    with pytest.raises(RuntimeError, match="librocshmem_device.bc.*TDIST_ROCSHMEM_HOME"):
        rocshmem.device_library()


def test_the_rocshmem_transport_is_collective_and_cuda_groups_still_pick_nvshmem_across_nodes():
    transport = transports.get("rocshmem")
    assert transport.name == "rocshmem" and transport.collective and transport.device_types == ("cuda",)
    assert "rocshmem" in transports.names()
    for device_type in ("cuda", "cpu"):  # (this torch is not a ROCm build: refused, naming the fix)
        with pytest.raises(transports.TransportUnavailable, match="not a ROCm build.*TDIST_TRANSPORT=nvshmem"):
            transports.resolve("rocshmem", device_type)
    assert transports.resolve("auto", "cuda", spans_nodes=True) == "nvshmem"  # (this torch is CUDA's)


def test_kernels_call_nvshmem_on_a_cuda_torch():
    assert not shmem_device.ROCSHMEM
    assert [shmem_device.symbol(c) for c in ("putmem", "putmem_signal_nbi", "wait_until", "quiet")] == [
        "nvshmemx_putmem_block", "nvshmemx_putmem_signal_nbi_block", "nvshmem_signal_wait_until",
        "nvshmem_quiet"]


# Compiles the kernel that makes every shmem_device call for each AMD architecture, in a process
# where torch reads as a ROCm build (as tests/compile_kernels.py does), and reports the device
# functions the LLVM IR calls.
_COMPILE_FOR_AMD = textwrap.dedent("""
    import json, os, re, sys
    os.environ["TDIST_INTERPRET"] = "0"
    import torch
    torch.version.hip = torch.version.hip or "compile check"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tests.compile_kernels import nvshmem_kernels
    from torch_tdist import language

    kernel, signature, constexprs = next(iter(nvshmem_kernels()))  # (every call)
    calls = {}
    for arch in language.AMD_ARCHS:
        compiled = triton.compile(ASTSource(kernel.fn, signature, constexprs=constexprs),
                                  target=GPUTarget("hip", arch, 64))
        assert compiled.asm.get("hsaco"), arch
        calls[arch] = sorted(set(re.findall(r"call \\S+ @(\\w*shmem\\w*)", compiled.asm["llir"])))
    print(json.dumps(calls))
""")


def test_every_shmem_call_compiles_to_rocshmems_device_functions_for_amd_gpus():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_AMD], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    import json

    calls = json.loads(result.stdout.strip().splitlines()[-1])
    expected = ["rocshmem_fence", "rocshmem_putmem_nbi_wg", "rocshmem_putmem_signal_nbi_wg",
                "rocshmem_putmem_signal_wg", "rocshmem_putmem_wg", "rocshmem_quiet", "rocshmem_signal_fetch",
                "rocshmem_ulong_wait_until"]
    assert calls == {arch: expected for arch in language.AMD_ARCHS}
