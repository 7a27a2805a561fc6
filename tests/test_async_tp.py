"""torch_tdist.async_tp on the CPU, one process per rank: after enable(), torch's symm_mem fused
ops run tdist's ops for tdist groups (and only for them), and a sequence-parallel MLP compiled by
Inductor with the micro-pipeline TP pass runs its collectives as tdist's overlapped ops, matching
eager."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests import jobs_async_tp as J
from tests.helpers import skip_on, ws_param

pytestmark = skip_on("gloo", "torch_tdist.async_tp compares a tdist group with a Gloo one")


@ws_param([2])
def test_fused_ops_dispatch_tdist_groups(pool, seed):
    pool.run(J.fused_ops_dispatch, seed, timeout=300)


# Inductor's CPU build passes torch's library folder to the linker unquoted: under a path with a
# space (a virtual environment in such a folder) every kernel it compiles fails to link.
TORCH_PATH_HAS_SPACE = any(c.isspace() for c in os.path.dirname(torch.__file__))


@pytest.mark.skipif(TORCH_PATH_HAS_SPACE, reason="torch is installed under a path with a space, where "
                    "Inductor's CPU kernels fail to link (torch's C++ build does not quote the path)")
@ws_param([2])
@pytest.mark.parametrize("batch", [1, 2], ids=["batch1", "batch2"])
def test_compiled_mlp_runs_tdist_ops(pool, seed, batch):
    """Batch 1 gathers reach Inductor in another form (async_tp._RestoreGatherDims)."""
    pool.run(J.compiled_mlp, seed, batch, timeout=600)


def test_import_changes_nothing():
    """Importing torch_tdist (and its async_tp module) leaves Inductor's pass off and torch's
    symm_mem kernels in place until enable() is called."""
    code = ("import torch, torch_tdist, torch_tdist.async_tp as a, torch_tdist.parallel\n"
            "assert not torch._inductor.config._micro_pipeline_tp\n"
            "assert a._overrides is None\n"
            "print('unchanged')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "unchanged" in proc.stdout, proc.stdout + proc.stderr


def test_gather_pass_keeps_earlier_passes():
    """enable()'s post-grad pre-pass joins one the user installed before (after it, in a list,
    where torch takes lists), and is installed once however often enable() runs."""
    import torch
    from torch._inductor import custom_graph_pass

    from torch_tdist import async_tp

    def earlier(graph):
        pass

    with torch._inductor.config.patch(post_grad_custom_pre_pass=earlier):
        async_tp._install_gather_pass()
        installed = torch._inductor.config.post_grad_custom_pre_pass
        if hasattr(custom_graph_pass, "get_custom_graph_passes"):
            assert installed[0] is earlier and isinstance(installed[1], async_tp._RestoreGatherDims), installed
        else:
            assert installed is earlier
        async_tp._install_gather_pass()
        assert torch._inductor.config.post_grad_custom_pre_pass == installed
    with torch._inductor.config.patch(post_grad_custom_pre_pass=None):
        async_tp._install_gather_pass()
        assert isinstance(torch._inductor.config.post_grad_custom_pre_pass, async_tp._RestoreGatherDims)


def _gathered_matmul_graph(group_name: str, gather_used_elsewhere: bool = False, matmul: bool = True):
    """The post-grad graph of a batch-1 sequence-parallel gather (2 ranks) feeding a matmul, as
    funcol and Inductor write it: reshape(wait(all_gather)) -> reshape to 2-D -> mm -> reshape."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    graph = torch.fx.Graph()
    with FakeTensorMode() as mode:
        def node(target, args, shape):
            n = graph.call_function(target, args)
            n.meta["val"] = mode.from_tensor(torch.empty(shape))
            return n
        shard, weight = graph.placeholder("shard"), graph.placeholder("weight")
        shard.meta["val"], weight.meta["val"] = torch.empty(1, 4, 16), torch.empty(16, 8)
        wait = node(c10d.wait_tensor.default, (node(c10d.all_gather_into_tensor.default, (shard, 2, group_name),
                                                    (2, 4, 16)),), (2, 4, 16))
        gathered = node(aten.reshape.default, (wait, [1, 8, 16]), (1, 8, 16))
        flat = node(aten.reshape.default, (gathered, [8, 16]), (8, 16))
        out = node(aten.reshape.default, (node(aten.mm.default, (flat, weight), (8, 8)), [1, 8, 8]), (1, 8, 8)) \
            if matmul else flat
    graph.output((out, wait) if gather_used_elsewhere else (out,))
    return graph


def test_gather_pass_rewrites_only_what_the_pass_fuses(monkeypatch):
    """_RestoreGatherDims turns the reshaped gather of a tdist group into cat(split(...)) along
    dimension 1, and leaves it (a view, no copy) for another group, for a gather used elsewhere
    too and for one no matmul takes: there the micro-pipeline pass would not fuse it."""
    import torch

    from torch_tdist import async_tp

    monkeypatch.setattr(async_tp, "_is_tdist", lambda name: name == "tdist")
    monkeypatch.setattr(async_tp.symm_mem, "is_symm_mem_enabled_for_group", lambda name: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch._inductor.config, "_micro_pipeline_tp", True)

    def cats(graph):
        async_tp._RestoreGatherDims()(graph)
        graph.lint()
        return [n for n in graph.nodes if n.target is torch.ops.aten.cat.default]

    rewritten = cats(_gathered_matmul_graph("tdist"))
    assert len(rewritten) == 1 and rewritten[0].args[1] == 1 and len(rewritten[0].args[0]) == 2
    assert tuple(rewritten[0].meta["val"].shape) == (1, 8, 16)
    assert not cats(_gathered_matmul_graph("nccl"))
    assert not cats(_gathered_matmul_graph("tdist", gather_used_elsewhere=True))
    assert not cats(_gathered_matmul_graph("tdist", matmul=False))
