"""torch_tdist.parallel and torch_tdist.async_tp on GPUs, bf16, one process per GPU.

    torchrun --nproc-per-node 4 -m tests.gpu_integrations [--only NAME,...]

Run by ``tests/test_gpu.py`` (pytest -m gpu) on the device. ``styles``: a llama-style block
(attention and SwiGLU feed-forward, sequence parallel) with tdist's styles on a tdist mesh
against torch's styles on an NCCL mesh. ``compiled``: the block with torch's styles, compiled by
Inductor after ``async_tp.enable``, on a tdist mesh (tdist's overlapped ops must run the fused
regions, a batch of 1 as torchtitan's benchmark has it) and on an NCCL mesh with torch's
symmetric memory (torch's kernels, tdist not called), each against the same model run eagerly.
``compiled_summed_scatter``: the reduce-scatter of a sum of matmuls, compiled, fused into one of
tdist's ops, against NCCL. Relative errors (norm of the difference over the norm)
<= 2e-2 in bf16. Prints one line per check and exits non-zero if any failed.
"""

import argparse
import copy
import os
import time

import torch_tdist.launch  # noqa: E402,F401  (importing it sets the NVLink-multicast safety variables)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tdist  # noqa: E402
from tests import gpu_checks  # noqa: E402
from tests.gpu_checks import _failures, _relative, _tdist_group, report_and_exit  # noqa: E402
from tests.jobs_parallel import Block, _mesh, _plan, _step  # noqa: E402

DIM, HEADS, HIDDEN, BATCH, SEQ_PER_RANK = 1024, 8, 2816, 2, 256
TOLERANCE = 2e-2


def _compare(label, got, want):
    (got_out, got_dx, got_grads), (want_out, want_dx, want_grads) = got, want
    _relative(f"{label} output", got_out, want_out, TOLERANCE)
    _relative(f"{label} input gradient", got_dx, want_dx, TOLERANCE)
    for name, grad in want_grads.items():
        _relative(f"{label} gradient of {name}", got_grads[name], grad, TOLERANCE)


def _block(device):
    torch.manual_seed(7)  # the same weights on every rank (the styles shard them)
    return Block(DIM, HEADS, HIDDEN).to(device=device, dtype=torch.bfloat16)


def _input(rank, world, device, step, batch=BATCH):
    gen = torch.Generator(device).manual_seed(100 + step)  # the same full input on every rank
    x = torch.randn(batch, SEQ_PER_RANK * world, DIM, device=device, generator=gen, dtype=torch.bfloat16)
    return x.chunk(world, dim=1)[rank].contiguous()


def _counted(executor, before):
    return {op: executor.fused_calls[op] - before.get(op, 0) for op in executor.fused_calls}


def _clear_grads(model):
    for p in model.parameters():
        p.grad = None


def styles(rank, world, device):
    from torch.distributed.tensor import parallel as torch_styles
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_tdist import parallel as tdist_styles

    tg = _tdist_group({"overlap": "pipelined"})
    reference, ours = _block(device), _block(device)
    parallelize_module(reference, _mesh(dist.group.WORLD, "nccl styles", "cuda"), _plan(torch_styles, "block"))
    parallelize_module(ours, _mesh(tg, "tdist styles", "cuda"), _plan(tdist_styles, "block"))
    executor = torch_tdist.overlap.state(tg)
    for step in range(2):
        x = _input(rank, world, device, step)
        before = dict(executor.fused_calls)
        want = _step(reference, x)
        got = _step(ours, x)
        _compare(f"styles step {step}", got, want)
        counted = _counted(executor, before)
        # forward: one gather each for q/k/v and w1/w3, one scatter each for wo and w2;
        # backward: the other op each
        if counted.get("all_gather_matmul") != 4 or counted.get("matmul_reduce_scatter") != 4:
            _failures.append(f"styles step {step}: overlapped calls {counted}, expected 4 of each")
        _clear_grads(reference)
        _clear_grads(ours)


def compiled(rank, world, device):
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    from torch.distributed.tensor import parallel as torch_styles
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_tdist import async_tp

    tg = _tdist_group({"overlap": "pipelined"})
    tdist_mesh = _mesh(tg, "tdist compiled", "cuda")
    async_tp.enable(tdist_mesh)
    enable_symm_mem_for_group(dist.group.WORLD.group_name)  # torch's async TP on the NCCL group
    executor = torch_tdist.overlap.state(tg)
    for label, mesh in (("tdist", tdist_mesh), ("nccl", _mesh(dist.group.WORLD, "nccl compiled", "cuda"))):
        eager = _block(device)
        parallelize_module(eager, mesh, _plan(torch_styles, "block"))
        fast = copy.deepcopy(eager)
        fast.compile()
        for step in range(2):
            x = _input(rank, world, device, step, batch=1)  # (torchtitan's: the gathers reach Inductor reshaped)
            want = _step(eager, x)
            served, before = dict(async_tp.served), dict(executor.fused_calls)
            got = _step(fast, x)
            _compare(f"compiled {label} step {step}", got, want)
            regions = {op: async_tp.served[op] - served.get(op, 0) for op in async_tp.served}
            counted = _counted(executor, before)
            if rank == 0 and step == 0:
                print(f"compiled {label}: fused regions tdist ran {regions}, overlapped calls {counted}", flush=True)
            # on torch 2.11 the pass fuses 4 gathers and 7 scatters in a step of this block (the
            # forward's gathers for q/k/v and w1/w3, the backward's of wo's and w2's output
            # gradients); fewer means a region was left unfused
            if label == "tdist" and (regions.get("fused_all_gather_matmul", 0) < 4
                                     or regions.get("fused_matmul_reduce_scatter", 0) < 7
                                     or counted.get("all_gather_matmul", 0) < 4
                                     or counted.get("matmul_reduce_scatter", 0) < 7):
                _failures.append(f"compiled tdist step {step}: fused regions {regions}, overlapped {counted}; "
                                 f"expected 4 gathers and 7 scatters or more")
            if label == "nccl" and (any(regions.values()) or any(counted.values())):
                _failures.append(f"compiled nccl step {step}: tdist ran {regions} {counted}")
            _clear_grads(eager)
            _clear_grads(fast)


def compiled_summed_scatter(rank, world, device):
    """The reduce-scatter of a sum of matmuls along the sequence (the form of a block's input
    gradient in the backward, batch 1), compiled after ``async_tp.enable``: tdist's pre-pass
    joins the matmuls, the pass fuses the scatter into tdist's op (one fused region), and the
    result matches NCCL's reduce-scatter of the sum computed in float32; Bs row-major and
    transposed (as nn.Linear weights multiply)."""
    import torch.distributed._functional_collectives as funcol

    from torch_tdist import async_tp

    if world < 2:  # (a scatter over one rank reaches Inductor as a plain slice: nothing to fuse)
        print(f"rank {rank}: compiled_summed_scatter needs 2 ranks; not checked", flush=True)
        return
    tg = _tdist_group({"overlap": "pipelined"})
    async_tp.enable(tg)
    m, n, ks = 256 * world, 512, (384, 128, 128)
    gen = torch.Generator(device).manual_seed(3 + rank)

    def summed_scatter(a0, a1, a2, b0, b1, b2):
        return funcol.reduce_scatter_tensor(a0 @ b0 + a1 @ b1 + a2 @ b2, "sum", 1, tg)

    for layout in ("row-major", "transposed"):
        a_s = [torch.randn(1, m, k, device=device, generator=gen).to(torch.bfloat16) for k in ks]
        b_s = [(torch.randn(k, n, device=device, generator=gen) if layout == "row-major"
                else torch.randn(n, k, device=device, generator=gen).t()).to(torch.bfloat16) for k in ks]
        served = dict(async_tp.served)
        got = torch.compile(summed_scatter)(*a_s, *b_s)
        full = sum(a.float() @ b.float() for a, b in zip(a_s, b_s))
        want = torch.empty(1, m // world, n, device=device)
        dist.reduce_scatter_tensor(want.view(m // world, n), full.view(m, n))  # (NCCL; batch 1: along dim 0)
        _relative(f"compiled summed scatter, Bs {layout}", got, want, TOLERANCE)
        regions = {op: async_tp.served[op] - served.get(op, 0) for op in async_tp.served}
        gpu_checks._checked += 1
        if regions.get("fused_matmul_reduce_scatter", 0) != 1:
            _failures.append(f"compiled summed scatter, Bs {layout}: fused regions {regions}; expected one scatter")


CHECKS = [styles, compiled, compiled_summed_scatter]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated check names")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    wanted = set(filter(None, args.only.split(",")))
    for check in CHECKS:
        if wanted and check.__name__ not in wanted:
            continue
        before, start = len(_failures), time.perf_counter()
        check(rank, world, device)
        torch.cuda.synchronize()
        status = "ok" if len(_failures) == before else f"FAILED ({len(_failures) - before})"
        print(f"rank {rank}: {check.__name__:<10} {status}  {time.perf_counter() - start:6.1f} s", flush=True)
    report_and_exit(rank, gpu_checks._checked, _failures)  # (_relative counts there)


if __name__ == "__main__":
    main()
