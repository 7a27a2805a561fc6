"""Jobs for test_parallel.py: torch_tdist.parallel's styles on a tdist mesh against torch's
styles on a Gloo mesh, the same modules with the same weights and inputs, sequence parallel:
outputs, input gradients and weight gradients (each rank's shards) must match.

The tdist group runs the ops pipelined (TDIST_OVERLAP=pipelined), so the overlapped path is
what is compared; its calls are counted to show the styles went through the tdist ops and that
linears sharing one input gathered it once.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_tdist
from tests.common import Checker, new_group_with_env, rand, shared_gen

DIM, HEADS, HIDDEN = 32, 4, 64


class MLP(nn.Module):
    def __init__(self, dim=DIM, hidden=HIDDEN):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [B, S, local heads * head dim]
        b, s, _ = q.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim=DIM, hidden=HIDDEN):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A llama-style transformer block: pre-norm attention and SwiGLU feed-forward."""

    def __init__(self, dim=DIM, heads=HEADS, hidden=HIDDEN):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def _plan(styles, model: str) -> dict:
    """Sequence parallel: inputs and outputs of the model sharded along the sequence (dim 1)."""
    from torch.distributed.tensor import Shard

    if model == "mlp":
        return {"w1": styles.ColwiseParallel(input_layouts=Shard(1)),
                "w2": styles.RowwiseParallel(output_layouts=Shard(1))}
    return {"attention_norm": styles.SequenceParallel(),
            **{f"attention.{w}": styles.ColwiseParallel(input_layouts=Shard(1)) for w in ("wq", "wk", "wv")},
            "attention.wo": styles.RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": styles.SequenceParallel(),
            **{f"feed_forward.{w}": styles.ColwiseParallel(input_layouts=Shard(1)) for w in ("w1", "w3")},
            "feed_forward.w2": styles.RowwiseParallel(output_layouts=Shard(1))}


def _mesh(group, name: str, device_type: str = "cpu"):
    """A 1-D mesh over ``group``. Meshes over the same ranks compare equal unless their
    dimension names differ, whatever their groups, and DTensor's caches would mix them up: every
    mesh of these jobs has a name of its own."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(name,))


def _step(module, x_local):
    """(output, input gradient, {parameter: local gradient}) of one forward and backward with
    loss = sum(output * a fixed random weight)."""
    from torch.distributed.tensor import DTensor

    x = x_local.clone().requires_grad_()
    out = module(x)
    out = out.to_local() if isinstance(out, DTensor) else out
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view(out.shape)
    (out * weight).sum().backward()
    grads = {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in module.named_parameters()}
    return out.detach(), x.grad, grads


def styles_match_torch(rank, ws, seed, model):
    """``model`` ("mlp" or "block") parallelised with tdist's styles on a tdist mesh and with
    torch's on a Gloo mesh: two steps (the second with the first's gathered inputs forgotten),
    outputs and gradients equal to 1e-5 (float32)."""
    from torch.distributed.tensor import parallel as torch_styles
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_tdist import parallel as tdist_styles

    chk = Checker(rank, f"parallel styles, {model}")
    tdist_group = new_group_with_env("tdist", {"TDIST_OVERLAP": "pipelined"})
    gloo_group = new_group_with_env("gloo")
    torch.manual_seed(seed)  # the same weights on every rank (the styles shard them)
    reference = MLP() if model == "mlp" else Block()
    ours = copy.deepcopy(reference)
    parallelize_module(reference, _mesh(gloo_group, f"gloo {model} {seed}"), _plan(torch_styles, model))
    parallelize_module(ours, _mesh(tdist_group, f"tdist {model} {seed}"), _plan(tdist_styles, model))

    state = torch_tdist.overlap.state(tdist_group)
    seq = 4 * ws
    for step in range(2):
        x_full = rand((2, seq, DIM), torch.float32, shared_gen(seed, 10 + step))
        x_local = x_full.chunk(ws, dim=1)[rank].contiguous()
        before = dict(state.fused_calls)
        want_out, want_dx, want_grads = _step(reference, x_local)
        got_out, got_dx, got_grads = _step(ours, x_local)
        chk.close(got_out, want_out, f"step {step}: output")
        chk.close(got_dx, want_dx, f"step {step}: input gradient")
        for name, want in want_grads.items():
            chk.close(got_grads[name], want, f"step {step}: gradient of {name}")
        gathers = state.fused_calls["all_gather_matmul"] - before.get("all_gather_matmul", 0)
        scatters = state.fused_calls["matmul_reduce_scatter"] - before.get("matmul_reduce_scatter", 0)
        # forward: one gather per input the column-wise linears share (mlp: w1; block: q/k/v and
        # w1/w3), one scatter per row-wise linear; backward: each op's gradient is the other op
        expected = 2 if model == "mlp" else 4
        chk.true(gathers == expected and scatters == expected, f"step {step}: overlapped calls",
                 f"{gathers} all_gather_matmul and {scatters} matmul_reduce_scatter, expected {expected} each")
        for module in ours.modules():
            for p in module.parameters(recurse=False):
                p.grad = None
        for module in reference.modules():
            for p in module.parameters(recurse=False):
                p.grad = None
    dist.destroy_process_group(tdist_group)
    dist.destroy_process_group(gloo_group)
    chk.done()


def torch_style_elsewhere(rank, ws, seed):
    """Where there is nothing to fuse (a replicated input, an embedding, a Gloo mesh) the tdist
    styles are torch's: the same outputs and no tdist op called."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_tdist import parallel as tdist_styles

    chk = Checker(rank, "parallel styles, unfused")
    tdist_group = new_group_with_env("tdist", {"TDIST_OVERLAP": "pipelined"})
    gloo_group = new_group_with_env("gloo")
    state = torch_tdist.overlap.state(tdist_group)
    torch.manual_seed(seed)
    embed, mlp = nn.Embedding(16, DIM), MLP()
    x = torch.randint(0, 16, (2, 5), generator=shared_gen(seed, 1))
    want = mlp(embed(x)).detach()
    for group in (tdist_group, gloo_group):
        before = sum(state.fused_calls.values())
        mesh = _mesh(group, f"{dist.get_backend(group)} unfused {seed}")
        e, m = copy.deepcopy(embed), copy.deepcopy(mlp)
        parallelize_module(e, mesh, tdist_styles.RowwiseParallel(input_layouts=Replicate()))
        parallelize_module(m, mesh, {"w1": tdist_styles.ColwiseParallel(), "w2": tdist_styles.RowwiseParallel()})
        chk.close(m(e(x)).detach(), want, f"embedding + MLP on a {dist.get_backend(group)} mesh")
        chk.true(sum(state.fused_calls.values()) == before, "no tdist op", "an overlapped op was called")
    dist.destroy_process_group(tdist_group)
    dist.destroy_process_group(gloo_group)
    chk.done()
