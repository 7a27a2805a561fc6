"""Subgroups (dist.new_group) on 4 ranks: disjoint pairs used concurrently, a
non-contiguous group of 3, overlapping groups alive at once, "cpu:<backend>"
backend strings, and the default group still working afterwards."""

from __future__ import annotations

from tests import jobs_collectives as JC
from tests import jobs_groups as J
from tests.helpers import assert_served_by_tdist, skip_on, skip_unless_tdist, ws_param

SUITE = J.SUITE_OPS + J.ROOTED_OPS


def test_disjoint_pairs_concurrent(pool4, backend, seed):
    diffs = pool4.run(J.disjoint_pairs, backend, seed)
    skip_unless_tdist("subgroup collectives served by tdist kernels")
    assert_served_by_tdist(diffs, SUITE, "new_group([0, 2]) / new_group([1, 3])")


def test_group_of_three(pool4, backend, seed):
    diffs = pool4.run(J.group_of_three, backend, seed)
    assert diffs[2] is None  # rank 2 is not a member
    skip_unless_tdist("subgroup collectives served by tdist kernels")
    assert_served_by_tdist([diffs[r] for r in (0, 1, 3)], SUITE, "new_group([0, 1, 3])")


def test_overlapping_groups(pool4, backend, seed):
    diffs = pool4.run(J.overlapping_groups, backend, seed)
    skip_unless_tdist("overlapping subgroups served by tdist kernels")
    for name, members in [("A", [0, 1, 2]), ("B", [1, 2, 3]), ("C", [0, 3])]:
        assert_served_by_tdist([diffs[r][name] for r in members], J.SUITE_OPS, f"group {name}={members}")


@ws_param([3, 4])
def test_backend_string_groups(pool, world_size, backend, seed):
    diffs = pool.run(J.backend_string_groups, f"cpu:{backend}", seed)
    skip_unless_tdist('new_group(backend="cpu:tdist") served by tdist kernels')
    assert_served_by_tdist([d["full"] for d in diffs], SUITE, "new_group(all ranks, backend='cpu:tdist')")
    assert_served_by_tdist([diffs[r]["pair"] for r in (1, world_size - 1)], J.SUITE_OPS,
                           f"new_group([1, {world_size - 1}], backend='cpu:tdist')")


def test_default_group_after_subgroups(pool4, seed):
    """Runs after the subgroup tests on the same processes."""
    pool4.run(JC.back_to_back, seed)


@skip_on("gloo", "the backend option communication is tdist's")
@ws_param([2])
def test_no_communication_option(pool, seed):
    """communication=False: calls return at once, outputs untouched (the bound of a step with
    free communication); groups without the option communicate."""
    pool.run(J.no_communication, "tdist", seed)
