"""Every c10d collective on the default group, against plain-torch references.

Parametrised over op x world size (2, 3, 4) x dtype (x reduce op).  Each job
runs several sub-cases (odd sizes, multi-dimensional, empty, a multi-block
size, non-contiguous inputs/outputs) and reports every failing sub-case.
"""

from __future__ import annotations

import pytest
import torch

from tests import jobs_collectives as J
from tests.common import MOVE_DTYPES, reduce_cases
from tests.helpers import skip_on, ws_param

REDUCE_CASES = [pytest.param(d, op, id=f"{d}-{op}") for d, op in reduce_cases()]


@ws_param()
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_all_gather_into_tensor(pool, dtype, seed):
    pool.run(J.all_gather_into_tensor, dtype, seed)


@skip_on("gloo", "all_gather_into_tensor rejects the documented stacked output form [ws, *in.shape]")
@ws_param()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_all_gather_into_tensor_stacked_output(pool, dtype, seed):
    pool.run(J.all_gather_into_tensor_stacked, dtype, seed)


@ws_param()
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_all_gather(pool, dtype, seed):
    pool.run(J.all_gather, dtype, seed)


@ws_param()
@pytest.mark.parametrize("dtype,op", REDUCE_CASES)
def test_all_reduce(pool, dtype, op, seed):
    results = pool.run(J.all_reduce, dtype, op, seed)
    # every rank must hold the same bits (no rank-dependent summation order)
    for r in range(1, len(results)):
        for (shape, mine), (_, ref) in zip(results[r], results[0]):
            assert torch.equal(mine, ref), (
                f"all_reduce {dtype} {op} {shape}: rank {r}'s result differs from rank 0's "
                f"in {(mine != ref).sum().item()} element(s) (seed {seed})")


@ws_param()
@pytest.mark.parametrize("dtype,op", REDUCE_CASES)
def test_reduce_scatter_tensor(pool, dtype, op, seed):
    pool.run(J.reduce_scatter_tensor, dtype, op, seed)


@skip_on("gloo", "reduce_scatter_tensor rejects the documented stacked input form [ws, *out.shape]")
@ws_param()
@pytest.mark.parametrize("dtype,op", [("float32", "SUM"), ("bfloat16", "AVG"), ("int32", "MAX")])
def test_reduce_scatter_tensor_stacked_input(pool, dtype, op, seed):
    pool.run(J.reduce_scatter_tensor_stacked, dtype, op, seed)


@ws_param()
@pytest.mark.parametrize("dtype,op", REDUCE_CASES)
def test_reduce_scatter(pool, dtype, op, seed):
    pool.run(J.reduce_scatter, dtype, op, seed)


@ws_param()
@pytest.mark.parametrize("dtype,op", REDUCE_CASES)
def test_reduce(pool, dtype, op, seed):
    pool.run(J.reduce, dtype, op, seed)


@ws_param()
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_all_to_all_single_even(pool, dtype, seed):
    pool.run(J.all_to_all_single_even, dtype, seed)


@ws_param()
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_all_to_all_single_uneven(pool, dtype, seed):
    pool.run(J.all_to_all_single_uneven, dtype, seed)


@ws_param()
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_all_to_all_even(pool, dtype, seed):
    pool.run(J.all_to_all_even, dtype, seed)


@skip_on("gloo", "all_to_all (lists) needs every tensor to have the same size")
@ws_param()
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_all_to_all_uneven(pool, dtype, seed):
    pool.run(J.all_to_all_uneven, dtype, seed)


@ws_param()
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_broadcast(pool, dtype, seed):
    pool.run(J.broadcast, dtype, seed)


@ws_param()
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_scatter(pool, dtype, seed):
    pool.run(J.scatter, dtype, seed)


@ws_param()
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_gather(pool, dtype, seed):
    pool.run(J.gather, dtype, seed)


@ws_param()
def test_barrier(pool, world_size, seed):
    results = pool.run(J.barrier, seed)
    rounds = len(results[0])
    for i in range(rounds):
        late = results[0][i][0]
        last_arrival = max(res[i][1] for res in results)
        first_leave = min(res[i][2] for res in results)
        assert last_arrival <= first_leave, (
            f"round {i}: a rank left the barrier at {first_leave:.4f} before rank {late} "
            f"arrived at {last_arrival:.4f}")


@skip_on("gloo", "all_reduce/broadcast/reduce on a view with gaps and all_to_all_single "
                 "into a transposed output ignore the strides (they write the raw memory)")
@ws_param()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_noncontig_outputs(pool, dtype, seed):
    pool.run(J.noncontig_outputs, dtype, seed)


ASYNC_OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
             "all_to_all_single", "all_gather", "barrier"]


@ws_param()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_async_op_wait(pool, dtype, seed):
    pool.run(J.async_ops, dtype, seed, "wait")


@ws_param()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_async_op_get_future(pool, dtype, seed):
    ops = [op for op in ASYNC_OPS if op != "reduce_scatter_tensor"]  # see the test below
    pool.run(J.async_ops, dtype, seed, "future", ops)


@skip_on("gloo", "reduce_scatter's Work does not implement get_future()")
@ws_param()
def test_async_reduce_scatter_get_future(pool, seed):
    pool.run(J.async_ops, "float32", seed, "future", ["reduce_scatter_tensor"])


@ws_param([2, 3])
def test_coalescing_manager(pool, seed):
    pool.run(J.coalescing_manager_calls, seed)


@pytest.mark.tdist_only
@ws_param([2])
def test_sync_calls_return_no_work(pool, seed):
    pool.run(J.sync_calls_return_no_work, seed)


@pytest.mark.tdist_only
@ws_param([2])
def test_profiler_sees_calls(pool, seed):
    pool.run(J.profiled_calls, seed)


@ws_param()
def test_back_to_back(pool, seed):
    pool.run(J.back_to_back, seed)
