"""The built extension shares the process's libstdc++ (see setup.py: _libstdcxx_link_args).

A private static copy mixes with torch's shared one and crashes on the first C++ error message
(found on the GPU image, whose compiler ships only libstdc++.a).
"""

import shutil
import subprocess

import pytest

import torch_tdist._C as ext


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
