"""Tests of the RankPool harness itself (always on gloo: independent of tdist)."""

from __future__ import annotations

import pytest

from tests import jobs_harness as J
from tests.multiproc import JobError, PoolBroken, PoolStartError, RankPool


@pytest.fixture(scope="module")
def hpool():
    pool = RankPool(2, "gloo", name="harness-pool")
    yield pool
    pool.shutdown()


def test_run_returns_per_rank_results(hpool):
    res = hpool.run(J.echo, 1, "x", key=[2])
    assert [r["rank"] for r in res] == [0, 1]
    assert [r["dist_rank"] for r in res] == [0, 1]
    assert all(r["ws"] == 2 and r["args"] == (1, "x") and r["kwargs"] == {"key": [2]} for r in res)


def test_error_on_every_rank_keeps_pool(hpool):
    pids = [r["pid"] for r in hpool.run(J.echo)]
    with pytest.raises(JobError) as info:
        hpool.run(J.raise_on, [0, 1])
    msg = str(info.value)
    assert "boom from rank 0" in msg and "boom from rank 1" in msg and "raise_on" in msg
    assert set(info.value.rank_errors) == {0, 1}
    assert [r["pid"] for r in hpool.run(J.echo)] == pids  # health check passed, same processes


def test_error_on_one_rank_restarts_pool(hpool):
    starts = hpool.starts
    with pytest.raises(JobError) as info:
        hpool.run(J.raise_on, [1], "TypeError")
    assert set(info.value.rank_errors) == {1}
    assert "TypeError: boom from rank 1" in str(info.value)
    assert hpool.run(J.echo)[1]["rank"] == 1
    assert hpool.starts == starts + 1


def test_hang_is_detected_with_stacks(hpool):
    starts = hpool.starts
    hpool.run(J.echo)
    with pytest.raises(PoolBroken) as info:
        hpool.run(J.sleep_on, [1], 60, timeout=3)
    msg = str(info.value)
    assert "did not answer within 3 s" in msg and "[1]" in msg
    assert "sleep_on" in msg  # faulthandler dump of the stuck rank
    assert hpool.run(J.sleep_on, [], 0) == ["awake", "awake"]
    assert hpool.starts == starts + 1


def test_dead_rank_is_detected(hpool):
    with pytest.raises(PoolBroken) as info:
        hpool.run(J.exit_on, [0], 7, timeout=30)
    assert "rank 0 DIED (exit code 7)" in str(info.value)
    assert hpool.run(J.exit_on, [], 7) == ["alive", "alive"]


def test_unpicklable_result_is_an_error(hpool):
    with pytest.raises(JobError):
        hpool.run(J.unpicklable_result)
    hpool.run(J.echo)


def test_run_expect_error(hpool):
    errs = hpool.run_expect_error(J.raise_on, [0, 1], exc_types=ValueError, match="boom", max_seconds=5)
    assert [e.rank for e in errs] == [0, 1] and all(e.type_name == "ValueError" for e in errs)
    with pytest.raises(AssertionError, match="rank 1 did NOT raise"):
        hpool.run_expect_error(J.raise_on, [0])
    with pytest.raises(AssertionError, match="expected one of"):
        hpool.run_expect_error(J.raise_on, [0, 1], exc_types=TypeError)
    with pytest.raises(AssertionError, match="does not contain"):
        hpool.run_expect_error(J.raise_on, [0, 1], match="tdist")
    hpool.run(J.echo)


def test_init_error_is_reported_per_rank():
    pool = RankPool(2, "no_such_backend", name="bad-backend-pool")
    with pytest.raises(PoolStartError) as info:
        pool.start()
    assert not pool.running
    errs = info.value.rank_errors
    assert set(errs) == {0, 1}, str(info.value)
    assert all(e.phase == "init_process_group" for e in errs.values()), str(info.value)


def test_interrupted_wait_tears_the_pool_down(hpool):
    """An exception while waiting (Ctrl-C, pytest-timeout) must not leave ranks busy
    with a job whose answer the next job would read."""
    import signal

    class Interrupted(Exception):
        pass

    def handler(*_):
        raise Interrupted()

    hpool.run(J.echo)
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(Interrupted):
            hpool.run(J.sleep_on, [0, 1], 30, timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not hpool.running
    assert hpool.run(J.sleep_on, [], 0) == ["awake", "awake"]


def test_failed_health_check_restarts_pool(hpool):
    starts = hpool.starts
    hpool.run(J.echo)
    with pytest.raises(JobError) as info:
        hpool.run(J.break_group)
    assert "health check" in str(info.value) and not hpool.running
    assert hpool.run(J.echo)[0]["rank"] == 0 and hpool.starts == starts + 1


def test_pool_stops_retrying_after_consecutive_breaks(monkeypatch):
    from tests import multiproc

    monkeypatch.setattr(multiproc, "MAX_CONSECUTIVE_BREAKS", 2)
    pool = RankPool(2, "no_such_backend", name="bad-backend-pool")
    for _ in range(2):
        with pytest.raises(PoolStartError):
            pool.run(J.echo)
    with pytest.raises(PoolBroken, match="not restarted"):
        pool.run(J.echo)
