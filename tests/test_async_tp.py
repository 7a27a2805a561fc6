"""torch_tdist.async_tp on the CPU, one process per rank: after enable(), torch's symm_mem fused
ops run tdist's ops for tdist groups (and only for them), and a sequence-parallel MLP compiled by
Inductor with the micro-pipeline TP pass runs its collectives as tdist's overlapped ops, matching
eager."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import jobs_async_tp as J
from tests.helpers import skip_on, ws_param

pytestmark = skip_on("gloo", "torch_tdist.async_tp compares a tdist group with a Gloo one")


@ws_param([2])
def test_fused_ops_dispatch_tdist_groups(pool, seed):
    pool.run(J.fused_ops_dispatch, seed, timeout=300)


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


def test_gather_pass_runs_after_earlier_passes():
    """enable()'s post-grad pre-pass keeps one the user installed before (run first, its uuid
    part of the cache key) and is installed once however often enable() runs."""
    import torch
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from torch_tdist import async_tp

    ran = []

    class Earlier(CustomGraphPass):
        def __call__(self, graph):
            ran.append(graph)

        def uuid(self):
            return "earlier"

    earlier = Earlier()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=earlier):
        async_tp._install_gather_pass()
        installed = torch._inductor.config.post_grad_custom_pre_pass
        assert isinstance(installed, async_tp._RestoreGatherDims) and installed.before == (earlier,)
        graph = torch.fx.Graph()
        installed(graph)
        assert ran == [graph]
        assert "earlier" in installed.uuid()
        async_tp._install_gather_pass()
        assert torch._inductor.config.post_grad_custom_pre_pass is installed
