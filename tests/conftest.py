"""Fixtures: persistent rank pools (one per world size, shared by the whole session).

Backend under test: $TDIST_TEST_BACKEND (default "tdist").  With "gloo" the
suite checks itself against PyTorch's reference CPU backend; assertions about
tdist-specific behaviour (torch_tdist.stats(), tdist error messages) are then
skipped with a reason.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.multiproc import RankPool, backend_under_test, is_tdist, shutdown_all

_POOLS: dict = {}


def _get_pool(world_size: int) -> RankPool:
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = RankPool(world_size, backend_under_test())
        _POOLS[world_size] = pool
    return pool


def pytest_report_header(config):
    return f"distributed backend under test: {backend_under_test()!r} (TDIST_TEST_BACKEND)"


def pytest_collection_modifyitems(config, items):
    if is_tdist():
        return
    skip = pytest.mark.skip(
        reason=f"tdist-only behaviour; backend under test is {backend_under_test()!r} "
               f"(set TDIST_TEST_BACKEND=tdist)")
    for item in items:
        if item.get_closest_marker("tdist_only"):
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    shutdown_all(_POOLS.values())
    _POOLS.clear()


@pytest.fixture(scope="session")
def backend() -> str:
    return backend_under_test()


@pytest.fixture(scope="session")
def pool2() -> RankPool:
    return _get_pool(2)


@pytest.fixture(scope="session")
def pool3() -> RankPool:
    return _get_pool(3)


@pytest.fixture(scope="session")
def pool4() -> RankPool:
    return _get_pool(4)


@pytest.fixture
def pool(request, world_size) -> RankPool:
    """The pool of the test's `world_size` parameter."""
    return request.getfixturevalue(f"pool{world_size}")


@pytest.fixture
def seed(request) -> int:
    """A fresh random seed per test ($TDIST_TEST_SEED pins it to reproduce a failure).

    Jobs receive it as an argument, so a failure message (which quotes the job's
    arguments) tells which seed to pin."""
    pinned = os.environ.get("TDIST_TEST_SEED")
    s = int(pinned) if pinned else random.SystemRandom().randrange(1, 2**31)
    request.node.user_properties.append(("seed", s))
    return s
