"""Invalid calls must raise on EVERY rank, within seconds (never hang).

With every backend: each rank raises some exception within MAX_SECONDS.
With tdist additionally (tdist-only assertions): the exception is a ValueError
or TypeError (for the meta-device case also RuntimeError) and its message names
the op (torch_tdist.stats() op names) and contains "tdist" (case-insensitive).
"""

from __future__ import annotations

import pytest

from tests import jobs_bad_input as J
from tests.helpers import skip_unless_tdist, ws_param
from tests.multiproc import PoolStartError, RankPool, backend_under_test
from torch_tdist.heap import shm_segment_names

MAX_SECONDS = 10.0
VALIDATION = (ValueError, TypeError)

# case -> (op names, one of which the tdist message must contain; exception types tdist may raise;
#          world sizes)
EXPECT = {
    "ag_list_element_wrong_size": (["all_gather"], VALIDATION, [2, 3]),
    "rs_list_too_short": (["reduce_scatter"], VALIDATION, [2, 3]),
    "rs_list_element_wrong_size": (["reduce_scatter"], VALIDATION, [2, 3]),
    "a2a_list_wrong_length": (["all_to_all"], VALIDATION, [2, 3]),
    "a2a_row_sizes_differ": (["all_to_all_single"], VALIDATION, [2, 3]),
    "a2a_sizes_differ_without_splits": (["all_to_all_single"], VALIDATION, [2, 3]),
    "band_on_bfloat16": (["all_reduce"], VALIDATION, [2, 3]),
    "avg_on_int64_reduce_scatter": (["reduce_scatter_tensor"], VALIDATION, [2, 3]),
    "avg_on_bool": (["all_reduce"], VALIDATION, [2, 3]),
    "agit_output_too_big": (["all_gather_into_tensor"], VALIDATION, [2, 3]),
    "agit_output_too_small": (["all_gather_into_tensor"], VALIDATION, [2, 3]),
    "rst_output_wrong_size": (["reduce_scatter_tensor"], VALIDATION, [2, 3]),
    "rst_indivisible": (["reduce_scatter_tensor"], VALIDATION, [3]),
    "ag_list_too_long": (["all_gather"], VALIDATION, [2, 3]),
    "ag_list_too_short": (["all_gather"], VALIDATION, [2, 3]),
    "agit_dtype_mismatch": (["all_gather_into_tensor"], VALIDATION, [2, 3]),
    "rst_dtype_mismatch": (["reduce_scatter_tensor"], VALIDATION, [2, 3]),
    "a2a_input_splits_bad_sum": (["all_to_all_single"], VALIDATION, [2, 3]),
    "a2a_output_splits_bad_sum": (["all_to_all_single"], VALIDATION, [2, 3]),
    "a2a_splits_wrong_length": (["all_to_all_single"], VALIDATION, [2, 3]),
    "avg_on_int32": (["all_reduce"], VALIDATION, [2, 3]),
    "band_on_float32": (["all_reduce"], VALIDATION, [2, 3]),
    "meta_tensor_on_cpu_backend": (["all_reduce", "allreduce"], VALIDATION + (RuntimeError,), [2, 3]),
}
assert set(EXPECT) == set(J.CASES)

PARAMS = [pytest.param(case, ws, id=f"{case}-ws{ws}") for case, (_, _, sizes) in EXPECT.items() for ws in sizes]


@pytest.mark.parametrize("case,world_size", PARAMS)
def test_bad_input_raises_on_every_rank(pool, case, world_size):
    before = shm_segment_names()
    errors = pool.run_expect_error(J.bad_call, case, max_seconds=MAX_SECONDS, timeout=60)
    assert not shm_segment_names() - before, "segments left in /dev/shm after the errors"
    ops, types, _ = EXPECT[case]
    skip_unless_tdist("exception type and message (op name, \"tdist\")")
    problems = []
    for e in errors:
        if not e.isinstance_of(types):
            problems.append(f"rank {e.rank}: {e.type_name} is not one of {[t.__name__ for t in types]}: {e.message}")
        msg = e.message.lower()
        if "tdist" not in msg:
            problems.append(f"rank {e.rank}: message does not contain 'tdist': {e.message}")
        if not any(op in msg for op in ops):
            problems.append(f"rank {e.rank}: message names none of {ops}: {e.message}")
    assert not problems, "\n".join(problems) + "\n\n" + errors[0].traceback


# ---------------------------------------------------------------------------
# bad configuration in the environment: needs fresh processes


@pytest.mark.tdist_only
@pytest.mark.parametrize("var,value", [("TDIST_TRANSPORT", "bogus"), ("TDIST_HEAP_SIZE", "banana"),
                                       ("streamed_step_blocks", "0"), ("streamed_min_block_bytes", "3000"),
                                       ("uneven_all_to_all", "yes"), ("TDIST_ASYNC_ERROR_HANDLING", "3"),
                                       ("algorithm", "sentinel")])
def test_bad_env_raises_at_group_creation(var, value):
    """A bad variable (TDIST_*) or backend option (the others) raises at init_process_group."""
    env, options = ({var: value}, None) if var.startswith("TDIST_") else (None, {var: value})
    pool = RankPool(2, backend_under_test(), env=env, pg_options=options, start_timeout=120,
                    name=f"RankPool(ws=2, {var}={value})")
    try:
        with pytest.raises(PoolStartError) as info:
            pool.start()
            # init_process_group succeeded: say whether the first collective raises instead
            replies = pool.run_raw(J.first_collective, timeout=60)
            pytest.fail(f"init_process_group did not raise with {var}={value!r}; the first all_reduce "
                        f"gave: {replies}")
    finally:
        pool.shutdown()
    err = info.value
    problems = []
    for r, x in enumerate(err.replies):
        if x == "ready" or x is None:
            problems.append(f"rank {r}: no exception reported ({x!r})")
            continue
        if x.phase != "init_process_group":
            problems.append(f"rank {r}: raised during {x.phase}, expected during init_process_group")
        if not x.isinstance_of(ValueError):
            problems.append(f"rank {r}: {x.type_name} is not a ValueError: {x.message}")
        if var not in x.message:
            problems.append(f"rank {r}: message does not mention {var}: {x.message}")
    assert not problems, "\n".join(problems) + "\n\n" + str(err)


@pytest.mark.tdist_only
def test_a_heap_too_small_raises_the_same_error_at_every_call():
    """TDIST_HEAP_SIZE below what the group's own buffers take: every call raises an error that
    names TDIST_HEAP_SIZE, the second as the first (each try makes a heap of its own, and
    closes it), and nothing is left in /dev/shm."""
    before = shm_segment_names()
    pool = RankPool(2, backend_under_test(), env={"TDIST_HEAP_SIZE": "1K"}, name="RankPool(ws=2, heap 1K)")
    try:
        replies = pool.run(J.calls_on_a_heap_too_small, timeout=60)
    finally:
        pool.shutdown()
    for rank, raised in enumerate(replies):
        for call, message in enumerate(raised):
            assert message and "TDIST_HEAP_SIZE" in message and "all_reduce" in message, \
                f"rank {rank}, call {call}: {message!r}"
    assert not shm_segment_names() - before, "segments left in /dev/shm"


@pytest.mark.tdist_only
def test_a2a_splits_inconsistent_across_ranks(pool3):
    """Split sizes that are consistent on each rank but disagree between ranks
    (rank 1 expects 3 rows from rank 0, which sends 2): the receiving rank must
    raise, nobody may hang.  The other ranks may return or raise."""
    replies = pool3.run_raw(J.a2a_inconsistent_splits, timeout=60)  # PoolBroken on a hang
    kind, err = replies[1]
    assert kind == "error", f"rank 1 did not raise: {replies}"
    assert err.isinstance_of(VALIDATION), f"{err.type_name}: {err.message}\n{err.traceback}"
    msg = err.message.lower()
    assert "tdist" in msg and "all_to_all_single" in msg, err.message
    assert err.elapsed_s <= MAX_SECONDS, f"took {err.elapsed_s:.1f} s to raise"


@pytest.mark.tdist_only
@pytest.mark.parametrize("case", ["size", "dtype", "op"])
@ws_param([2, 3])
def test_call_mismatched_across_ranks(pool, case, world_size, seed):
    """One rank's call differs from the others' (element count, dtype or collective): every
    rank that reads the odd rank's data raises a ValueError naming the op, none reads past a
    buffer or hangs, and the group keeps working afterwards."""
    before = shm_segment_names()
    outcomes = pool.run(J.mismatched_call_then_recover, case, seed, timeout=60)
    assert not shm_segment_names() - before, "segments left in /dev/shm"
    for r, outcome in enumerate(outcomes):
        assert outcome[0] == "raised", f"rank {r} did not raise: {outcomes}"
        assert outcome[1] == "ValueError", f"rank {r}: {outcome}"
        assert "tdist" in outcome[2] and "different call" in outcome[2], f"rank {r}: {outcome[2]}"


# Cases where rank 0 alone can see that its arguments are wrong -> the message its peers must
# show: its reason (rejected), or the mismatched-call machinery's (a different call).
ONE_RANK = {
    "scatter_list_too_long": "rejected", "scatter_list_too_short": "rejected",
    "scatter_list_wrong_shape": "rejected",
    "scatter_list_sparse": "rejected",
    "gather_list_too_long": "rejected", "gather_list_wrong_shape": "rejected",
    "scatter_root_dtype": "different call", "gather_root_dtype": "different call",
    "broadcast_root_shape": "different call", "broadcast_root_dtype": "different call",
    "reduce_root_shape": "different call", "reduce_root_dtype": "different call",
}


@pytest.mark.tdist_only
@pytest.mark.parametrize("case", list(ONE_RANK))
@ws_param([2, 3])
def test_one_rank_rejecting_its_arguments_fails_the_call_on_every_rank(pool, case, world_size, seed):
    """Arguments that only rank 0 can tell are wrong (the root's scatter/gather lists, the root's
    tensor): rank 0 raises its own ValueError, and the ranks waiting for the call raise too
    within a second, naming rank 0 and its reason (or a different call), instead of waiting out
    the timeout and stopping the group. The group then computes right results."""
    before = shm_segment_names()
    outcomes = pool.run(J.one_rank_rejects_then_recover, case, seed, timeout=60)
    assert not shm_segment_names() - before, "segments left in /dev/shm"
    problems = []
    for rank, outcome in enumerate(outcomes):
        if case.startswith(("broadcast", "scatter_root")) and rank == 0:
            continue  # the root reads nothing of its peers': it may return
        if outcome[0] != "raised":
            problems.append(f"rank {rank} did not raise")
            continue
        _, kind, message, seconds = outcome
        if kind not in ("ValueError", "TypeError"):
            problems.append(f"rank {rank}: {kind}: {message}")
        if seconds > 2:
            problems.append(f"rank {rank}: raised after {seconds:.1f} s")
        if rank != 0 and ONE_RANK[case] == "rejected":
            if "rank 0 rejected its arguments" not in message:
                problems.append(f"rank {rank}: rank 0 and its rejection not named: {message}")
            if case.startswith(("scatter", "gather")) and "_list" not in message:
                problems.append(f"rank {rank}: rank 0's reason not given: {message}")
        elif rank != 0 and "different call" not in message:
            problems.append(f"rank {rank}: not a mismatched call: {message}")
    assert not problems, "\n".join(problems) + f"\n{outcomes}"


@pytest.mark.tdist_only
@ws_param([2, 3])
def test_a_sparse_all_reduce_goes_to_the_fallback(pool, world_size, seed):
    """Sparse tensors, which tdist's kernels do not serve, reach the fallback (Gloo serves a sparse
    all_reduce) before any of tdist's checks read their sizes; the sum is right and counted as
    the fallback's. (The other collectives have no sparse kernel in torch's dispatcher, which
    raises before any backend sees the call.)"""
    counted = pool.run(J.sparse_all_reduce, seed, timeout=60)
    assert counted == [1] * world_size, f"calls counted as the fallback's: {counted}"


@pytest.mark.tdist_only
def test_a_rejected_scatter_in_rounds_fails_at_once_and_the_group_goes_on(seed):
    """The root rejects a scatter that takes several rounds of a small heap's staging area: it
    stands in for the first round only, as its peers stop after theirs, so every rank raises at
    once and the next scatter delivers the right data."""
    pool = RankPool(2, backend_under_test(), env={"TDIST_HEAP_SIZE": "64K"}, name="RankPool(ws=2, heap 64K)")
    try:
        outcomes = pool.run(J.rejected_scatter_in_rounds, seed, timeout=60)
    finally:
        pool.shutdown()
    for rank, outcome in enumerate(outcomes):
        assert outcome[0] == "raised" and outcome[1] == "ValueError", f"rank {rank}: {outcome}"
        assert outcome[3] < 2, f"rank {rank} raised after {outcome[3]:.1f} s"
    assert "rank 0 rejected its arguments" in outcomes[1][2], outcomes[1]
