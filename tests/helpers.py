"""Helpers for the test modules (parent process side)."""

from __future__ import annotations

import pytest

from tests.multiproc import backend_under_test, is_tdist

WORLD_SIZES = [2, 3, 4]


def ws_param(sizes=WORLD_SIZES):
    """Parametrise a test over the `world_size` argument (ids ws2, ws3, ...)."""
    return pytest.mark.parametrize("world_size", list(sizes), ids=lambda w: f"ws{w}")


def skip_on(backend: str, reason: str):
    """Skip where the backend under test (e.g. "gloo") cannot do what the test needs."""
    return pytest.mark.skipif(backend_under_test() == backend,
                              reason=f"{backend} limitation: {reason}")


def skip_unless_tdist(what: str):
    """Call where a test reaches a tdist-only assertion (torch_tdist.stats(), tdist
    error messages).  Under another backend this ends the test as skipped."""
    if not is_tdist():
        pytest.skip(f"{what}: tdist-only assertion skipped, backend under test is "
                    f"{backend_under_test()!r} (everything before this point passed)")


def assert_served_by_tdist(diffs, ops, what=""):
    """`diffs`: per-rank stats diffs (see common.stats_diff).  Every rank must show
    that each op in `ops` was served by tdist kernels at least once, and that
    nothing fell back."""
    problems = []
    for r, d in enumerate(diffs):
        if d is None:
            problems.append(f"rank {r}: no torch_tdist.stats() (group is not a tdist group?)")
            continue
        for op in ops:
            if d.get(op, {}).get("tdist", 0) < 1:
                problems.append(f"rank {r}: stats()[{op!r}]['tdist'] did not increase (diff {d})")
        for op, v in d.items():
            if v["fallback"] != 0:
                problems.append(f"rank {r}: stats()[{op!r}]['fallback'] changed by {v['fallback']} (diff {d})")
    assert not problems, f"{what}: not served by tdist kernels:\n" + "\n".join(problems)
