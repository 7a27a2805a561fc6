"""Helpers shared by the test modules and the job modules (run inside the ranks).

Data: every rank builds every rank's input deterministically from the seed that
the test drew (``rank_gen(seed, r, salt)``), so each rank can compute the
expected result of a collective with plain torch ops, independently of the
backend under test.  Inputs are random and never zero.
"""

from __future__ import annotations

import os

import torch

# dtypes are passed around by name: readable test ids, trivially picklable.
FLOAT_DTYPES = ["float32", "float16", "bfloat16", "float64"]
INT_DTYPES = ["int32", "int64"]
REDUCE_DTYPES = FLOAT_DTYPES + INT_DTYPES
MOVE_DTYPES = REDUCE_DTYPES + ["uint8", "int8", "bool"]  # data movement: any dtype
REDUCE_OPS = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]

# Every c10d op that torch_tdist.stats() reports.
STATS_OPS = [
    "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter",
    "all_reduce", "all_to_all_single", "all_to_all", "broadcast", "barrier", "scatter",
    "gather", "reduce", "send", "recv",
]


def reduce_cases():
    """(dtype, op) pairs that a reduction must support (AVG only for floating dtypes)."""
    return [(d, op) for d in REDUCE_DTYPES for op in REDUCE_OPS
            if not (op == "AVG" and d not in FLOAT_DTYPES)]


def backend_name() -> str:
    return os.environ.get("TDIST_TEST_BACKEND", "tdist")


def dt(name: str) -> torch.dtype:
    d = getattr(torch, name)
    assert isinstance(d, torch.dtype), name
    return d


def reduce_op(name: str):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


def rank_gen(seed: int, rank: int, salt: int = 0) -> torch.Generator:
    """The generator of rank `rank`'s data for sub-case `salt` of a test."""
    return torch.Generator().manual_seed((seed + 7919 * salt + rank) % (2**62))


def shared_gen(seed: int, salt: int = 0) -> torch.Generator:
    """A generator every rank builds identically (split sizes, shapes ...)."""
    return torch.Generator().manual_seed((seed * 31 + 1_000_003 + 104729 * salt) % (2**62))


def rand(shape, dtype, gen: torch.Generator, kind: str = "move") -> torch.Tensor:
    """Random, never-zero data.

    kind: "move" (data movement: wide range), "sum" (small values, no integer
    overflow), "minmax", "prod" (floats near 1, integers in {-2,-1,1,2}).
    """
    d = dt(dtype) if isinstance(dtype, str) else dtype
    shape = tuple(shape)
    if d == torch.bool:  # (the only dtype whose data may contain zeros)
        return torch.randint(0, 2, shape, generator=gen).bool()
    if d.is_floating_point:
        if kind == "prod":
            x = 1.0 + 0.01 * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            x = torch.randn(shape, generator=gen, dtype=torch.float64) * (3.0 if kind == "move" else 1.0)
            x = torch.where(x == 0, torch.full_like(x, 0.5), x)
        return x.to(d)
    if kind == "prod":
        vals = torch.tensor([-2, -1, 1, 2], dtype=torch.int64)
        x = vals[torch.randint(0, 4, shape, generator=gen)]
    elif kind == "sum":
        lo, hi = (-20, 21) if d in (torch.int8, torch.uint8) else (-1000, 1001)
        if d == torch.uint8:
            lo, hi = 1, 50
        x = torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64)
    else:  # move / minmax: use the dtype's range (int64 beyond 32 bits)
        if d == torch.uint8:
            lo, hi = 1, 256
        elif d == torch.int8:
            lo, hi = -128, 128
        elif d == torch.int32:
            lo, hi = -(2**31), 2**31 - 1
        elif d == torch.int64:
            lo, hi = -(2**62), 2**62
        else:
            lo, hi = -1000, 1001
        x = torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64)
    x = torch.where(x == 0, torch.ones_like(x), x)
    return x.to(d)


def kind_for(op: str) -> str:
    return {"SUM": "sum", "AVG": "sum", "PRODUCT": "prod"}.get(op, "minmax")


def ref_reduce(tensors, op: str) -> torch.Tensor:
    """Reference reduction over a list of same-shaped tensors (computed in 64 bits)."""
    d = tensors[0].dtype
    wide = torch.float64 if d.is_floating_point else torch.int64
    x = torch.stack([t.to(wide) for t in tensors])
    if op == "SUM":
        r = x.sum(0)
    elif op == "AVG":
        assert d.is_floating_point
        r = x.sum(0) / len(tensors)
    elif op == "MAX":
        r = x.amax(0) if x.numel() else x.sum(0)
    elif op == "MIN":
        r = x.amin(0) if x.numel() else x.sum(0)
    elif op == "PRODUCT":
        r = x.prod(0)
    elif op == "BAND":
        r = x[0]
        for t in x[1:]:
            r = r & t
    elif op == "BOR":
        r = x[0]
        for t in x[1:]:
            r = r | t
    elif op == "BXOR":
        r = x[0]
        for t in x[1:]:
            r = r ^ t
    else:
        raise ValueError(op)
    return r.to(d)


def poison_like(t: torch.Tensor, seed: int = 12345) -> torch.Tensor:
    """A buffer with the shape/dtype of `t` full of random junk (never the answer)."""
    return rand(t.shape, t.dtype, torch.Generator().manual_seed(seed), "move")


def poison(shape, dtype, seed: int = 12345) -> torch.Tensor:
    return rand(shape, dtype, torch.Generator().manual_seed(seed), "move")


def noncontig_empty(shape, dtype) -> torch.Tensor:
    """A non-contiguous tensor of logical `shape` (a transposed buffer), junk-filled."""
    shape = tuple(shape)
    assert len(shape) == 2
    base = poison((shape[1], shape[0]), dtype)
    t = base.t()
    assert not t.is_contiguous() or t.numel() <= 1
    return t


def noncontig_rand(shape, dtype, gen, kind="move") -> torch.Tensor:
    shape = tuple(shape)
    assert len(shape) == 2
    t = rand((shape[1], shape[0]), dtype, gen, kind).t()
    return t


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype.is_floating_point:
        return t.view(_BITS[t.element_size()])
    return t


TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float64: (1e-12, 1e-12),
}
PRODUCT_BOUNDS = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-12}


class Checker:
    """Collects mismatches of one job and raises them all at the end."""

    def __init__(self, rank: int, what: str):
        self.rank = rank
        self.what = what
        self.failures: list[str] = []

    def _fail(self, case: str, msg: str):
        self.failures.append(f"[rank {self.rank}] {self.what} {case}: {msg}")

    def _meta_ok(self, case, actual, expected) -> bool:
        if not isinstance(actual, torch.Tensor):
            self._fail(case, f"got {type(actual).__name__}, expected a tensor")
            return False
        if actual.dtype != expected.dtype:
            self._fail(case, f"dtype {actual.dtype}, expected {expected.dtype}")
            return False
        if tuple(actual.shape) != tuple(expected.shape):
            self._fail(case, f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
            return False
        return True

    def equal(self, actual, expected, case: str = "") -> bool:
        """Bit-exact comparison (data movement, MAX/MIN, integer reductions)."""
        if not self._meta_ok(case, actual, expected):
            return False
        a, e = bits(actual), bits(expected)
        if torch.equal(a, e):
            return True
        bad = (a != e).nonzero()
        idx = tuple(bad[0].tolist())
        self._fail(case, f"{bad.shape[0]}/{a.numel()} elements differ (shape {tuple(actual.shape)}, "
                         f"{actual.dtype}); first at {idx}: got {actual[idx].item()!r}, "
                         f"expected {expected[idx].item()!r}")
        return False

    def close(self, actual, expected, case: str = "", op: str = "SUM") -> bool:
        """Reduction results: exact for integers and MAX/MIN, else per-dtype tolerance."""
        if not expected.dtype.is_floating_point or op in ("MAX", "MIN"):
            return self.equal(actual, expected, case)
        if not self._meta_ok(case, actual, expected):
            return False
        rtol, atol = TOLERANCES[expected.dtype]
        a, e = actual.double(), expected.double()
        ok = torch.isclose(a, e, rtol=rtol, atol=atol)
        if bool(ok.all()):
            return True
        bad = (~ok).nonzero()
        idx = tuple(bad[0].tolist())
        err = (a - e).abs().max().item()
        self._fail(case, f"{bad.shape[0]}/{a.numel()} elements outside rtol={rtol} atol={atol} "
                         f"(max abs err {err:.3g}, {actual.dtype}); first at {idx}: got "
                         f"{actual[idx].item()!r}, expected {expected[idx].item()!r}")
        return False

    def products_close(self, actual, expected, case: str = "") -> bool:
        """Matrix products: a rounding error per element grows with the inner dimension and the
        order of the sums, so the bound is on the whole product (relative Frobenius norm), against
        a reference best computed in float64."""
        if not isinstance(actual, torch.Tensor) or tuple(actual.shape) != tuple(expected.shape):
            self._fail(case, f"got {getattr(actual, 'shape', type(actual).__name__)}, expected shape "
                             f"{tuple(expected.shape)}")
            return False
        err = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
        bound = PRODUCT_BOUNDS[actual.dtype]
        self.true(err <= bound, case, f"relative error {err:.2e} over {bound:g} ({actual.dtype})")
        return err <= bound

    def true(self, cond, case: str, msg: str):
        if not cond:
            self._fail(case, msg)

    def done(self):
        if self.failures:
            n = len(self.failures)
            shown = self.failures[:20]
            more = f"\n... and {n - 20} more" if n > 20 else ""
            raise AssertionError(f"{n} mismatch(es):\n" + "\n".join(shown) + more)


# ---------------------------------------------------------------------------
# torch_tdist.stats() helpers (used inside the ranks)


def group_is_tdist(group=None) -> bool:
    import torch.distributed as dist

    try:
        return "tdist" in str(dist.get_backend(group))
    except Exception:  # noqa: BLE001
        return False


def stats_snapshot(group=None):
    """torch_tdist.stats(group) as plain dicts, or None if the group is not tdist."""
    if not group_is_tdist(group):
        return None
    import torch_tdist

    s = torch_tdist.stats() if group is None else torch_tdist.stats(group)
    return {str(op): {"tdist": int(v.get("tdist", 0)), "fallback": int(v.get("fallback", 0))}
            for op, v in s.items()}


def stats_diff(before, after):
    """{op: {"tdist": d, "fallback": d}} for ops whose counts changed (None if no stats)."""
    if before is None or after is None:
        return None
    out = {}
    for op in set(before) | set(after):
        b = before.get(op, {"tdist": 0, "fallback": 0})
        a = after.get(op, {"tdist": 0, "fallback": 0})
        d = {"tdist": a["tdist"] - b["tdist"], "fallback": a["fallback"] - b["fallback"]}
        if d["tdist"] or d["fallback"]:
            out[op] = d
    return out


def new_group_with_env(backend: str, env: dict | None = None):
    """``dist.new_group(backend=backend)`` made with ``env`` set (the options a tdist group reads
    when it is made), ``env`` removed again after."""
    import torch.distributed as dist

    os.environ.update(env or {})
    try:
        return dist.new_group(backend=backend)
    finally:
        for key in env or {}:
            del os.environ[key]
