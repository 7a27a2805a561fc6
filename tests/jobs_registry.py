"""Jobs for test_registry.py (run inside the rank processes)."""

import torch
import torch.distributed as dist


def adding_an_algorithm(rank, ws, blocks, seed):
    """Runs ``blocks``, the code of docs/architecture.md's "Adding an algorithm" (the module, the
    registry line, a group that forces it), then all_reduces on that group: sizes it fits and
    one it does not (a share that is not whole). Returns the ops and sizes the new algorithm
    served; raises if a result is wrong."""
    import torch_tdist  # noqa: F401  (registers the backend)

    module, registration, usage = blocks
    namespace = {}
    exec(module, namespace)
    exec(registration, namespace)
    served = []
    algorithm_class = namespace["ReduceThenGather"]
    run = algorithm_class.run
    algorithm_class.run = lambda self, ctx, call: (served.append(call.n), run(self, ctx, call))
    try:
        exec(usage, namespace)  # (its all_reduce: 8 x world elements)
        group, x = namespace["group"], namespace["x"]
        want = sum(torch.arange(8 * ws, dtype=torch.float32) + r for r in range(ws))
        assert torch.equal(x, want), "the example's all_reduce: wrong result"
        for i, (n, dtype) in enumerate(((ws * 1000, torch.float32), (ws * 333, torch.bfloat16),
                                        (ws * 7 + 1, torch.float32))):
            xs = [torch.randn(n, generator=torch.Generator().manual_seed(seed + 31 * i + r)).to(dtype)
                  for r in range(ws)]
            got = xs[rank].clone()
            dist.all_reduce(got, group=group)
            want = torch.stack([t.double() for t in xs]).sum(0)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            assert torch.allclose(got.double(), want, rtol=tol, atol=tol), f"all_reduce n={n} {dtype}: wrong result"
    finally:
        algorithm_class.run = run
    dist.destroy_process_group(group)
    return served
