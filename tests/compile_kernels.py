"""Compile every tdist kernel for GPU targets without a GPU (run as a script).

    TDIST_INTERPRET=0 python -m tests.compile_kernels [ARCH ...]
    TDIST_INTERPRET=0 python -m tests.compile_kernels 90 amd   # what tests/test_compile.py runs

ARCH: an NVIDIA compute capability ("90", the default), an AMD architecture ("gfx942"), or
``amd``: each of ``torch_tdist.language.AMD_ARCHS`` (MI300X's gfx942, MI355X's gfx950), the
architectures a ROCm GPU must have (``language.check_amd_arch``).

Every specialisation is compiled to the GPU binary (cubin, hsaco) for every target, in one pool
of a process per core over (target, specialisation) pairs. AMD GPUs have no programmatic
dependent launch, and the language is defined when torch_tdist is imported (for an AMD target as
torch built for ROCm defines it, see ``_as_on_amd``): NVIDIA's and AMD's targets given together
are compiled by two such runs at once. The aligned bf16 data loops are compiled as for aligned
operands, and for NVIDIA must use 16-byte loads and stores (``ld.global.v4`` in the PTX; on AMD
not all do yet: the all-to-all with split sizes stores 8 bytes at a time). Prints a line per
target; exits non-zero on the first failure.
"""

import collections
import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback

os.environ.setdefault("TDIST_INTERPRET", "0")


def _is_amd(arch: str) -> bool:
    return arch == "amd" or arch.startswith("gfx")


def _each_language_at_once(args: list) -> int:
    """Runs NVIDIA's targets and AMD's in two processes at once; the first to fail stops the other."""
    runs = [subprocess.Popen([sys.executable, "-m", "tests.compile_kernels", *group])
            for group in ([a for a in args if not _is_amd(a)], [a for a in args if _is_amd(a)])]
    failed = 0  # the exit status of the first to fail (the other's, once stopped, says nothing)
    while any(run.poll() is None for run in runs):
        failed = failed or next((run.returncode for run in runs if run.poll()), 0)
        for run in runs if failed else ():
            if run.poll() is None:
                run.terminate()
        time.sleep(0.5)
    return failed or next((run.returncode for run in runs if run.returncode), 0)


if __name__ == "__main__" and len({_is_amd(arch) for arch in sys.argv[1:]}) > 1:
    sys.exit(_each_language_at_once(sys.argv[1:]))  # (before torch_tdist defines the language)


def _as_on_amd(archs: list) -> None:
    """For AMD targets, before torch_tdist defines its kernels: torch reads as built for ROCm,
    so that the language defines what AMD GPUs run (no programmatic dependent launch)."""
    if archs and all(_is_amd(arch) for arch in archs):
        import torch

        torch.version.hip = torch.version.hip or "compile check"


_as_on_amd(sys.argv[1:])  # (the targets main() is given)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from torch_tdist import language as tdl  # noqa: E402
from torch_tdist.collectives import ONESHOT_TILE_BYTES  # noqa: E402
from torch_tdist.overlap.fused import GEMM_CONFIGS, _sized  # noqa: E402
from torch_tdist.triton_kernels import bulk, lowlatency, oneshot, overlap, staged, streamed, twoshot  # noqa: E402

DTYPES = ("fp32", "bf16", "fp16", "fp64", "i32", "i64", "u8")
REDUCIBLE = ("fp32", "bf16", "fp16", "fp64", "i32", "i64")
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "i32": 4, "i64": 8, "u8": 1}
ACC = {"fp32": tl.float32, "bf16": tl.float32, "fp16": tl.float32, "fp64": tl.float64,
       "i32": tl.int32, "i64": tl.int64}


ONESHOT_SIGNATURE = {"ctx": "*i64", "src": "*{dt}", "dst": "*{dt}", "box": "*{dt}", "cap": "i64",
                     "flags": "*i64", "words": "*i64", "counter": "*i64", "n": "i64", "stride": "i64",
                     "root": "i32", "call_word": "i64", "tables": "*i64", "MODE": "constexpr",
                     "WORLD": "constexpr", "BLOCK": "constexpr", "ALIGN": "constexpr", "OP": "constexpr",
                     "ACC": "constexpr", "MAXP": "constexpr", "LANES": "constexpr"}


def _all_or_last(choices: tuple, every_one: bool) -> tuple:
    """``choices``, or only the last of them (CI's time goes to compiling)."""
    return choices if every_one else choices[-1:]


def _oneshot_specialisations():
    """The one-launch kernel in each mode, for the dtypes the GPU checks use most, both
    alignments, on 4 ranks; bf16 reductions, 16-byte aligned, on 2 and 3 (3: the fourth signal
    lane masked). CI's time goes to compiling."""
    fewer_ranks = {2: (("bf16", "all_reduce"), ("bf16", "reduce_scatter")), 3: (("bf16", "reduce_scatter"),)}
    for world in (2, 3, 4):
        for mode, dt, op in (("all_gather", "bf16", "sum"), ("broadcast", "fp32", "sum"),
                             ("all_to_all", "bf16", "sum"), ("all_to_all", "u8", "sum"),
                             ("all_reduce", "bf16", "sum"), ("all_reduce", "fp32", "max"),
                             ("reduce_scatter", "bf16", "avg"), ("reduce_scatter", "i64", "product")):
            if world != 4 and (dt, mode) not in fewer_ranks[world]:
                continue
            for align in _all_or_last((1, 16 // ITEMSIZE[dt]), world == 4):
                signature = {k: v.format(dt=dt) for k, v in ONESHOT_SIGNATURE.items()}
                acc = ACC.get(dt, tl.float32) if mode in ("all_reduce", "reduce_scatter") else tl.float32
                lanes = 1 << (world - 1).bit_length()
                yield oneshot.oneshot_kernel, signature, {
                    "MODE": mode, "WORLD": world, "BLOCK": ONESHOT_TILE_BYTES // ITEMSIZE[dt] // lanes,
                    "ALIGN": align, "OP": op, "ACC": acc, "MAXP": 132, "LANES": lanes}


def _streamed_specialisations():
    """The streamed kernel in each mode on 4 ranks (on 3, a masked signal lane: the bf16 ones; on
    2, the reductions), and the one for split sizes."""
    for world in (2, 3, 4):
        for mode, dt, op in (("all_gather", "bf16", "sum"), ("all_to_all", "bf16", "sum"),
                             ("reduce_scatter", "bf16", "sum"),
                             ("all_reduce", "bf16", "sum"), ("all_reduce", "fp32", "avg"),
                             ("reduce_scatter", "i64", "max")):
            if (world == 3 and dt != "bf16") or (world == 2 and mode not in ("all_reduce", "reduce_scatter")):
                continue
            types = {**ONESHOT_SIGNATURE, "part": "i64", "STEP": "constexpr"}
            signature = {k: types[k].format(dt=dt) for k in streamed.streamed_kernel.arg_names}
            yield streamed.streamed_kernel, signature, {
                "MODE": mode, "WORLD": world, "BLOCK": 8192, "STEP": 1, "OP": op, "ACC": ACC[dt],
                "ALIGN": 16 // {"bf16": 2, "fp32": 4, "i64": 8}[dt], "MAXP": 132,
                "LANES": 1 << (world - 1).bit_length()}
        types = {**ONESHOT_SIGNATURE, "STEP": "constexpr", "ring": "i64", "acks": "*i64"}
        for align in _all_or_last((1, 8), world == 2):
            signature = {k: types[k].format(dt="bf16") for k in streamed.streamed_all_to_all_v_kernel.arg_names}
            yield streamed.streamed_all_to_all_v_kernel, signature, {
                "WORLD": world, "BLOCK": 2048, "STEP": 4, "ALIGN": align, "MAXP": 132,
                "LANES": 1 << (world - 1).bit_length()}


def _twoshot_specialisations():
    """The two-shot all_reduce: bf16 sum and fp32 avg on 4 ranks, bf16 on 2 and 3 (a masked lane)."""
    for world in (2, 3, 4):
        for dt, op in _all_or_last((("fp32", "avg"), ("bf16", "sum")), world == 4):
            types = {**ONESHOT_SIGNATURE, "part": "i64", "gathered": "*i64"}
            signature = {k: types[k].format(dt=dt) for k in twoshot.twoshot_all_reduce_kernel.arg_names}
            lanes = 1 << (world - 1).bit_length()
            yield twoshot.twoshot_all_reduce_kernel, signature, {
                "WORLD": world, "BLOCK": ONESHOT_TILE_BYTES // ITEMSIZE[dt] // lanes, "ALIGN": 16 // ITEMSIZE[dt],
                "OP": op, "ACC": ACC[dt], "MAXP": 132, "LANES": lanes}


def _lowlatency_specialisations():
    """The low-latency kernel in each mode it serves (words of int32; reductions of bf16, two to a
    word, and fp32 and int32, one) on 4 ranks; on 2, the words and a bf16 reduction; on 3 (a
    masked lane), the bf16 all_reduce."""
    fewer_ranks = {2: (("all_gather", tl.int32), ("all_reduce", tl.bfloat16)), 3: (("all_reduce", tl.bfloat16),)}
    signature = {"ctx": "*i64", "src": "*i32", "dst": "*i32", "lines": "*i64", "counter": "*i64",
                 "n": "i64", "stride": "i64", "call_word": "i64"}
    for world in (2, 3, 4):
        for mode, dtype, op, pack in (("all_gather", tl.int32, "sum", 1), ("all_to_all", tl.int32, "sum", 1),
                                      ("all_reduce", tl.bfloat16, "sum", 2), ("all_reduce", tl.float32, "max", 1),
                                      ("reduce_scatter", tl.bfloat16, "avg", 2),
                                      ("reduce_scatter", tl.int32, "product", 1)):
            if world != 4 and (mode, dtype) not in fewer_ranks[world]:
                continue
            acc = tl.int32 if dtype == tl.int32 else tl.float32
            yield lowlatency.lowlatency_kernel, signature, {
                "MODE": mode, "WORLD": world, "SLOT": 16384, "BLOCK": 256, "ALIGN": 4, "OP": op, "ACC": acc,
                "DTYPE": dtype, "PACK": pack, "LANES": 1 << (world - 1).bit_length()}


def specialisations():
    yield from _oneshot_specialisations()
    yield from _streamed_specialisations()
    yield from _twoshot_specialisations()
    yield from _lowlatency_specialisations()
    # (ME changes only arithmetic: one rank per world size; 2 ranks: bf16, aligned, with pushers)
    for world, me in ((2, 1), (4, 3)):
        for dt, op in _all_or_last((("fp32", "avg"), ("i64", "max"), ("bf16", "sum")), world == 4):
            for align in _all_or_last((1, 16 // {"bf16": 2, "fp32": 4, "i64": 8}[dt]), world == 4):
                common = {"ctx": "*i64", "own": f"*{dt}", "slots": f"*{dt}", "slot_stride": "i64",
                          "ready": "*i64"}
                pushes = {"push_src": f"*{dt}", "push_stride": "i64", "push_len": "i64", "push_limit": "i64"}
                for pushers in _all_or_last((0, 64), world == 4):
                    yield bulk.reduce_chunks_kernel, {
                        **common, "dst": f"*{dt}", "n": "i64", "chunk": "i64", "n_chunks": "i64", **pushes,
                        "ME": "constexpr", "WORLD": "constexpr", "KMAX": "constexpr", "BLOCK": "constexpr",
                        "ALIGN": "constexpr", "OP": "constexpr", "ACC": "constexpr", "PUSHERS": "constexpr"}, {
                            "ME": me, "WORLD": world, "KMAX": 64, "BLOCK": 8192, "ALIGN": align, "OP": op,
                            "ACC": ACC[dt], "PUSHERS": pushers}
                    yield bulk.gather_chunks_kernel, {
                        **common, "out": f"*{dt}", "part_stride": "i64", "part_len": "i64", "limit": "i64",
                        "chunk": "i64", "n_chunks": "i64", **pushes, "ME": "constexpr", "WORLD": "constexpr",
                        "KMAX": "constexpr", "BLOCK": "constexpr", "ALIGN": "constexpr",
                        "PUSHERS": "constexpr"}, {
                            "ME": me, "WORLD": world, "KMAX": 64, "BLOCK": 8192, "ALIGN": align,
                            "PUSHERS": pushers}
    for dt, pushers, config in [("bf16", 48, GEMM_CONFIGS[0])] + [
            (dt, 0, c) for dt in ("fp32", "bf16") for c in GEMM_CONFIGS]:
        sized = _sized(config, {"bf16": torch.bfloat16, "fp32": torch.float32}[dt])
        tiles = {key: sized[key] for key in ("BM", "BN", "BK", "GROUP_M")}
        options = {"num_warps": 8, "num_stages": config["num_stages"]}
        yield overlap.ag_gemm_kernel, {
            "ctx": "*i64", "own": f"*{dt}", "slots": f"*{dt}", "slot_stride": "i64", "ready": "*i64",
            "b": f"*{dt}", "c": f"*{dt}", "a_out": f"*{dt}", "m": "i32", "row0": "i32", "m_shard": "i32",
            "N": "i32", "K": "i32", "stride_bk": "i64", "stride_bn": "i64", "chunk": "i64", "n_chunks": "i64",
            "push_src": f"*{dt}", "push_stride": "i64", "push_len": "i64", "push_limit": "i64",
            "ME": "constexpr", "WORLD": "constexpr", "KMAX": "constexpr", "BM": "constexpr", "BN": "constexpr",
            "BK": "constexpr", "BLOCK": "constexpr", "ALIGN": "constexpr", "PUSHERS": "constexpr",
            "IEEE": "constexpr", "UPCAST": "constexpr", "GROUP_M": "constexpr"}, {
                "ME": 1, "WORLD": 4, "KMAX": 64, **tiles, "BLOCK": 8192, "ALIGN": 8 if dt == "bf16" else 4,
                "PUSHERS": pushers, "IEEE": dt == "fp32", "UPCAST": False}, options
        if pushers:  # (the matmul + reduce_scatter has none: this one is the next one's)
            continue
        yield overlap.gemm_rs_kernel, {
            "ctx": "*i64", "a": f"*{dt}", "b": f"*{dt}", "slots": f"*{dt}", "slot_stride": "i64",
            "ready": "*i64", "counters": "*i64", "m": "i32", "row0": "i32", "m_shard": "i32", "N": "i32",
            "K": "i32", "stride_am": "i64", "stride_ak": "i64", "stride_bk": "i64", "stride_bn": "i64",
            "ME": "constexpr", "WORLD": "constexpr", "KMAX": "constexpr", "BM": "constexpr", "BN": "constexpr",
            "BK": "constexpr", "IEEE": "constexpr", "UPCAST": "constexpr", "GROUP_M": "constexpr"}, {
                "ME": 2, "WORLD": 4, "KMAX": 64, **tiles, "IEEE": dt == "fp32", "UPCAST": False}, options
    for world, me in ((2, 1), (4, 2)):
        for value in ("i64", "constexpr"):  # a signature; 1 (Triton makes an int of 1 a constant)
            yield bulk.wait_peers_kernel, {"ctx": "*i64", "flags": "*i64", "stride": "i64", "value": value,
                                           "ME": "constexpr", "WORLD": "constexpr"}, {
                                               "ME": me, "WORLD": world, **({"value": 1} if value == "constexpr" else {})}
    yield _every_primitive, {"ctx": "*i64", "buf": "*fp32", "sig": "*i64", "n": "i64", "epoch": "i64",
                             "BLOCK": "constexpr"}, {"BLOCK": 1024}
    # The staged path's kernels for 4 ranks in every dtype (reductions: every dtype summed, every
    # op on float32), for 2 in one (WORLD
    # changes only how many peers a loop visits; CI's time goes to compiling)
    for world, dtypes, ops in ((2, ("bf16",), ("sum",)), (4, DTYPES, ("sum", "avg", "max", "min", "product"))):
        for dt in dtypes:
            yield staged.publish_kernel, {
                "ctx": "*i64", "src": f"*{dt}", "stage": f"*{dt}", "n": "i64", "hdr_src": "*i64",
                "hdr": "*i64", "n_hdr": "i64", "sig": "*i64", "op_code": "i32", "dtype_code": "i32",
                "count": "i64", "WORLD": "constexpr", "BLOCK": "constexpr"}, {"WORLD": world, "BLOCK": 4096}
            for align in (1, 16):
                yield staged.pull_copy_kernel, {
                    "ctx": "*i64", "stage": f"*{dt}", "hdr": "*i64", "out": f"*{dt}", "segs": "*i64",
                    "sig": "*i64", "op_code": "i32", "dtype_code": "i32", "count": "i64",
                    "WORLD": "constexpr", "BLOCK": "constexpr",
                    "ALIGN": "constexpr"}, {"WORLD": world, "BLOCK": 4096, "ALIGN": align}
        for dt in (d for d in REDUCIBLE if d in dtypes):
            for op in ops:  # (every dtype summed, every op on float32)
                if (op == "avg" and dt.startswith("i")) or (op != "sum" and dt != "fp32"):
                    continue
                yield staged.pull_reduce_kernel, {
                    "ctx": "*i64", "stage": f"*{dt}", "hdr": "*i64", "out": f"*{dt}", "src_off": "i64",
                    "n": "i64", "sig": "*i64", "op_code": "i32", "dtype_code": "i32", "count": "i64",
                    "WORLD": "constexpr", "BLOCK": "constexpr",
                    "OP": "constexpr", "ACC": "constexpr"}, {"WORLD": world, "BLOCK": 4096, "OP": op,
                                                            "ACC": ACC[dt]}


@tdl.jit
def _every_primitive(ctx, buf, sig, n, epoch, BLOCK: tl.constexpr):
    """Not run: makes sure each device primitive compiles, default arguments included."""
    me = tdl.rank(ctx)
    peer = (me + 1) % tdl.num_ranks(ctx)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tdl.load(ctx, buf + offs, peer, mask=mask, other=0.0)
    tdl.store(ctx, buf + BLOCK + offs, x, peer, mask=mask)
    tdl.store(ctx, buf + 2 * BLOCK + offs, tdl.load(ctx, buf + offs, peer), peer)
    tdl.store_polled(ctx, buf + 5 * BLOCK + offs, x, peer, mask=mask)
    tdl.atomic_add(ctx, sig + 1, 1, peer)
    tdl.atomic_cas(ctx, sig + 2, 0, 1, peer)
    tdl.atomic_xchg(ctx, sig + 3, 1, peer)
    tdl.notify_add(ctx, sig + 4, peer, 1)
    tdl.notify(ctx, sig, peer, epoch)
    token = tdl.wait(ctx, sig, epoch)
    tdl.wait_equal(ctx, sig + 5, epoch)
    lanes = tl.arange(0, 4)
    live = lanes < tdl.num_ranks(ctx)
    tdl.notify(ctx, sig + 6, tl.where(live, lanes, 0), epoch, mask=live)
    tdl.wait_all(ctx, sig + 6 + lanes, epoch, live)
    tl.store(sig + 10, tdl.largest(tl.where(live, lanes, 0)).to(tl.int64))
    tl.store(sig + 11, tl.sum(tdl.wait_filled(ctx, sig + 12 + lanes, live), 0))
    ptr = tdl.consume_token(buf, token)
    tdl.putmem_block(ctx, ptr + 3 * BLOCK, ptr, n, peer, BLOCK)
    tdl.getmem_block(ctx, ptr + 4 * BLOCK, ptr, n, peer, BLOCK)


def _aligned(signature):
    """Triton's attrs saying every pointer and integer argument is 16-divisible (as at run time
    for aligned tensors and sizes)."""
    return {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(signature.values())
            if ty.startswith("*") or ty == "i64"}


WIDE_ACCESSES = ("ld.global.v4", "st.global.v4")  # 16-byte loads and stores in the PTX


def _wide(kernel, signature, constexprs) -> bool:
    """Whether the specialisation moves bf16 data, aligned: its loops must use 16-byte accesses."""
    data = signature.get("out", signature.get("src", signature.get("dst", "")))
    return kernel is not _every_primitive and constexprs.get("ALIGN", 16) != 1 and ("bf16" in data or "i16" in data)


def nvshmem_kernels():
    """The kernels that make NVSHMEM calls (they link libnvshmem_device.bc)."""
    from tests.jobs_shmem import _ring_puts
    from torch_tdist.examples.moe_all_to_all import moe_dispatch_kernel
    from torch_tdist.triton_kernels.hierarchical import hierarchical_all_gather_kernel

    yield _ring_puts, {"ctx": "*i64", "mine": "*fp32", "inbox": "*fp32", "inbox_nbi": "*fp32",
                       "sigs": "*i64", "n": "i64", "epoch": "i64"}, {}
    yield hierarchical_all_gather_kernel, {"ctx": "*i64", "src": "*bf16", "gathered": "*bf16",
                                           "signals": "*i64", "n": "i64", "epoch": "i64",
                                           "RANKS_PER_NODE": "constexpr", "BLOCK": "constexpr"}, {
        "RANKS_PER_NODE": 2, "BLOCK": 4096}
    yield moe_dispatch_kernel, {"ctx": "*i64", "send": "*bf16", "send_offsets": "*i64", "send_counts": "*i64",
                                "recv": "*bf16", "recv_counts": "*i64", "signals": "*i64", "call": "i64",
                                "HIDDEN": "constexpr", "MAX_ROWS": "constexpr", "EXPERTS_PER_RANK": "constexpr",
                                "PIECES": "constexpr"}, {
        "HIDDEN": 7168, "MAX_ROWS": 1024, "EXPERTS_PER_RANK": 8, "PIECES": 8}


def compile_nvshmem_kernels(target, arch: int) -> str:
    from torch_tdist import shmem_device

    try:
        library = shmem_device.device_library(arch)
    except RuntimeError:
        return "NVSHMEM kernels not compiled (no nvidia-nvshmem wheel here; the GPU checks run them)"
    options = {"extern_libs": (("libnvshmem_device", library),), "num_warps": 8}
    count = 0
    for kernel, signature, constexprs in nvshmem_kernels():
        compiled = triton.compile(ASTSource(kernel.fn, signature, constexprs=constexprs), target=target,
                                  options=options)
        assert "nvshmem" in compiled.asm["ptx"], f"{kernel.fn.__name__}: no NVSHMEM call in the PTX"
        count += 1
    return f"{count} NVSHMEM kernels compiled against {os.path.basename(library)}"


def _compile(target, kernel, signature, constexprs, options=None) -> bool:
    """Compiles one specialisation to the GPU binary; a wide one (:func:`_wide`) as for aligned
    operands, and for NVIDIA its 16-byte accesses checked. Returns whether they were."""
    wide = _wide(kernel, signature, constexprs)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs,
                                        attrs=_aligned(signature) if wide else None),
                              target=target, options=options)
    amd = target.backend == "hip"
    binary = "hsaco" if amd else "cubin"
    assert compiled.asm.get(binary), f"{kernel.__name__}: no {binary}"
    checked = wide and not amd
    for op in WIDE_ACCESSES if checked else ():
        assert op in compiled.asm["ptx"], f"{kernel.__name__} {constexprs}: no {op} in the PTX (accesses not vectorised)"
    return checked


def _target(arch: str):
    """Triton's target for an NVIDIA compute capability ("90") or an AMD architecture ("gfx942")."""
    return GPUTarget("hip", arch, 64) if arch.startswith("gfx") else GPUTarget("cuda", int(arch), 32)


def _target_name(arch: str) -> str:
    return arch if arch.startswith("gfx") else f"sm_{arch}"


@functools.cache
def _specialisations() -> list:
    """Every specialisation once (a duplicate would only cost CI time)."""
    listed = list(specialisations())
    keys = collections.Counter(repr((s[0].__name__, *s[1:])) for s in listed)
    assert max(keys.values()) == 1, f"specialisations listed twice: {[k for k, n in keys.items() if n > 1]}"
    return listed


def _compile_one(task: tuple) -> tuple:
    """(target, index in the list) -> (target, whether its wide accesses were checked, or the
    failure as text)."""
    arch, index = task
    kernel, _, constexprs, *_ = _specialisations()[index]
    try:
        return arch, _compile(_target(arch), *_specialisations()[index])
    except Exception:  # (reported by the parent: Triton's errors do not all cross processes)
        return arch, f"{kernel.__name__} {constexprs} for {_target_name(arch)}:\n{traceback.format_exc()}"


def compile_first(name: str, arch: str = "90") -> None:
    """Compiles the first specialisation of the kernel called ``name``: a quick check of one
    configuration of the language (e.g. AMD's, without programmatic dependent launch)."""
    _compile(_target(arch), *next(s for s in specialisations() if s[0].__name__ == name))


def main(*args: str) -> int:
    assert not tdl.INTERPRET, "run with TDIST_INTERPRET=0"
    archs = [arch for arg in args or ("90",) for arch in (tdl.AMD_ARCHS if arg == "amd" else (arg,))]
    amd = _is_amd(archs[0])
    assert all(_is_amd(arch) == amd for arch in archs), "NVIDIA's and AMD's targets: run as a script"
    assert not (amd and tdl.DEPENDENT_LAUNCH), "AMD GPUs: the language was defined for NVIDIA's"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # (the pool's processes end with this one)
    tasks = [(arch, index) for index in range(len(_specialisations())) for arch in archs]
    compiled, wide = collections.Counter(), collections.Counter()
    # a process per core (a cold compile takes minutes on one); each takes the next pair when done
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        for arch, result in pool.imap_unordered(_compile_one, tasks):
            if isinstance(result, str):
                print(f"failed to compile {result}", file=sys.stderr, flush=True)
                return 1
            compiled[arch] += 1
            wide[arch] += result
    for arch in archs:
        assert amd or wide[arch] >= 3 * 2, f"only {wide[arch]} kernels checked for wide accesses"
        checks = "" if amd else (f"; {wide[arch]} data loops use 16-byte accesses; "
                                 f"{compile_nvshmem_kernels(_target(arch), int(arch))}")
        print(f"compiled {compiled[arch]} kernel specialisations for {_target_name(arch)}{checks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
