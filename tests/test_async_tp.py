"""torch_tdist.async_tp on the CPU, one process per rank: after enable(), torch's symm_mem fused
ops run tdist's ops for tdist groups (and only for them), and a sequence-parallel MLP compiled by
Inductor with the micro-pipeline TP pass runs its collectives as tdist's overlapped ops, matching
eager."""

from __future__ import annotations

import operator
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
@pytest.mark.parametrize("batch,prepared", [(1, True), (1, False), (2, False)],
                         ids=["batch1-input-prepared", "batch1", "batch2"])
def test_compiled_mlp_runs_tdist_ops(pool, seed, batch, prepared):
    """Batch 1 gathers reach Inductor in another form (async_tp._restore_gather_dims); an input
    prepared once for w1 and w3 (torchtitan's plan) makes the backward scatter a sum of matmuls
    (async_tp._join_summed_matmuls)."""
    pool.run(J.compiled_mlp, seed, batch, prepared, timeout=600)


def test_import_changes_nothing():
    """Importing torch_tdist (and its async_tp module) leaves Inductor's pass off and torch's
    symm_mem kernels in place until enable() is called."""
    code = ("import torch, torch_tdist, torch_tdist.async_tp as a, torch_tdist.parallel\n"
            "assert not torch._inductor.config._micro_pipeline_tp\n"
            "assert a._overrides is None\n"
            "print('unchanged')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "unchanged" in proc.stdout, proc.stdout + proc.stderr


def test_pre_pass_keeps_earlier_passes():
    """enable()'s post-grad pre-pass joins one the user installed before (after it, in a list,
    where torch takes lists), and is installed once however often enable() runs."""
    import torch
    from torch._inductor import custom_graph_pass

    from torch_tdist import async_tp

    def earlier(graph):
        pass

    with torch._inductor.config.patch(post_grad_custom_pre_pass=earlier):
        async_tp._install_pre_pass()
        installed = torch._inductor.config.post_grad_custom_pre_pass
        if hasattr(custom_graph_pass, "get_custom_graph_passes"):
            assert installed[0] is earlier and isinstance(installed[1], async_tp._PrepareForMicroPipeline), installed
        else:
            assert installed is earlier
        async_tp._install_pre_pass()
        assert torch._inductor.config.post_grad_custom_pre_pass == installed
    with torch._inductor.config.patch(post_grad_custom_pre_pass=None):
        async_tp._install_pre_pass()
        assert isinstance(torch._inductor.config.post_grad_custom_pre_pass, async_tp._PrepareForMicroPipeline)


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


@pytest.fixture
def pass_on(monkeypatch):
    """What makes tdist's pre-pass act: the micro-pipeline pass on, as if NCCL were built in
    (config.patch: monkeypatch would delete the option from Inductor's config afterwards)."""
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    with torch._inductor.config.patch(_micro_pipeline_tp=True):
        yield


def test_gather_pass_rewrites_only_what_the_pass_fuses(monkeypatch, pass_on):
    """_restore_gather_dims turns the reshaped gather of a tdist group into cat(split(...)) along
    dimension 1, and leaves it (a view, no copy) for another group, for a gather used elsewhere
    too and for one no matmul takes: there the micro-pipeline pass would not fuse it."""
    import torch

    from torch_tdist import async_tp

    monkeypatch.setattr(async_tp, "_is_tdist", lambda name: name == "tdist")
    monkeypatch.setattr(async_tp.symm_mem, "is_symm_mem_enabled_for_group", lambda name: True)

    def cats(graph):
        async_tp._PrepareForMicroPipeline()(graph)
        graph.lint()
        return [n for n in graph.nodes if n.target is torch.ops.aten.cat.default]

    rewritten = cats(_gathered_matmul_graph("tdist"))
    assert len(rewritten) == 1 and rewritten[0].args[1] == 1 and len(rewritten[0].args[0]) == 2
    assert tuple(rewritten[0].meta["val"].shape) == (1, 8, 16)
    assert not cats(_gathered_matmul_graph("nccl"))
    assert not cats(_gathered_matmul_graph("tdist", gather_used_elsewhere=True))
    assert not cats(_gathered_matmul_graph("tdist", matmul=False))


def _summed_matmuls_graph(group_name: str, weights: str = "row-major", used_elsewhere: str = "",
                          scatter_dim: int = 1):
    """The post-grad graph of a block's input gradient in the backward (2 ranks, batch 1), as
    Inductor writes it: a sum of three reshaped matmuls, scattered along ``scatter_dim`` as
    funcol writes it (split -> cat -> reduce_scatter -> wait). ``weights``: the Bs "row-major",
    or "transposed" (permutes of row-major [N, K]); ``used_elsewhere``: "sum" or "term" also
    returned by the graph."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    m, n, ks = 8, 16, (4, 2, 2)
    graph = torch.fx.Graph()
    with FakeTensorMode() as mode:
        def node(target, args):
            made = graph.call_function(target, args)
            made.meta["val"] = target(*torch.fx.node.map_arg(args, lambda x: x.meta["val"]))
            return made
        terms = []
        for i, k in enumerate(ks):
            a, b = graph.placeholder(f"a{i}"), graph.placeholder(f"b{i}")
            a.meta["val"] = mode.from_tensor(torch.empty(m, k))
            b.meta["val"] = mode.from_tensor(torch.empty(k, n) if weights == "row-major" else torch.empty(n, k))
            if weights != "row-major":
                b = node(aten.permute.default, (b, [1, 0]))
            terms.append(node(aten.reshape.default, (node(aten.mm.default, (a, b)), [1, m, n])))
        summed = node(aten.add.Tensor, (node(aten.add.Tensor, (terms[0], terms[1])), terms[2]))
        split = node(aten.split.Tensor, (summed, (m if scatter_dim == 1 else n) // 2, scatter_dim))
        parts = [graph.call_function(operator.getitem, (split, i)) for i in range(2)]
        for i, part in enumerate(parts):
            part.meta["val"] = split.meta["val"][i]
        wait = node(c10d.wait_tensor.default,
                    (node(c10d.reduce_scatter_tensor.default, (node(aten.cat.default, (parts,)), "sum", 2, group_name)),))
    graph.output((wait, *{"sum": [summed], "term": [terms[1]]}.get(used_elsewhere, [])))
    return graph, ks, (m, n)


def test_summed_matmuls_join_where_the_pass_fuses(monkeypatch, pass_on):
    """_join_summed_matmuls makes the reduce-scatter of a sum of matmuls (a block's input
    gradient) the reduce-scatter of one matmul over the operands joined along K, which Inductor's
    micro-pipeline pass then fuses into symm_mem's fused_matmul_reduce_scatter, with the sum's
    value (fresh random operands, weights row-major and transposed). It leaves the graph alone
    for another group's reduce-scatter, a sum or a term used elsewhere too, and a scatter along
    the last dimension: there nothing would be fused, and the joins would only add copies."""
    import torch
    from torch._inductor.fx_passes.micro_pipeline_tp import micro_pipeline_tp_pass

    from torch_tdist import async_tp

    monkeypatch.setattr(async_tp, "_is_tdist", lambda name: name == "tdist")
    monkeypatch.setattr(async_tp.symm_mem, "is_symm_mem_enabled_for_group", lambda name: True)
    aten = torch.ops.aten

    def matmuls(graph):
        return [x for x in graph.nodes if x.target is aten.mm.default]

    for weights in ("row-major", "transposed"):
        fused, _, _ = _summed_matmuls_graph("tdist", weights)
        async_tp._PrepareForMicroPipeline()(fused)
        micro_pipeline_tp_pass(fused)
        assert [x for x in fused.nodes if x.target is torch.ops.symm_mem.fused_matmul_reduce_scatter.default], \
            f"Bs {weights}: the micro-pipeline pass fused nothing:\n{fused}"
        graph, ks, (m, n) = _summed_matmuls_graph("tdist", weights)
        async_tp._PrepareForMicroPipeline()(graph)
        graph.lint()
        (mm,) = matmuls(graph)
        # the micro-pipeline pass's form: reshape(mm(reshape(A), B)) feeding the scatter's split
        scattered = next(x for x in graph.nodes if x.target is aten.split.Tensor).args[0]
        assert scattered.target is aten.reshape.default and scattered.args[0] is mm
        assert mm.args[0].target is aten.reshape.default
        assert tuple(mm.meta["val"].shape) == (m, n) and tuple(mm.args[1].meta["val"].shape) == (sum(ks), n)
        assert not [x for x in graph.nodes if x.target is aten.add.Tensor]
        # its value: the sum's, on fresh random operands
        output = next(x for x in graph.nodes if x.op == "output")
        output.args = ((scattered,),)
        for x in reversed(list(graph.nodes)):  # (the scatter too: a collective counts as having effects)
            if x.op == "call_function" and not x.users:
                graph.erase_node(x)
        inputs = []
        for k in ks:
            inputs.append(torch.randn(m, k, dtype=torch.float64))
            inputs.append(torch.randn(k, n, dtype=torch.float64) if weights == "row-major"
                          else torch.randn(n, k, dtype=torch.float64))
        (got,) = torch.fx.GraphModule(torch.nn.Module(), graph)(*inputs)
        want = sum(a @ (b if weights == "row-major" else b.t()) for a, b in zip(inputs[::2], inputs[1::2]))
        torch.testing.assert_close(got, want.reshape(1, m, n))
    for label, graph in (("another group", _summed_matmuls_graph("nccl")[0]),
                         ("the sum used elsewhere", _summed_matmuls_graph("tdist", used_elsewhere="sum")[0]),
                         ("a term used elsewhere", _summed_matmuls_graph("tdist", used_elsewhere="term")[0]),
                         ("along the last dimension", _summed_matmuls_graph("tdist", scatter_dim=2)[0])):
        async_tp._PrepareForMicroPipeline()(graph)
        assert len(matmuls(graph)) == 3, label
