"""Jobs for test_docs.py: the ```python blocks of README.md and docs/*.md, run as written on every
rank, with the result checked where the page marks the block.

Markers (an HTML comment on the line before a block's fence):
- ``<!-- not run: why -->``: not run (needs GPUs, an excerpt of a longer program, ...);
- ``<!-- example -->``: a program with kernels; imported from a file (Triton reads the kernels'
  source), then its ``shift_right`` is checked on random data;
- ``<!-- ops example -->``, ``<!-- checked: NAME -->``: run, then checked by ``CHECKS[...]``;
- no marker: run, and it must not raise.

A block runs as the page's reader would run it: in a file of its own, as ``__main__``, on ranks
that are already in a group of the backend under test (``dist.init_process_group`` in a block
returns at once), with ``torch``, ``dist`` and ``torch_tdist`` imported, as earlier blocks of the
page do. Each block's global random generator is seeded from the test's seed and the rank.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_RUN = "not run:"
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str      # relative to the repository root
    line: int      # of the opening fence, 1-based
    marker: str    # the comment before the fence, "" for none
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return not self.marker.startswith(NOT_RUN)


def pages() -> list[str]:
    """The pages whose blocks are run: README.md and docs/*.md."""
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def python_blocks(page: str) -> list[Block]:
    lines = open(os.path.join(ROOT, page)).read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if fence.group(1) == "python":
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = _MARKER.match(before)
            blocks.append(Block(page, i + 1, marker.group(1) if marker else "", "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks


@contextlib.contextmanager
def _in_the_group():
    """``dist.init_process_group`` returns at once: the ranks are in their group already."""
    real = dist.init_process_group

    def joined(*args, **kwargs):
        assert dist.is_initialized()

    dist.init_process_group = joined
    try:
        yield
    finally:
        dist.init_process_group = real


def _run(block: Block, as_main: bool = True):
    """Runs ``block`` from a file of its own and returns it as a module."""
    import torch_tdist

    path = os.path.join(tempfile.mkdtemp(prefix="tdist-docs-"), f"block_{block.line}.py")
    with open(path, "w") as f:
        f.write(block.code)
    spec = importlib.util.spec_from_file_location("__main__" if as_main else f"docs_block_{block.line}", path)
    module = importlib.util.module_from_spec(spec)
    module.torch, module.dist, module.torch_tdist = torch, dist, torch_tdist
    with _in_the_group():
        spec.loader.exec_module(module)
    return module


def _gloo_all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t``, through a Gloo group (a reference independent of tdist)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous(), group=dist.new_group(backend="gloo"))
    return parts


def _check_usage(names, rank, ws, seed):
    xs = []
    for r in range(ws):
        torch.manual_seed(seed + r)
        xs.append(torch.randn(1024))
    total = torch.stack(xs).sum(0)
    assert torch.allclose(names.x, total, rtol=1e-5, atol=1e-5), "all_reduce(x) != the sum of every rank's x"
    assert torch.equal(names.out, names.x.repeat(ws)), "all_gather_into_tensor did not gather every rank's x"


def _check_ops(names, rank, ws, seed):
    """``h`` against a Gloo all_gather and torch.matmul; ``y`` against the sum of every rank's
    ``h @ w^T``; both inputs got gradients."""
    a_shard, w, h, y = (getattr(names, k).detach() for k in ("a_shard", "w", "h", "y"))
    a_full = torch.cat(_gloo_all_gather(a_shard))
    assert torch.allclose(h, a_full @ w, rtol=1e-4, atol=1e-3), "h != all_gather(a_shard) @ w"
    total = sum((a_full @ wr) @ wr.t() for wr in _gloo_all_gather(w))
    assert torch.allclose(y, total.chunk(ws)[rank], rtol=1e-4, atol=1e-2), "y != rows of sum(h @ w^T)"
    assert names.a_shard.grad is not None and names.w.grad is not None


def _check_dtensor(names, rank, ws, seed):
    """The sharded MLP's output against the whole MLP (the same seed, so the same weights) on
    every rank's sequence positions, computed here without communication."""
    torch.manual_seed(0)
    nn = torch.nn
    whole = nn.Sequential(nn.Linear(64, 256, bias=False), nn.GELU(), nn.Linear(256, 64, bias=False))
    xs = [torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(r)) for r in range(ws)]
    with torch.no_grad():
        want = whole(torch.cat(xs, dim=1)).chunk(ws, dim=1)[rank]
    got = names.y.to_local() if hasattr(names.y, "to_local") else names.y
    assert got.shape == want.shape, f"{tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got.detach(), want, rtol=1e-4, atol=1e-4), "the sharded MLP differs from the whole one"


def _check_kernel_example(names, rank, ws, seed):
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(seed + r)) for r in range(ws)]
    got = names.shift_right(xs[rank])
    assert torch.equal(got, xs[(rank - 1) % ws]), "shift_right did not deliver the left neighbour's data"


CHECKS = {"checked: usage": _check_usage, "ops example": _check_ops, "checked: dtensor": _check_dtensor,
          "example": _check_kernel_example}


def run_page(rank, ws, seed, page):
    """Runs every block of ``page`` not marked ``not run``, checks those with a check, and
    returns the names of the blocks run."""
    ran = []
    for block in python_blocks(page):
        if not block.runs:
            continue
        if block.marker and block.marker not in CHECKS:
            raise AssertionError(f"{block.name}: unknown marker <!-- {block.marker} -->")
        torch.manual_seed(seed + rank)
        try:
            names = _run(block)
            if block.marker:
                CHECKS[block.marker](names, rank, ws, seed)
        except Exception as err:
            raise AssertionError(f"{block.name} (rank {rank}): {type(err).__name__}: {err}") from err
        ran.append(block.name)
    return ran
