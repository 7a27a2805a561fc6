"""A persistent pool of rank processes for distributed tests.

Spawning and initialising a process group per test is far too slow (importing
torch and triton alone takes seconds), so each world size gets one pool of
rank processes per pytest session.  Every rank process

* sets a few environment variables (``OMP_NUM_THREADS=1`` ...),
* imports torch (and ``torch_tdist`` when the backend under test is "tdist"),
* joins ``dist.init_process_group(backend, store=TCPStore, ...)`` whose store
  server lives in the parent (pytest) process, so no port can be stolen,
* then loops: receives a job ``(fn, args, kwargs)``, runs
  ``fn(rank, world_size, *args, **kwargs)`` and answers ``("ok", result)`` or
  ``("error", ExceptionInfo)``.

``fn`` must be a module-level function of an importable module (spawn pickles
it by reference): put jobs in ``tests/jobs_*.py``.

API::

    pool = RankPool(world_size, backend)       # started lazily
    results = pool.run(fn, *args, timeout=60)  # list of per-rank results
    errs = pool.run_expect_error(fn, *args, exc_types=(ValueError,),
                                 match=("tdist",))  # every rank must raise
    pool.shutdown()                            # shutdown_all(pools): several at once

If a rank raises, ``run`` raises :class:`JobError` (an AssertionError) with
every failing rank's traceback.  If a rank does not answer within
``timeout`` or a rank process dies, the pool dumps the Python stacks of the
stuck ranks (faulthandler), kills all its processes and raises
:class:`PoolBroken` (also an AssertionError); the next ``run`` starts a fresh
set of processes.  After a job in which some ranks raised and others did not,
the group may be out of step, so the pool is restarted as well; after a job in
which every rank raised, a quick health check (all_reduce) decides.

Each rank's stdout/stderr go to a log file; failures quote its tail (TDIST_TEST_KEEP_LOGS=1 keeps
the files, under the temporary directory, for a look at a kernel's prints).
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, Sequence

import multiprocessing as _mp

__all__ = [
    "RankPool",
    "JobError",
    "PoolBroken",
    "PoolStartError",
    "RankException",
    "backend_under_test",
    "is_tdist",
    "DEFAULT_WORKER_ENV",
]

# Environment every rank process gets (the caller's `env` overrides these).
DEFAULT_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "TORCH_SHOW_CPP_STACKTRACES": "0",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}

_LOG_TAIL_CHARS = 4000

# After this many consecutive broken jobs (hang, crash, failed start) with no good
# job in between, a pool stops restarting and fails its jobs at once, so that a
# backend that hangs everywhere cannot blow the CI time budget (0 = always retry).
MAX_CONSECUTIVE_BREAKS = int(os.environ.get("TDIST_TEST_MAX_BREAKS", "3"))


def backend_under_test() -> str:
    """Backend under test: $TDIST_TEST_BACKEND, default "tdist"."""
    return os.environ.get("TDIST_TEST_BACKEND", "tdist")


def is_tdist(backend: str | None = None) -> bool:
    b = backend_under_test() if backend is None else backend
    # "tdist", "cpu:tdist", "cpu:tdist,cuda:nccl" ...
    return "tdist" in b


# --------------------------------------------------------------------------
# exceptions


@dataclass
class RankException:
    """A picklable description of an exception raised on one rank."""

    rank: int
    type_name: str
    mro_names: tuple  # names of every class in type(exc).__mro__
    message: str
    traceback: str
    phase: str = "job"  # "job", "import" or "init_process_group"
    elapsed_s: float = 0.0  # time from job start to the raise

    def isinstance_of(self, types: Sequence[type] | type) -> bool:
        if isinstance(types, type):
            types = (types,)
        return any(t.__name__ in self.mro_names for t in types)

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"


class JobError(AssertionError):
    """A job raised on one or more ranks."""

    def __init__(self, msg: str, rank_errors: dict):
        super().__init__(msg)
        self.rank_errors = rank_errors  # rank -> RankException


class PoolBroken(AssertionError):
    """A rank hung or died; the pool was torn down (restarted on next use)."""


class PoolStartError(AssertionError):
    """The rank processes could not be started / could not init the group."""

    def __init__(self, msg: str, replies: list):
        super().__init__(msg)
        # per rank: RankException (init failed), "ready", or None (no answer)
        self.replies = replies

    @property
    def rank_errors(self) -> dict:
        return {r: x for r, x in enumerate(self.replies) if isinstance(x, RankException)}


def _describe_exc(exc: BaseException, rank: int, phase: str, t0: float | None = None) -> RankException:
    return RankException(
        rank=rank,
        type_name=type(exc).__name__,
        mro_names=tuple(c.__name__ for c in type(exc).__mro__),
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        phase=phase,
        elapsed_s=(time.monotonic() - t0) if t0 is not None else 0.0,
    )


# --------------------------------------------------------------------------
# the rank process


def _worker_main(rank, world_size, backend, store_host, store_port, conn, env,
                 init_pg, pg_timeout_s, log_path, pg_options=None):
    # Everything below runs in a freshly spawned interpreter.
    os.environ.update(env)
    # Send this process's output (C++ included) to its log file.
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    except OSError:
        pass
    import faulthandler
    import warnings

    # torch 2.13 deprecates several c10d names the tests use on purpose; keep the
    # logs (quoted in failure messages) readable.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)

    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        # The parent sends SIGUSR1 to a rank that hangs: dump every thread's stack.
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    phase = "import"
    try:
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist

        if is_tdist(backend):
            import torch_tdist  # noqa: F401  (registers the "tdist" backend)
        if init_pg:
            from datetime import timedelta

            phase = "init_process_group"
            store = dist.TCPStore(store_host, store_port, world_size, is_master=False,
                                  timeout=timedelta(seconds=60))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout_s),
                                    pg_options=pg_options if is_tdist(backend) else None)
    except BaseException as exc:  # noqa: BLE001
        conn.send(("init_error", _describe_exc(exc, rank, phase)))
        conn.close()
        return
    conn.send(("ready", os.getpid()))

    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not payload:
            break
        t0 = time.monotonic()
        seq = None
        try:
            seq, fn, args, kwargs = pickle.loads(payload)
            reply = ("ok", fn(rank, world_size, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001
            reply = ("error", _describe_exc(exc, rank, "job", t0))
        try:
            data = pickle.dumps((seq, reply))
        except BaseException as exc:  # noqa: BLE001  (unpicklable result)
            data = pickle.dumps((seq, ("error", _describe_exc(exc, rank, "job", t0))))
        conn.send_bytes(data)
        sys.stdout.flush()
        sys.stderr.flush()

    if init_pg:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
    conn.close()


# --------------------------------------------------------------------------
# health check job (module-level so that it pickles)


def _health_check(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    expected = world_size * (world_size + 1) / 2
    if not torch.all(t == expected):
        raise AssertionError(f"health check all_reduce gave {t.tolist()}, expected {expected}")
    dist.barrier()
    return True


# --------------------------------------------------------------------------
# the pool

_LIVE_POOLS: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


def _shutdown_all_pools():
    try:
        shutdown_all(list(_LIVE_POOLS), grace_s=2.0)
    except Exception:  # noqa: BLE001
        pass


atexit.register(_shutdown_all_pools)


@dataclass
class _Generation:
    procs: list
    conns: list
    store: Any
    logdir: str
    log_paths: list
    pids: list = field(default_factory=list)


def shutdown_all(pools, grace_s: float = 10.0) -> None:
    """Stops ``pools`` together (politely, then by force): every pool is asked before any is
    waited for, so that their ranks' exits (a second or two each: process groups and heaps go)
    overlap."""
    pools = list(pools)
    for pool in pools:
        pool._ask_to_stop()
    deadline = time.monotonic() + grace_s
    for pool in pools:
        pool._stop_by(deadline)


class RankPool:
    """``world_size`` persistent rank processes sharing one process group."""

    def __init__(self, world_size: int, backend: str | None = None, *, env: dict | None = None,
                 init_pg: bool = True, pg_timeout_s: float = 60.0, start_timeout: float = 120.0,
                 health_check: bool = True, name: str | None = None, pg_options: dict | None = None):
        self.world_size = int(world_size)
        self.backend = backend_under_test() if backend is None else backend
        self.env = dict(DEFAULT_WORKER_ENV)
        if env:
            self.env.update(env)
        self.init_pg = init_pg
        self.pg_options = pg_options  # the default group's backend options (a tdist group's config)
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout = start_timeout
        self.health_check = health_check and init_pg
        self.name = name or f"RankPool(ws={self.world_size}, backend={self.backend!r})"
        self._gen: _Generation | None = None
        self._seq = 0
        self._consecutive_breaks = 0
        self._last_break = ""
        self.starts = 0  # how many times processes were (re)started
        _LIVE_POOLS.add(self)

    def __repr__(self):
        return f"<{self.name} {'running' if self._gen else 'stopped'}, starts={self.starts}>"

    # ---------------------------------------------------------------- start/stop
    @property
    def running(self) -> bool:
        return self._gen is not None

    def start(self) -> None:
        """Start the rank processes (no-op if running).  Raises PoolStartError."""
        if self._gen is not None:
            return
        if MAX_CONSECUTIVE_BREAKS and self._consecutive_breaks >= MAX_CONSECUTIVE_BREAKS:
            raise PoolBroken(
                f"{self.name}: not restarted: its last {self._consecutive_breaks} jobs/starts hung, crashed "
                f"or failed to start (set TDIST_TEST_MAX_BREAKS=0 to always retry). The last one:\n"
                f"{self._last_break}")
        try:
            self._start()
        except PoolStartError as exc:
            self._note_break(str(exc))
            raise

    def _note_break(self, msg: str) -> None:
        self._consecutive_breaks += 1
        self._last_break = msg[:6000]

    def _start(self) -> None:
        import torch.distributed as dist
        from datetime import timedelta

        ctx = _mp.get_context("spawn")
        store = None
        store_port = 0
        if self.init_pg:
            store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=60))
            store_port = store.port
        logdir = tempfile.mkdtemp(prefix=f"tdist-test-ws{self.world_size}-")
        gen = _Generation(procs=[], conns=[], store=store, logdir=logdir, log_paths=[])
        self._gen = gen
        self.starts += 1
        try:
            for rank in range(self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                log_path = os.path.join(logdir, f"rank{rank}.log")
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, self.backend, "127.0.0.1", store_port, child_conn,
                          self.env, self.init_pg, self.pg_timeout_s, log_path, self.pg_options),
                    name=f"tdist-test-rank{rank}-ws{self.world_size}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                gen.procs.append(proc)
                gen.conns.append(parent_conn)
                gen.log_paths.append(log_path)
                gen.pids.append(proc.pid)
        except BaseException:
            self._teardown()
            raise

        replies: list = [None] * self.world_size
        pending = {gen.conns[r]: r for r in range(self.world_size)}
        deadline = time.monotonic() + self.start_timeout
        first_error_at = None
        while pending:
            now = time.monotonic()
            limit = deadline
            if first_error_at is not None:
                # once one rank failed, give the others a short grace period
                limit = min(limit, first_error_at + 10.0)
            if now >= limit:
                break
            waitables = list(pending) + [gen.procs[r].sentinel for r in pending.values()]
            ready = _mp_wait(waitables, timeout=limit - now)
            for obj in ready:
                if obj in pending:
                    r = pending[obj]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        msg = ("died", None)
                    del pending[obj]
                    if msg[0] == "ready":
                        replies[r] = "ready"
                    else:
                        replies[r] = msg[1] if msg[0] == "init_error" else None
                        if first_error_at is None:
                            first_error_at = time.monotonic()
                else:
                    # a process exited; its answer (if any) is still in the pipe
                    for conn, r in list(pending.items()):
                        if gen.procs[r].sentinel is obj and not conn.poll():
                            del pending[conn]
                            if first_error_at is None:
                                first_error_at = time.monotonic()
        if all(x == "ready" for x in replies):
            return
        lines = [f"{self.name}: could not start the rank processes"]
        for r, x in enumerate(replies):
            if x == "ready":
                lines.append(f"  rank {r}: ready")
            elif isinstance(x, RankException):
                lines.append(f"  rank {r}: {x.phase} raised {x.type_name}: {x.message}")
            elif r in pending.values():
                lines.append(f"  rank {r}: no answer within the start timeout")
            else:
                lines.append(f"  rank {r}: died (exit code {gen.procs[r].exitcode})")
        for r, x in enumerate(replies):
            if isinstance(x, RankException):
                lines.append(f"---- rank {r} traceback ----\n{x.traceback}")
        stuck = [r for r in range(self.world_size) if replies[r] != "ready" and not isinstance(replies[r], RankException)]
        lines.append(self._dump_and_collect_logs(stuck))
        self._teardown()
        raise PoolStartError("\n".join(lines), replies)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the rank processes (politely, then by force)."""
        shutdown_all([self], grace_s)

    def _ask_to_stop(self) -> None:
        for conn in (self._gen.conns if self._gen is not None else []):
            try:
                conn.send_bytes(b"")
            except (OSError, ValueError):
                pass

    def _stop_by(self, deadline: float) -> None:
        """Wait for the rank processes until ``deadline`` (time.monotonic), then end them."""
        for proc in (self._gen.procs if self._gen is not None else []):
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._teardown()

    def _teardown(self) -> None:
        gen = self._gen
        self._gen = None
        if gen is None:
            return
        for proc in gen.procs:
            if proc.is_alive():
                proc.kill()
        for proc in gen.procs:
            proc.join(timeout=10)
        for conn in gen.conns:
            try:
                conn.close()
            except OSError:
                pass
        for p in ([] if os.environ.get("TDIST_TEST_KEEP_LOGS") else gen.log_paths):
            try:
                os.unlink(p)
            except OSError:
                pass
        try:
            os.rmdir(gen.logdir)
        except OSError:
            pass
        gen.store = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ---------------------------------------------------------------- logs
    def _log_tail(self, rank: int, chars: int = _LOG_TAIL_CHARS) -> str:
        gen = self._gen
        if gen is None:
            return ""
        try:
            with open(gen.log_paths[rank], "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - chars))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _dump_and_collect_logs(self, ranks: Sequence[int]) -> str:
        """Ask `ranks` to dump their stacks (SIGUSR1 -> faulthandler), return log tails."""
        gen = self._gen
        if gen is None or not ranks:
            return ""
        dumped = False
        for r in ranks:
            proc = gen.procs[r]
            if proc.is_alive() and hasattr(signal, "SIGUSR1"):
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    dumped = True
                except OSError:
                    pass
        if dumped:
            time.sleep(1.0)
        out = []
        for r in ranks:
            tail = self._log_tail(r).rstrip()
            if tail:
                out.append(f"---- rank {r} log (tail; stacks dumped on hang) ----\n{tail}")
        return "\n".join(out)

    # ---------------------------------------------------------------- jobs
    def _dispatch(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        self._seq += 1
        payload = pickle.dumps((self._seq, fn, args, kwargs))  # fails here, before any rank got it
        self.start()
        try:
            replies = self._dispatch_started(fn, args, kwargs, timeout, payload, self._seq)
            self._consecutive_breaks = 0
            return replies
        except PoolBroken as exc:
            self._note_break(str(exc))
            raise
        except BaseException:
            # interrupted (KeyboardInterrupt, pytest-timeout ...): the ranks may still be
            # busy with this job, so the pool cannot be trusted any more
            self._teardown()
            raise

    def _dispatch_started(self, fn, args, kwargs, timeout, payload, seq) -> list:
        gen = self._gen
        assert gen is not None
        what = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}{_short_args(args, kwargs)}"
        for r, conn in enumerate(gen.conns):
            try:
                conn.send_bytes(payload)
            except (OSError, ValueError) as exc:
                msg = (f"{self.name}: could not send job {what} to rank {r} "
                       f"(exit code {gen.procs[r].exitcode}): {exc}\n" + self._dump_and_collect_logs([r]))
                self._teardown()
                raise PoolBroken(msg) from None

        replies: list = [None] * self.world_size
        pending = {gen.conns[r]: r for r in range(self.world_size)}
        deadline = time.monotonic() + timeout
        dead: list = []
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = list(pending) + [gen.procs[r].sentinel for r in pending.values()]
            ready = _mp_wait(waitables, timeout=remaining)
            for obj in ready:
                if obj in pending:
                    r = pending[obj]
                    try:
                        got_seq, reply = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        dead.append(r)
                        del pending[obj]
                        continue
                    if got_seq != seq:
                        continue  # a stale answer to an earlier job: keep waiting
                    replies[r] = reply
                    del pending[obj]
                else:
                    for conn, r in list(pending.items()):
                        if gen.procs[r].sentinel is obj and not conn.poll():
                            del pending[conn]
                            dead.append(r)
            if dead:
                break
        if not pending and not dead:
            return replies

        # Somebody hung or died: report everything we know, then tear down.
        stuck = sorted(pending.values())
        lines = [f"{self.name}: job {what} failed:"]
        for r in sorted(dead):
            gen.procs[r].join(timeout=2)
            lines.append(f"  rank {r} DIED (exit code {gen.procs[r].exitcode})")
        if stuck and not dead:
            lines.append(f"  ranks {stuck} did not answer within {timeout:.0f} s (hang?)")
        elif stuck:
            lines.append(f"  ranks {stuck} had not answered yet")
        for r, rep in enumerate(replies):
            if rep is None:
                continue
            if rep[0] == "ok":
                lines.append(f"  rank {r}: finished OK")
            else:
                lines.append(f"  rank {r}: raised {rep[1].type_name}: {rep[1].message}")
        for r, rep in enumerate(replies):
            if rep is not None and rep[0] == "error":
                lines.append(f"---- rank {r} traceback ----\n{rep[1].traceback}")
        lines.append(self._dump_and_collect_logs(sorted(set(stuck) | set(dead))))
        lines.append("(the pool was torn down; the next job starts fresh processes)")
        self._teardown()
        raise PoolBroken("\n".join(lines))

    def _after_errors(self, replies: list) -> str:
        """Called when some rank raised.  Returns a note about the pool state."""
        n_err = sum(1 for rep in replies if rep[0] == "error")
        if n_err < self.world_size:
            self._teardown()
            return ("(only some ranks raised, the group may be out of step: "
                    "the pool was torn down and restarts for the next job)")
        if not self.health_check:
            return ""
        try:
            replies = self._dispatch(_health_check, (), {}, 30.0)
        except AssertionError as exc:  # PoolBroken: already torn down
            return f"(the health check after the error hung or crashed, pool restarted: {str(exc)[:2000]})"
        errors = [f"rank {r}: {rep[1]}" for r, rep in enumerate(replies) if rep[0] == "error"]
        if not errors:
            return ""
        self._teardown()
        return ("(the health check (all_reduce + barrier on the default group) after the error failed, "
                "the pool was torn down and restarts for the next job:\n  " + "\n  ".join(errors) + ")")

    def run_raw(self, fn: Callable, *args, timeout: float = 60.0, **kwargs) -> list:
        """Run and return the per-rank replies ("ok", result) / ("error", RankException)
        without raising for job errors (PoolBroken is still raised)."""
        replies = self._dispatch(fn, args, kwargs, timeout)
        if any(rep[0] == "error" for rep in replies):
            self._after_errors(replies)
        return replies

    def run(self, fn: Callable, *args, timeout: float = 60.0, **kwargs) -> list:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank.

        Returns the list of per-rank return values.  Raises JobError if any rank
        raised, PoolBroken if a rank hung (no answer within ``timeout``) or died.
        """
        replies = self._dispatch(fn, args, kwargs, timeout)
        errors = {r: rep[1] for r, rep in enumerate(replies) if rep[0] == "error"}
        if not errors:
            return [rep[1] for rep in replies]
        note = self._after_errors(replies)
        what = f"{getattr(fn, '__qualname__', fn)}{_short_args(args, kwargs)}"
        lines = [f"{self.name}: job {what} raised on rank(s) {sorted(errors)}:"]
        for r, e in sorted(errors.items()):
            lines.append(f"  rank {r}: {e.type_name}: {_clip(e.message, 600)}")
        for r, e in sorted(errors.items()):
            lines.append(f"---- rank {r} traceback ----\n{e.traceback}")
        if note:
            lines.append(note)
        raise JobError("\n".join(lines), errors)

    def run_expect_error(self, fn: Callable, *args, exc_types: Sequence[type] | type | None = None,
                         match: Sequence[str] | str | None = None, match_any: Sequence[str] | None = None,
                         case_sensitive: bool = False, max_seconds: float | None = None,
                         timeout: float = 30.0, **kwargs) -> list:
        """Run a job that must raise on EVERY rank.

        exc_types: every rank's exception must be an instance of one of these
          (checked by class name along the exception's MRO).
        match: substrings that must ALL occur in every rank's message.
        match_any: at least one of these substrings must occur.
        max_seconds: each rank must have raised within this many seconds of the job start.
        Returns the list of RankException (one per rank).
        """
        replies = self._dispatch(fn, args, kwargs, timeout)
        errors = [rep[1] if rep[0] == "error" else None for rep in replies]
        if any(e is not None for e in errors):
            self._after_errors(replies)
        what = f"{getattr(fn, '__qualname__', fn)}{_short_args(args, kwargs)}"
        problems = []
        if isinstance(exc_types, type):
            exc_types = (exc_types,)
        if isinstance(match, str):
            match = (match,)

        def norm(s):
            return s if case_sensitive else s.lower()

        for r, e in enumerate(errors):
            if e is None:
                problems.append(f"rank {r} did NOT raise (returned {_clip(repr(replies[r][1]), 200)})")
                continue
            if exc_types and not e.isinstance_of(exc_types):
                problems.append(f"rank {r} raised {e.type_name} (mro {list(e.mro_names)}), expected one of "
                                f"{[t.__name__ for t in exc_types]}: {_clip(e.message, 400)}")
            for m in match or ():
                if norm(m) not in norm(e.message):
                    problems.append(f"rank {r}: message does not contain {m!r}: {_clip(e.message, 400)}")
            if match_any and not any(norm(m) in norm(e.message) for m in match_any):
                problems.append(f"rank {r}: message contains none of {list(match_any)}: {_clip(e.message, 400)}")
            if max_seconds is not None and e.elapsed_s > max_seconds:
                problems.append(f"rank {r}: took {e.elapsed_s:.1f} s to raise (limit {max_seconds} s)")
        if problems:
            lines = [f"{self.name}: job {what}: expected every rank to raise:"] + ["  " + p for p in problems]
            for r, e in enumerate(errors):
                if e is not None:
                    lines.append(f"---- rank {r} traceback ----\n{e.traceback}")
            raise AssertionError("\n".join(lines))
        return errors


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _short_args(args: tuple, kwargs: dict) -> str:
    parts = [_clip(repr(a), 80) for a in args] + [f"{k}={_clip(repr(v), 80)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"
