"""Jobs for test_bad_input.py: invalid calls (every rank's, or one rank's), calls that disagree
across ranks, sparse tensors."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from torch_tdist.compat import all_gather_single, reduce_scatter_single

R = dist.ReduceOp


def _agit_output_too_big(ws):
    all_gather_single(torch.empty(ws * 4 + 1), torch.randn(4))


def _agit_output_too_small(ws):
    all_gather_single(torch.empty(ws * 4 - 1), torch.randn(4))


def _rst_output_wrong_size(ws):
    reduce_scatter_single(torch.empty(5), torch.randn(ws * 4))


def _rst_indivisible(ws):
    # 10 input elements cannot be split over 3 ranks; output of 3 (3*3 != 10)
    assert ws == 3
    reduce_scatter_single(torch.empty(3), torch.randn(10))


def _ag_list_too_long(ws):
    dist.all_gather([torch.empty(4) for _ in range(ws + 1)], torch.randn(4))


def _ag_list_too_short(ws):
    dist.all_gather([torch.empty(4) for _ in range(ws - 1)], torch.randn(4))


def _agit_dtype_mismatch(ws):
    all_gather_single(torch.empty(ws * 4, dtype=torch.float64), torch.randn(4))


def _rst_dtype_mismatch(ws):
    reduce_scatter_single(torch.empty(4, dtype=torch.float16), torch.randn(ws * 4))


def _a2a_input_splits_bad_sum(ws):
    dist.all_to_all_single(torch.empty(ws * 2), torch.randn(ws * 2), [2] * ws, [2] * (ws - 1) + [3])


def _a2a_output_splits_bad_sum(ws):
    dist.all_to_all_single(torch.empty(ws * 2), torch.randn(ws * 2), [1] * ws, [2] * ws)


def _a2a_splits_wrong_length(ws):
    dist.all_to_all_single(torch.empty(ws * 2), torch.randn(ws * 2), [2] * ws, [2] * ws + [0])


def _avg_on_int32(ws):
    dist.all_reduce(torch.ones(4, dtype=torch.int32), op=R.AVG)


def _band_on_float32(ws):
    dist.all_reduce(torch.ones(4), op=R.BAND)


def _meta_tensor_on_cpu_backend(ws):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    work = backend.allreduce([torch.empty(4, device="meta")])
    work.wait()


def _ag_list_element_wrong_size(ws):
    dist.all_gather([torch.empty(4) for _ in range(ws - 1)] + [torch.empty(5)], torch.randn(4))


def _rs_list_too_short(ws):
    dist.reduce_scatter(torch.empty(4), [torch.randn(4) for _ in range(ws - 1)])


def _rs_list_element_wrong_size(ws):
    dist.reduce_scatter(torch.empty(4), [torch.randn(4) for _ in range(ws - 1)] + [torch.randn(5)])


def _a2a_list_wrong_length(ws):
    dist.all_to_all([torch.empty(2) for _ in range(ws)], [torch.randn(2) for _ in range(ws + 1)])


def _a2a_row_sizes_differ(ws):
    dist.all_to_all_single(torch.empty(ws * 2, 2), torch.randn(ws * 2, 3))


def _a2a_sizes_differ_without_splits(ws):
    dist.all_to_all_single(torch.empty(ws, 2), torch.randn(ws * 2, 2))


def _band_on_bfloat16(ws):
    dist.all_reduce(torch.ones(4, dtype=torch.bfloat16), op=R.BAND)


def _avg_on_int64_reduce_scatter(ws):
    reduce_scatter_single(torch.empty(4, dtype=torch.int64), torch.ones(ws * 4, dtype=torch.int64), op=R.AVG)


def _avg_on_bool(ws):
    dist.all_reduce(torch.ones(4, dtype=torch.bool), op=R.AVG)


CASES = {
    "ag_list_element_wrong_size": _ag_list_element_wrong_size,
    "rs_list_too_short": _rs_list_too_short,
    "rs_list_element_wrong_size": _rs_list_element_wrong_size,
    "a2a_list_wrong_length": _a2a_list_wrong_length,
    "a2a_row_sizes_differ": _a2a_row_sizes_differ,
    "a2a_sizes_differ_without_splits": _a2a_sizes_differ_without_splits,
    "band_on_bfloat16": _band_on_bfloat16,
    "avg_on_int64_reduce_scatter": _avg_on_int64_reduce_scatter,
    "avg_on_bool": _avg_on_bool,
    "agit_output_too_big": _agit_output_too_big,
    "agit_output_too_small": _agit_output_too_small,
    "rst_output_wrong_size": _rst_output_wrong_size,
    "rst_indivisible": _rst_indivisible,
    "ag_list_too_long": _ag_list_too_long,
    "ag_list_too_short": _ag_list_too_short,
    "agit_dtype_mismatch": _agit_dtype_mismatch,
    "rst_dtype_mismatch": _rst_dtype_mismatch,
    "a2a_input_splits_bad_sum": _a2a_input_splits_bad_sum,
    "a2a_output_splits_bad_sum": _a2a_output_splits_bad_sum,
    "a2a_splits_wrong_length": _a2a_splits_wrong_length,
    "avg_on_int32": _avg_on_int32,
    "band_on_float32": _band_on_float32,
    "meta_tensor_on_cpu_backend": _meta_tensor_on_cpu_backend,
}


def bad_call(rank, ws, case):
    CASES[case](ws)
    return "returned without raising"


def first_collective(rank, ws):
    t = torch.ones(3)
    dist.all_reduce(t)
    return t.tolist()


def calls_on_a_heap_too_small(rank, ws):
    """Two all_reduces on a group whose heap cannot hold its own buffers: what each raised."""
    raised = []
    for _ in range(2):
        try:
            dist.all_reduce(torch.randn(3))
            raised.append(None)
        except Exception as err:  # noqa: BLE001
            raised.append(str(err))
    return raised


def a2a_inconsistent_splits(rank, ws):
    """Every rank sends 2 rows to every rank, but rank 1 expects 3 rows from rank 0
    (its own split lists are locally consistent)."""
    out_splits = [2] * ws
    if rank == 1:
        out_splits[0] = 3
    out = torch.empty(sum(out_splits))
    dist.all_to_all_single(out, torch.randn(2 * ws), out_splits, [2] * ws)
    return "returned without raising"


# ---------------------------------------------------------------------------
# calls that disagree between ranks (every rank is locally consistent)

def _mismatched_call(rank, ws, case, seed):
    g = torch.Generator().manual_seed(seed + rank)
    if case == "size":  # rank 0 gathers 4 elements, the others 6
        n = 4 if rank == 0 else 6
        all_gather_single(torch.empty(n * ws), torch.randn(n, generator=g))
    elif case == "dtype":  # rank 0 reduces int32, the others float32
        x = torch.randint(0, 9, (8,), generator=g, dtype=torch.int32) if rank == 0 else torch.randn(8, generator=g)
        dist.all_reduce(x)
    elif case == "op":  # rank 0 reduces, the others gather the same number of elements
        x = torch.randn(8, generator=g)
        if rank == 0:
            dist.all_reduce(x)
        else:
            all_gather_single(torch.empty(8 * ws), x)
    return "returned without raising"


def mismatched_call_then_recover(rank, ws, case, seed):
    """Run a call that disagrees across ranks; report how it ended on this rank, then check
    the group still computes correctly."""
    try:
        outcome = ("returned", _mismatched_call(rank, ws, case, seed))
    except Exception as err:  # noqa: BLE001  (the test inspects what was raised)
        outcome = ("raised", type(err).__name__, str(err))
    xs = [torch.randn(100, generator=torch.Generator().manual_seed(seed * 7 + r)) for r in range(ws)]
    x = xs[rank].clone()
    dist.all_reduce(x)
    assert torch.allclose(x, sum(xs), rtol=1e-5, atol=1e-5), "the group computes wrong results after the error"
    return outcome


# ---------------------------------------------------------------------------
# arguments that only one rank can see are wrong (the root's lists, one rank's tensor)

def _one_rank_rejects(rank, ws, case, seed, group=None):
    """Rank 0 (the root where there is one) passes arguments that only it can tell are wrong;
    the other ranks' arguments are right."""
    g = torch.Generator(torch.get_default_device()).manual_seed(seed + rank)
    kw = {"group": group}
    root = 0
    mine = rank == root
    if case == "scatter_list_too_long":
        dist.scatter(torch.empty(4), [torch.randn(4, generator=g) for _ in range(ws + 1)] if mine else None, src=root, **kw)
    elif case == "scatter_list_too_short":
        dist.scatter(torch.empty(4), [torch.randn(4, generator=g) for _ in range(ws - 1)] if mine else None, src=root, **kw)
    elif case == "scatter_list_wrong_shape":
        dist.scatter(torch.empty(4), [torch.randn(5, generator=g) for _ in range(ws)] if mine else None, src=root, **kw)
    elif case == "scatter_root_dtype":  # the root's whole call in float64, the others' in float32
        dt = torch.float64 if mine else torch.float32
        dist.scatter(torch.empty(4, dtype=dt), [torch.randn(4, generator=g, dtype=dt) for _ in range(ws)] if mine
                     else None, src=root, **kw)
    elif case == "gather_root_dtype":
        dt = torch.float64 if mine else torch.float32
        dist.gather(torch.randn(4, generator=g, dtype=dt), [torch.empty(4, dtype=dt) for _ in range(ws)] if mine
                    else None, dst=root, **kw)
    elif case == "gather_list_too_long":
        dist.gather(torch.randn(4, generator=g), [torch.empty(4) for _ in range(ws + 1)] if mine else None, dst=root, **kw)
    elif case == "gather_list_wrong_shape":
        dist.gather(torch.randn(4, generator=g), [torch.empty(3) for _ in range(ws)] if mine else None, dst=root, **kw)
    elif case == "scatter_list_sparse":
        dist.scatter(torch.empty(4), [torch.randn(4, generator=g).to_sparse() for _ in range(ws)] if mine else None,
                     src=root, **kw)
    elif case == "broadcast_root_shape":
        dist.broadcast(torch.randn(5 if mine else 4, generator=g), src=root, **kw)
    elif case == "broadcast_root_dtype":
        dist.broadcast(torch.randn(4, generator=g, dtype=torch.float64 if mine else torch.float32), src=root, **kw)
    elif case == "reduce_root_shape":
        dist.reduce(torch.randn(5 if mine else 4, generator=g), dst=root, **kw)
    elif case == "reduce_root_dtype":
        dist.reduce(torch.randn(4, generator=g, dtype=torch.float64 if mine else torch.float32), dst=root, **kw)
    else:
        raise KeyError(case)


def one_rank_rejects_then_recover(rank, ws, case, seed, group=None):
    """How the call ended on this rank ("returned" or "raised", type, message, seconds), after
    checking that the group (default: the default group) still computes a right all_reduce."""
    start = time.monotonic()
    try:
        _one_rank_rejects(rank, ws, case, seed, group)
        outcome = ("returned",)
    except Exception as err:  # noqa: BLE001  (the test inspects what was raised)
        outcome = ("raised", type(err).__name__, str(err).splitlines()[0], time.monotonic() - start)
    xs = [torch.randn(100, generator=torch.Generator().manual_seed(seed * 7 + r), device="cpu") for r in range(ws)]
    x = xs[rank].to(torch.get_default_device(), copy=True)
    dist.all_reduce(x, group=group)
    assert torch.allclose(x.cpu(), sum(xs), rtol=1e-5, atol=1e-5), "the group computes wrong results after the error"
    return outcome


# ---------------------------------------------------------------------------
# tensors that are not strided (sparse) go to the fallback

def _sparse(g, n=16, nnz=5):
    index = torch.randperm(n, generator=g)[:nnz].sort().values.unsqueeze(0)
    return torch.sparse_coo_tensor(index, torch.randn(nnz, generator=g), (n,))


def sparse_all_reduce(rank, ws, seed):
    """A sparse all_reduce (which Gloo serves): the dense sum of every rank's tensor, and the
    call counted as the fallback's."""
    import torch_tdist

    tensors = [_sparse(torch.Generator().manual_seed(seed + r)) for r in range(ws)]
    before = torch_tdist.stats()["all_reduce"]["fallback"]
    x = tensors[rank].clone()
    dist.all_reduce(x)
    assert x.layout == torch.sparse_coo, x.layout
    expected = sum(t.to_dense() for t in tensors)
    assert torch.allclose(x.to_dense(), expected, rtol=1e-6, atol=1e-6), "the sparse sum is wrong"
    return torch_tdist.stats()["all_reduce"]["fallback"] - before


def rejected_scatter_in_rounds(rank, ws, seed):
    """A scatter large enough to take several rounds of the staging area, whose root passes one
    tensor too many: how it ended on each rank (kind, message, seconds), then a right scatter."""
    n = 4096  # floats per rank: several rounds on a 64K heap
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=g) for _ in range(ws)]
    start = time.monotonic()
    try:
        dist.scatter(torch.empty(n), parts + [parts[0]] if rank == 0 else None, src=0)
        outcome = ("returned",)
    except Exception as err:  # noqa: BLE001  (the test inspects what was raised)
        outcome = ("raised", type(err).__name__, str(err).splitlines()[0], time.monotonic() - start)
    out = torch.empty(n)
    dist.scatter(out, parts if rank == 0 else None, src=0)
    assert torch.equal(out, parts[rank]), "the scatter after the rejected one delivered wrong data"
    return outcome
