"""The built extension shares the process's libstdc++ (see setup.py: _libstdcxx_link_args).

A private static copy mixes with torch's shared one and crashes on the first C++ error message
(found on the GPU image, whose compiler ships only libstdc++.a). The extension's HIP code paths
compile against HIP's headers where those are installed.
"""

import os
import shutil
import subprocess

import pytest

import torch_tdist._C as ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_extension_links_the_shared_libstdcxx():
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run(["readelf", "-d", ext.__file__], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert any(name.startswith("libstdc++.so") for name in needed), needed
    symbols = subprocess.run(["readelf", "--dyn-syms", "-W", ext.__file__], capture_output=True, text=True,
                             check=True).stdout
    private_streams = [line for line in symbols.splitlines() if "_ZNSo9_M_insert" in line and " UND " not in line]
    assert not private_streams, private_streams[:3]


# ---- the HIP code paths, compiled against HIP's headers (no ROCm torch can be installed here) ---

HIP_HEADER_DIRS = ("/opt/rocm/include", "/usr/include")  # (ROCm's install, Debian's libamdhip64-dev)


def _hip_include_dir():
    for root in HIP_HEADER_DIRS:
        if os.path.exists(os.path.join(root, "hip", "hip_runtime_api.h")):
            return root
    return None


def _syntax_check(source, *include_dirs):
    """``source`` compiles as BuildExtension compiles it against a ROCm torch (USE_ROCM)."""
    from torch.utils import cpp_extension

    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler here")
    command = [compiler, "-std=c++20", "-fsyntax-only", "-D__HIP_PLATFORM_AMD__=1", "-DUSE_ROCM=1",
               *(f"-I{d}" for d in (*include_dirs, *cpp_extension.include_paths())), source]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]


def test_the_device_shim_hip_branch_compiles_against_hips_headers():
    include = _hip_include_dir()
    if include is None:
        pytest.skip("HIP's headers are not installed (Debian: apt-get install libamdhip64-dev)")
    _syntax_check("csrc/device_shim.cpp", include)


def test_the_rocshmem_bootstrap_compiles_against_rocshmems_header():
    include = _hip_include_dir()
    if include is None or not os.path.exists(os.path.join(include, "rocshmem", "rocshmem.hpp")):
        pytest.skip("HIP's and ROCSHMEM's headers are not installed (a ROCm install with rocSHMEM)")
    _syntax_check("csrc/rocshmem_bootstrap.cpp", include)
