"""Build and install torch-tdist.

Install into an environment that already has torch (the extension is built
against it):

    pip install --no-build-isolation -e .

The C++ backend (csrc/*.cpp) is always built, as a CppExtension against torch.

On GPU machines add the extra for torch's CUDA version, which brings the packages
the CUDA transports load at run time: cuda-python (``cuda.bindings``: CUDA IPC,
host-page mapping, stream calls) and NVSHMEM's host library and device bitcode
(the ``nvidia-nvshmem`` wheel, the one torch's own symmetric memory loads):

    pip install --no-build-isolation -e ".[cuda]"     # CUDA 13 (torch 2.11+ cu13 wheels)
    pip install --no-build-isolation -e ".[cuda12]"   # CUDA 12 (torch's cu12x wheels)

Two extras rather than an environment marker: no marker can see which CUDA a
torch wheel was built for, and the NVSHMEM wheel is named after it (-cu13 or
-cu12). The bounds accept the versions torch pins (NVSHMEM 3.x, whose host
library tdist loads as libnvshmem_host.so.3).

On AMD GPUs, with a ROCm build of PyTorch, the ``rocm`` extra brings hip-python
(``from hip import hip``: HIP IPC, host-page mapping and stream calls of the
``hip`` transport). hip-python's versions follow ROCm's (6.2 onwards on PyPI);
where pip's choice does not match your ROCm, install the one that does
(pip install "hip-python~=6.4.0" for ROCm 6.4):

    pip install --no-build-isolation -e ".[rocm]"

CPU machines need none of these: a group whose transport lacks its package
raises at init_process_group / new_group, naming the extra to install.
"""

import glob
import os
import subprocess

from setuptools import setup

from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
# No -std flag: torch's BuildExtension adds the standard its headers need
# (C++17 for older torch, C++20 from torch 2.10). The sources are C++17.
CXX_FLAGS = ["-O2"]


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


def _extension():
    return cpp_extension.CppExtension(
        "torch_tdist._C",
        _sources("csrc/*.cpp"),
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=_libstdcxx_link_args(),
    )


# NVSHMEM ships Linux wheels only.
_NVSHMEM = 'nvidia-nvshmem-{}>=3.3,<4; sys_platform == "linux"'


setup(
    name="torch-tdist",
    version="0.1.0",
    description="A PyTorch distributed backend whose collectives are Triton kernels over a symmetric heap",
    python_requires=">=3.10",
    packages=["torch_tdist", "torch_tdist.collectives", "torch_tdist.examples", "torch_tdist.overlap",
              "torch_tdist.transports", "torch_tdist.triton_kernels"],
    package_dir={"torch_tdist.triton_kernels": "triton_kernels"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    install_requires=["torch>=2.11", "triton>=3.6", "numpy"],
    extras_require={
        "test": ["pytest", "pytest-timeout"],
        "cuda": ["cuda-python>=13,<14", _NVSHMEM.format("cu13")],
        "cuda12": ["cuda-python>=12.6.2,<13", _NVSHMEM.format("cu12")],
        # hip-python starts at ROCm 6.2 on PyPI; its 10.0 is a stub that names other packages
        "rocm": ["hip-python>=6.2,<8"],
    },
    zip_safe=False,
)
