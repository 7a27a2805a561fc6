"""torch_tdist.ops on the CPU, one process per rank: all_gather_matmul (one B and a list of three,
gathered along dim 0 and along dim 1 of a 3-D A) and matmul_reduce_scatter (sum and avg), outputs
and gradients against float64 references; both ops under torch.compile(fullgraph=True); and a
clear error, the same on every rank, for each kind of bad input."""

from __future__ import annotations

import contextlib

import pytest

from tests import jobs_ops as J
from tests.helpers import skip_on, ws_param
from tests.multiproc import RankPool, backend_under_test, shutdown_all


pytestmark = skip_on("gloo", "torch_tdist.ops needs a tdist group")


@ws_param([2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gather_dim,n_bs", [(0, 1), (0, 3), (1, 1)])
def test_all_gather_matmul(pool, dtype, gather_dim, n_bs, seed):
    pool.run(J.all_gather_matmul, dtype, seed, gather_dim, n_bs)


_FUSED = {}


OVERLAPPED_WAYS = {  # id: the default group's backend options
    "fused copy_engine": {"overlap": "fused", "bulk_push": "copy_engine"},
    "fused sm": {"overlap": "fused", "bulk_push": "sm"},
    "pipelined": {"overlap": "pipelined"},
}


def _pool(world_size: int, label: str, options: dict) -> RankPool:
    """This module's pool of ``world_size`` ranks whose default group has the backend ``options``
    (``label`` names it), made on first use and kept until teardown_module."""
    key = (world_size, label)
    if key not in _FUSED:
        _FUSED[key] = RankPool(world_size, backend_under_test(), name=f"RankPool(ws={world_size}, {label})",
                               pg_options=options)
    return _FUSED[key]


@pytest.fixture(params=list(OVERLAPPED_WAYS))
def overlapped_pool(world_size, request):
    """Ranks whose torch_tdist.ops overlap the collective: the fused kernels (shards pushed by
    copies or by the kernel's own programs) or the pipelined copies and torch.matmul."""
    yield _pool(world_size, request.param, OVERLAPPED_WAYS[request.param])


@pytest.fixture(params=["fused", "pipelined"])
def small_heap_pool(world_size, request):
    """Overlapped ops asked for, with a 64K heap: shards larger than its bulk area go in rounds."""
    yield _pool(world_size, f"{request.param}, 64K heap", {"overlap": request.param, "heap_size": "64K"})


def teardown_module():
    shutdown_all(_FUSED.values())
    _FUSED.clear()


@ws_param([2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape,n_bs", [("small", 1), ("tiles", 3)])
def test_overlapped_all_gather_matmul(overlapped_pool, dtype, shape, n_bs, seed):
    """The fused kernel: every output tile, the gathered A and the gradients."""
    overlapped_pool.run(J.all_gather_matmul, dtype, seed, 0, n_bs, shape, True, timeout=240)


@ws_param([2, 3])
def test_overlapped_all_gather_matmul_with_weights_of_different_widths(overlapped_pool, seed):
    """One rank's weight has no columns: its kernel has no tiles but still waits for every
    peer's pushes before the flags are cleared."""
    overlapped_pool.run(J.uneven_columns, seed, timeout=120)


@ws_param([2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape,reduce_op", [("small", "sum"), ("tiles", "avg")])
def test_overlapped_matmul_reduce_scatter(overlapped_pool, dtype, shape, reduce_op, seed):
    """The fused kernel: partial products sent as they are made, reduced by their owner."""
    overlapped_pool.run(J.matmul_reduce_scatter, dtype, seed, reduce_op, shape, True, timeout=240)


@pytest.mark.parametrize("world_size,chunks,dtype,reduce_op", [
    (3, 1, "float32", "sum"), (3, 1, "bfloat16", "avg"), (4, 2, "bfloat16", "sum"), (4, 4, "float32", "avg")],
    ids=["ws3-1chunk-fp32-sum", "ws3-1chunk-bf16-avg", "ws4-2chunks-bf16-sum", "ws4-4chunks-fp32-avg"])
def test_pipelined_matmul_reduce_scatter(world_size, chunks, dtype, reduce_op, seed):
    """The pipelined way on 3 and 4 ranks (the other tests run it on 2 and 3, at the policy's chunk
    count), at 1, 2 and 4 chunks a part."""
    pool = _pool(world_size, "pipelined", OVERLAPPED_WAYS["pipelined"])
    pool.run(J.pipelined_reduce_scatter, dtype, seed, reduce_op, chunks, timeout=240)


@ws_param([2])
def test_overlapped_ops_along_dim_1(overlapped_pool, seed):
    """A [2, S, k] gathered or scattered along S (sequence parallelism): the overlapped ways take
    it too (S moved to the front and back), outputs and gradients as on the sequential path."""
    overlapped_pool.run(J.all_gather_matmul, "bfloat16", seed, 1, 1, "small", True, timeout=240)
    overlapped_pool.run(J.matmul_reduce_scatter, "bfloat16", seed, "sum", "small", True, 1, timeout=240)


@ws_param([2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter(pool, dtype, reduce_op, seed):
    pool.run(J.matmul_reduce_scatter, dtype, seed, reduce_op)


@ws_param([2])
def test_frozen_weights_get_no_gradient_matmul(pool, seed):
    pool.run(J.frozen_weights, seed)


@ws_param([2, 3])
def test_calls_issued_from_cpp(pool, seed):
    """A signature's later calls are issued by the C++ backend, bit for bit as Python made them."""
    pool.run(J.issued_from_cpp, seed)


@ws_param([2])
def test_ops_under_torch_compile(pool, seed):
    pool.run(J.compiled, seed, timeout=300)


@ws_param([2])
def test_opcheck(pool):
    """torch.library.opcheck: the fake kernels match the real ones (strides too, along dim 1)."""
    pool.run(J.opchecks, timeout=300)


BAD = {  # case: (error type, words the message must hold)
    "int dtype": ("TypeError", ["all_gather_matmul", "int64", "bfloat16"]),
    "K mismatch": ("ValueError", ["all_gather_matmul", "[4, N]"]),
    "B dtype differs": ("TypeError", ["all_gather_matmul", "float64"]),
    "B not 2-D": ("ValueError", ["all_gather_matmul", "(2, 4, 3)"]),
    "A 1-D": ("ValueError", ["matmul_reduce_scatter", "2 or more"]),
    "gather along K": ("ValueError", ["all_gather_matmul", "gather_dim=1"]),
    "rows not divisible": ("ValueError", ["matmul_reduce_scatter", "do not divide"]),
    "reduce_op max": ("ValueError", ["matmul_reduce_scatter", "'max'", "sum, avg"]),
    "not a tdist group": ("ValueError", ["not a tdist group"]),
    "empty B list": ("ValueError", ["all_gather_matmul", "no B"]),
}


@ws_param([2])
@pytest.mark.parametrize("case", list(BAD))
def test_ops_bad_input(pool, case):
    kind, words = BAD[case]
    for got_kind, message in pool.run(J.bad_input, case, timeout=60):
        assert got_kind == kind, f"{case}: {got_kind}: {message}"
        for word in words:
            assert word in message, f"{case}: {word!r} not in {message!r}"


@ws_param([2])
def test_overlapped_ops_larger_than_the_heap_go_in_rounds(small_heap_pool, seed):
    # about 1600 float32 per rank's part fit the 64K heap's bulk slots: 150 x 40 shards of A
    # take 4 rounds (2 when pulled: a part may fill the area), 150 x 50 parts of the product
    # 5; gradients go through both overlapped ops
    small_heap_pool.run(J.all_gather_matmul, "float32", seed, 0, 1, "big", True, timeout=240)
    small_heap_pool.run(J.matmul_reduce_scatter, "float32", seed, "avg", "big", True, timeout=240)
    small_heap_pool.run(J.all_gather_matmul, "bfloat16", seed, 0, 3, "tiles", True, timeout=240)


@ws_param([3])
def test_tuned_ops_choose_the_same_way_on_every_rank(world_size, seed):
    """TDIST_OVERLAP=tune: a shape class's first call times the sequential path, the pipelined
    way and the fused kernels on every rank; all ranks keep the same choice, and the second call
    uses it without timing again (at most one overlapped call per call); every call's result is
    right. all_gather_matmul's B widths, and its counts of Bs, are tuned apart, unless the widths
    differ between ranks."""
    pool = RankPool(world_size, backend_under_test(), name=f"RankPool(ws={world_size}, tune)",
                    env={"TDIST_OVERLAP": "tune"})
    try:
        results = pool.run(J.tuned_choices, seed, timeout=240)
        uneven = pool.run(J.uneven_columns, seed, timeout=120)  # a weight width only one rank has: no hang
    finally:
        pool.shutdown()
    choices = results[0][0]
    assert [key.split(",")[0] for key, _ in choices] == ["('all_gather_matmul'"] * 3 + ["('matmul_reduce_scatter'"], choices
    assert [key.split(", ")[-2:] for key, _ in choices[:3]] == [["1", "18)"], ["1", "7)"], ["2", "18)"]], choices
    uneven_class = "('all_gather_matmul', torch.float32, 16, 12, 1)"  # tuned once, with no width
    assert all(u == ([uneven_class], [uneven_class]) for u in uneven), uneven
    assert all(way in ("sequential", "pipelined 2", "fused 0") for _, way in choices), choices
    assert all(r[0] == choices for r in results), f"ranks chose differently: {results}"
    expected = sum(way != "sequential" for _, way in choices)
    assert all(r[1] == expected for r in results), f"second calls made {[r[1] for r in results]} fused calls"


def test_runs_of_rows():
    """The pipelined ops' exposed matmul in pieces: whole rows, as even as can be, covering the
    range once, fewer pieces when there are fewer rows."""
    from torch_tdist.bulk import _runs_of_rows

    assert _runs_of_rows(0, 30, 3, 4) == [(0, 9), (9, 18), (18, 27), (27, 30)]
    assert _runs_of_rows(6, 12, 3, 4) == [(6, 9), (9, 12)]
    assert _runs_of_rows(8, 40, 8, 4) == [(8, 16), (16, 24), (24, 32), (32, 40)]
    assert _runs_of_rows(5, 5, 3, 4) == [(5, 5)]


def test_program_graph_cache(monkeypatch):
    """ProgramReplay.run_program's policy, with CUDA stood in for: a recorded program runs step by
    step the first time its tensors are at given addresses, is captured the second time and
    replayed from its graph afterwards; the least recently used graph goes beyond PROGRAM_GRAPHS;
    past PROGRAM_GRAPHS captures, another is made only once graph replays number CAPTURE_PAYBACK
    per capture. The program's own map of graphs (which C++ launches) follows the cache."""
    import types

    import torch

    from torch_tdist.overlap import replay

    class Graph:
        capturing = False

        def capture_begin(self, **kwargs):
            Graph.capturing = True

        def capture_end(self):
            Graph.capturing = False

        def replay(self):
            pass

        def raw_cuda_graph_exec(self):
            return id(self)

    class Program:
        def __init__(self):
            self.steps_runs = self.captures = 0
            self.graphs = set()

        def add_graph(self, addresses, graph_exec, graph):
            assert graph_exec == id(graph)
            self.graphs.add(tuple(addresses))

        def drop_graph(self, addresses):
            self.graphs.remove(tuple(addresses))

        def run(self, roles):
            if Graph.capturing:
                self.captures += 1
            else:
                self.steps_runs += 1

    class Role:
        def __init__(self, address):
            self.address = address

        def data_ptr(self):
            return self.address

    class Heap:
        device = "cuda"

    class Executor:
        heap = Heap()

    monkeypatch.setattr(replay, "PROGRAM_GRAPHS", 2)
    monkeypatch.setattr(replay, "CAPTURE_PAYBACK", 2)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    replays = replay.ProgramReplay(Executor(), types.SimpleNamespace(graph=[0, 0], program=[0, 0]))
    program = Program()
    at = {address: [Role(address), Role(address + 1)] for address in (100, 200, 300)}

    def calls(*addresses):
        for address in addresses:
            replays.run_program(program, at[address])
            assert program.graphs == {tuple(where[1:]) for where in replays.graphs}
        return program.steps_runs, program.captures, replays.graph_calls

    assert calls(100, 100, 100, 100) == (1, 1, 3)  # steps, then captured once and replayed
    assert calls(200, 200, 300) == (3, 2, 4)  # 300 seen once: steps
    assert calls(300) == (3, 3, 5)  # captures paid for (5 replays >= 2 x 2): captured
    assert len(replays.graphs) == 2  # the graph at 100 went (least recently used)
    assert calls(100) == (4, 3, 5)  # 3 captures want 6 replays: steps
    assert calls(200, 100) == (4, 4, 7)  # 6 replays: 100 captured again, 300's graph going
    assert calls(300, 200, 300) == (5, 5, 9)  # 4 captures want 8 replays: steps, then (after 200's) captured
