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


def assert_routed(diffs, ops, route, what=""):
    """`diffs`: per-rank stats diffs (see common.stats_diff).  Every rank must show that each
    op in `ops` went to `route` ("tdist" or "fallback") at least once and never to the other
    route; when the route is "tdist", no op at all may have fallen back."""
    other = "fallback" if route == "tdist" else "tdist"
    problems = []
    for r, d in enumerate(diffs):
        if d is None:
            problems.append(f"rank {r}: no torch_tdist.stats() (group is not a tdist group?)")
            continue
        for op in ops:
            if d.get(op, {}).get(route, 0) < 1:
                problems.append(f"rank {r}: stats()[{op!r}][{route!r}] did not increase (diff {d})")
        for op in (d if route == "tdist" else ops):
            changed = d.get(op, {}).get(other, 0)
            if changed != 0:
                problems.append(f"rank {r}: stats()[{op!r}][{other!r}] changed by {changed} (diff {d})")
    assert not problems, f"{what}: not routed to {route}:\n" + "\n".join(problems)


def assert_served_by_tdist(diffs, ops, what=""):
    """Each op in `ops` was served by tdist kernels on every rank, and nothing fell back."""
    assert_routed(diffs, ops, "tdist", what)

