"""Build and install torch-tdist.

Install into an environment that already has torch (the extension is built
against it):

    pip install --no-build-isolation -e .

The C++ backend (csrc/*.cpp) is always built. Sources under csrc/cuda/ are
added, as a CUDAExtension, only when torch has CUDA and a CUDA toolkit is
found (CUDA_HOME); set TDIST_NO_CUDA=1 to build the CPU part only.
"""

import glob
import os
import subprocess

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
# No -std flag: torch's BuildExtension adds the standard its headers need
# (C++17 for older torch, C++20 from torch 2.10). The sources are C++17.
CXX_FLAGS = ["-O2"]
NVCC_FLAGS = ["-O2"]


def _libstdcxx_link_args():
    """Make the extension use the shared libstdc++ that torch already loaded.

    Some images ship a compiler (for Triton and Inductor) with only libstdc++.a. An extension
    linked against it carries a second, private libstdc++ whose symbols mix with the process's
    shared one at load time; the first C++ exception message built with a stream then crashes.
    When the compiler cannot find libstdc++.so itself, point it at the loaded one.
    """
    cxx = os.environ.get("CXX", "c++").split()
    try:
        found = subprocess.run(cxx + ["-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return []
    if os.path.isabs(found):
        return []
    with open("/proc/self/maps") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    if not loaded:
        return []
    link_dir = os.path.join(ROOT, "build", "shared-libstdcxx")
    os.makedirs(link_dir, exist_ok=True)
    link = os.path.join(link_dir, "libstdc++.so")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(loaded[0], link)
    return [f"-L{link_dir}"]


def _sources(pattern):
    # setuptools wants paths relative to setup.py.
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _want_cuda():
    if os.environ.get("TDIST_NO_CUDA", "0") == "1":
        return False
    return (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and bool(_sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*.cpp"))
    )


def _extension():
    sources = _sources("csrc/*.cpp")
    if _want_cuda():
        sources += _sources("csrc/cuda/*.cpp") + _sources("csrc/cuda/*.cu")
        return cpp_extension.CUDAExtension(
            "torch_tdist._C",
            sources,
            define_macros=[("TDIST_WITH_CUDA", "1")],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
            extra_link_args=_libstdcxx_link_args(),
        )
    return cpp_extension.CppExtension(
        "torch_tdist._C",
        sources,
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=_libstdcxx_link_args(),
    )


setup(
    name="torch-tdist",
    version="0.1.0",
    description="A PyTorch distributed backend whose collectives are Triton kernels over a symmetric heap",
    python_requires=">=3.10",
    packages=["torch_tdist", "torch_tdist.examples", "torch_tdist.triton_kernels"],
    package_dir={"torch_tdist.triton_kernels": "triton_kernels"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    install_requires=["torch>=2.11", "triton>=3.6", "numpy"],
    extras_require={"test": ["pytest", "pytest-timeout"]},
    zip_safe=False,
)
