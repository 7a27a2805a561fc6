"""Jobs for test_readme.py: the README's kernel example, run as written."""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile

import torch

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _load_example():
    """Import the README's ``<!-- example -->`` code block as a module (kernels need a file)."""
    text = open(README).read()
    code = re.search(r"<!-- example -->\s*```python\n(.*?)```", text, re.S).group(1)
    path = os.path.join(tempfile.mkdtemp(prefix="tdist-readme-"), "readme_example.py")
    with open(path, "w") as f:
        f.write(code)
    spec = importlib.util.spec_from_file_location("readme_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ring_shift_example(rank, ws, seed):
    example = _load_example()
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(seed + r)) for r in range(ws)]
    got = example.shift_right(xs[rank])
    assert torch.equal(got, xs[(rank - 1) % ws]), "shift_right did not deliver the left neighbour's data"
