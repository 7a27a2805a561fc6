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


def ops_example(rank, ws, seed):
    """The README's torch_tdist.ops block, run as written on the default group, checked against
    a Gloo all_gather and torch.matmul."""
    import torch.distributed as dist

    code = re.search(r"<!-- ops example -->\s*```python\n(.*?)```", open(README).read(), re.S).group(1)
    torch.manual_seed(seed + rank)
    names = {"torch": torch}
    exec("import torch_tdist\n" + code, names)
    a_shard, w, h, y = (names[k].detach() for k in ("a_shard", "w", "h", "y"))
    gloo = dist.new_group(backend="gloo")
    parts = [torch.empty_like(a_shard) for _ in range(ws)]
    dist.all_gather(parts, a_shard, group=gloo)
    a_full = torch.cat(parts)
    assert torch.allclose(h, a_full @ w, rtol=1e-4, atol=1e-3), "h != all_gather(a_shard) @ w"
    ws_all = [torch.empty_like(w) for _ in range(ws)]
    dist.all_gather(ws_all, w, group=gloo)
    total = sum((a_full @ wr) @ wr.t() for wr in ws_all)  # every rank's h @ w^T
    assert torch.allclose(y, total.chunk(ws)[rank], rtol=1e-4, atol=1e-2), "y != rows of sum(h @ w^T)"
    assert names["a_shard"].grad is not None and names["w"].grad is not None
