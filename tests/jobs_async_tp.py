"""Jobs for test_async_tp.py: torch_tdist.async_tp.enable on CPU ranks.

The symm_mem fused ops, called as Inductor's micro-pipeline TP pass calls them, run tdist's ops
for a tdist group and match all_gather + matmul / matmul + reduce_scatter computed on a Gloo
group; a sequence-parallel MLP (torch's own styles on a tdist mesh) compiled by Inductor with
the pass on has its collectives fused into tdist's overlapped ops and matches the eager model.
Torch runs the pass only where it was built with NCCL, which its CPU build is not: the compile
job says NCCL is there (``torch.distributed.is_nccl_available``) for the pass's sake.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import torch_tdist
from tests.common import Checker, new_group_with_env, rand, rank_gen, shared_gen
from tests.jobs_parallel import DIM, FeedForward, _mesh, _step


def _gathered(x, dim, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def _scattered(x, dim, op, group):
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM, group=group)
    return out


def fused_ops_dispatch(rank, ws, seed):
    """symm_mem::fused_all_gather_matmul / fused_matmul_reduce_scatter on a tdist group after
    enable(): tdist's overlapped ops ran (counted) and the results match Gloo's collectives
    plus torch.matmul; a gather along the last dimension runs the sequential form; a Gloo group
    gets torch's answer on the CPU (no kernel) and stays without symmetric memory. The outputs
    have the strides torch's kernels give, to those of dimensions of size 1."""
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    from torch_tdist import async_tp

    chk = Checker(rank, "async_tp fused ops")
    chk.true(not torch._inductor.config._micro_pipeline_tp, "off before enable", "the pass was on already")
    tdist_group = new_group_with_env("tdist", {"TDIST_OVERLAP": "pipelined"})
    gloo_group = new_group_with_env("gloo")
    async_tp.enable(tdist_group)
    chk.true(torch._inductor.config._micro_pipeline_tp, "pass on", "enable() left the pass off")
    chk.true(is_symm_mem_enabled_for_group(tdist_group.group_name), "symm_mem enabled", "not for the tdist group")
    chk.true(not is_symm_mem_enabled_for_group(gloo_group.group_name), "gloo untouched", "gloo got symm_mem")
    state = torch_tdist.overlap.state(tdist_group)
    name = tdist_group.group_name

    for gather_dim in (0, 1, 2):
        a_shard = rand((2, 3 * ws, DIM), torch.float32, rank_gen(seed, rank, gather_dim))
        bs = [rand((DIM if gather_dim != 2 else DIM * ws, n), torch.float32, shared_gen(seed, 10 + n))
              for n in (8, 16)]
        a_full = _gathered(a_shard, gather_dim, gloo_group)
        before, fused = dict(async_tp.served), state.fused_calls["all_gather_matmul"]
        got_a, got = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, bs, gather_dim, name, return_A=True)
        chk.close(got_a, a_full, f"gathered A, dim {gather_dim}")
        for i, b in enumerate(bs):
            chk.products_close(got[i], a_full.double() @ b.double(), f"A @ B[{i}], dim {gather_dim}")
        chk.true(async_tp.served["fused_all_gather_matmul"] == before.get("fused_all_gather_matmul", 0) + 1,
                 f"served, dim {gather_dim}", "the call was not counted")
        overlapped = state.fused_calls["all_gather_matmul"] - fused
        chk.true(overlapped == (gather_dim != 2), f"overlapped, dim {gather_dim}",
                 f"{overlapped} overlapped calls")
        none_a, _ = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, bs, gather_dim, name, return_A=False)
        chk.true(none_a is None, f"return_A=False, dim {gather_dim}", "A came back")

    for scatter_dim, reduce_op in ((0, "sum"), (1, "avg"), (2, "sum")):
        k = 12
        a = rand((2 * ws, 2 * ws, k), torch.float32, rank_gen(seed, rank, 20 + scatter_dim))
        b = rand((k, 4 * ws), torch.float32, rank_gen(seed, rank, 30 + scatter_dim))
        fused = state.fused_calls["matmul_reduce_scatter"]
        got = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, reduce_op, scatter_dim, name)
        chk.products_close(got, _scattered(a.double() @ b.double(), scatter_dim, reduce_op, gloo_group),
                           f"{reduce_op} along {scatter_dim}")
        overlapped = state.fused_calls["matmul_reduce_scatter"] - fused
        chk.true(overlapped == (scatter_dim != 2), f"overlapped, scatter dim {scatter_dim}",
                 f"{overlapped} overlapped calls")

    # layouts: what torch's own (sequential) kernels return, to the strides of dimensions of size 1,
    # which torch.compile's guards compare (a sequence-parallel batch of 1 gathers along dim 1)
    from torch.distributed import _symmetric_memory as torch_symm_mem
    for batch in (1, 2):
        a_shard = rand((batch, 2 * ws, DIM), torch.float32, rank_gen(seed, rank, 40 + batch))
        bs = [rand((DIM, 8), torch.float32, shared_gen(seed, 50))]
        want_a, want = torch_symm_mem._fused_all_gather_matmul_fallback(a_shard, bs, 1, name, return_A=True)
        got_a, got = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, bs, 1, name, return_A=True)
        chk.true(got_a.stride() == want_a.stride() and got[0].stride() == want[0].stride(),
                 f"gather layout, batch {batch}", f"{got_a.stride()} {got[0].stride()}, torch's "
                 f"{want_a.stride()} {want[0].stride()}")
        chk.products_close(got[0], want[0], f"gather values, batch {batch}")
        a = rand((batch, 2 * ws, DIM), torch.float32, rank_gen(seed, rank, 60 + batch))
        want = torch_symm_mem._fused_matmul_reduce_scatter_fallback(a, bs[0], "sum", 1, name)
        got = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, bs[0], "sum", 1, name)
        plain = torch.ops.tdist.matmul_reduce_scatter(a, bs[0], name, 1, "sum")
        chk.true(got.stride() == want.stride() == plain.stride() == torch.empty(want.shape).stride(),
                 f"scatter layout, batch {batch}", f"{got.stride()} and tdist's {plain.stride()}, torch's {want.stride()}")
        chk.products_close(got, want, f"scatter values, batch {batch}")

    # dtypes tdist's ops do not take (float64) run torch's sequential form on the tdist group
    a_shard = rand((2 * ws, DIM), torch.float64, rank_gen(seed, rank, 70))
    b64 = rand((DIM, 8), torch.float64, shared_gen(seed, 71))
    fused = dict(state.fused_calls)
    _, got = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b64], 0, name, return_A=False)
    chk.products_close(got[0], _gathered(a_shard, 0, gloo_group) @ b64, "float64 gather")
    got = torch.ops.symm_mem.fused_matmul_reduce_scatter(a_shard, b64, "sum", 0, name)
    chk.products_close(got, _scattered(a_shard @ b64, 0, "sum", gloo_group), "float64 scatter")
    chk.true(dict(state.fused_calls) == fused, "float64 not overlapped", f"{state.fused_calls}")
    try:
        torch.ops.symm_mem.fused_matmul_reduce_scatter(b.new_ones(4, 4), b.new_ones(4, 4), "sum", 0,
                                                       gloo_group.group_name)
        chk.true(False, "gloo group", "no error on the CPU")
    except NotImplementedError as err:
        chk.true("fused_matmul_reduce_scatter" in str(err), "gloo group error", str(err))
    try:
        async_tp.enable(gloo_group)
        chk.true(False, "enable(gloo)", "no error")
    except ValueError as err:
        chk.true("tdist" in str(err) and "gloo" in str(err), "enable(gloo) error", str(err))
    dist.destroy_process_group(tdist_group)
    dist.destroy_process_group(gloo_group)
    chk.done()


def compiled_mlp(rank, ws, seed, batch, prepared):
    """A sequence-parallel SwiGLU feed-forward (no biases: the pass fuses matmuls, not addmm)
    with torch's styles on a tdist mesh, compiled by Inductor after enable(): the forward's
    gather (shared by w1 and w3) and scatter (w2), the backward's gather (w2's output gradient)
    and scatters are fused regions tdist ran, and outputs and gradients match the eager model.
    The backward's scatters: w1's and w3's input gradients one by one, or, where the block's
    input is gathered once for both (``prepared``: PrepareModuleInput, as torchtitan does), one
    scatter of their sum (async_tp._join_summed_matmuls)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    from torch_tdist import async_tp

    dist.is_nccl_available = lambda: True  # (module docstring)
    chk = Checker(rank, "async_tp compiled MLP")
    tdist_group = new_group_with_env("tdist", {"TDIST_OVERLAP": "pipelined"})
    async_tp.enable(_mesh(tdist_group, f"async tp {seed}"))
    torch.manual_seed(seed)
    if prepared:  # (torchtitan's: the feed-forward inside a block compiled whole, its input hook inside the graph)
        eager = torch.nn.Sequential(FeedForward())
        plan = {"0": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "0.w1": ColwiseParallel(), "0.w3": ColwiseParallel(), "0.w2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        eager = FeedForward()
        plan = {"w1": ColwiseParallel(input_layouts=Shard(1)), "w3": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1))}
    parallelize_module(eager, _mesh(tdist_group, f"async tp {seed}"), plan)
    compiled = torch.compile(copy.deepcopy(eager))
    state = torch_tdist.overlap.state(tdist_group)
    x_full = rand((batch, 4 * ws, DIM), torch.float32, shared_gen(seed, 1))
    x_local = x_full.chunk(ws, dim=1)[rank].contiguous()
    want_out, want_dx, want_grads = _step(eager, x_local)
    served, fused = dict(async_tp.served), dict(state.fused_calls)
    got_out, got_dx, got_grads = _step(compiled, x_local)
    chk.products_close(got_out, want_out, "output")
    chk.products_close(got_dx, want_dx, "input gradient")
    for param, want in want_grads.items():
        chk.products_close(got_grads[f"_orig_mod.{param}"], want, f"gradient of {param}")
    regions = {op: async_tp.served[op] - served.get(op, 0) for op in async_tp.served}
    overlapped = {op: state.fused_calls[op] - fused.get(op, 0) for op in state.fused_calls}
    scatters = 2 if prepared else 3
    chk.true(regions.get("fused_all_gather_matmul", 0) >= 2 and regions.get("fused_matmul_reduce_scatter", 0) >= scatters,
             "fused regions", f"served {regions}, expected 2 gathers and {scatters} scatters")
    chk.true(overlapped.get("all_gather_matmul", 0) >= 2 and overlapped.get("matmul_reduce_scatter", 0) >= scatters,
             "overlapped calls", f"{overlapped}")
    dist.destroy_process_group(tdist_group)
    chk.done()
