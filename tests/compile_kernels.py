"""Compile every tdist kernel for a GPU target without a GPU (run as a script).

    TDIST_INTERPRET=0 python -m tests.compile_kernels [sm]

Prints one line per compiled specialisation; exits non-zero on the first failure.
"""

import os
import sys

os.environ.setdefault("TDIST_INTERPRET", "0")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from torch_tdist import language as tdl  # noqa: E402
from torch_tdist.triton_kernels import staged  # noqa: E402

DTYPES = ("fp32", "bf16", "fp16", "fp64", "i32", "i64", "u8")
REDUCIBLE = ("fp32", "bf16", "fp16", "fp64", "i32", "i64")
ACC = {"fp32": tl.float32, "bf16": tl.float32, "fp16": tl.float32, "fp64": tl.float64,
       "i32": tl.int32, "i64": tl.int64}


def specialisations():
    yield _every_primitive, {"ctx": "*i64", "buf": "*fp32", "sig": "*i64", "n": "i64", "epoch": "i64",
                             "BLOCK": "constexpr"}, {"BLOCK": 1024}
    for world in (2, 4):
        for dt in DTYPES:
            yield staged.publish_kernel, {
                "ctx": "*i64", "src": f"*{dt}", "stage": f"*{dt}", "n": "i64", "hdr_src": "*i64",
                "hdr": "*i64", "n_hdr": "i64", "sig": "*i64", "epoch": "i64",
                "WORLD": "constexpr", "BLOCK": "constexpr"}, {"WORLD": world, "BLOCK": 2048}
            for from_header in (False, True):
                yield staged.pull_copy_kernel, {
                    "ctx": "*i64", "stage": f"*{dt}", "hdr": "*i64", "out": f"*{dt}", "segs": "*i64",
                    "sig": "*i64", "epoch": "i64", "WORLD": "constexpr", "BLOCK": "constexpr",
                    "SRC_FROM_HEADER": "constexpr"}, {"WORLD": world, "BLOCK": 2048,
                                                      "SRC_FROM_HEADER": from_header}
        for dt in REDUCIBLE:
            for op in ("sum", "avg", "max", "min", "product"):
                if op == "avg" and dt.startswith("i"):
                    continue
                yield staged.pull_reduce_kernel, {
                    "ctx": "*i64", "stage": f"*{dt}", "out": f"*{dt}", "src_off": "i64", "n": "i64",
                    "sig": "*i64", "epoch": "i64", "WORLD": "constexpr", "BLOCK": "constexpr",
                    "OP": "constexpr", "ACC": "constexpr"}, {"WORLD": world, "BLOCK": 2048, "OP": op,
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
    tdl.atomic_add(ctx, sig + 1, 1, peer)
    tdl.atomic_cas(ctx, sig + 2, 0, 1, peer)
    tdl.atomic_xchg(ctx, sig + 3, 1, peer)
    tdl.notify_add(ctx, sig + 4, peer, 1)
    tdl.notify(ctx, sig, peer, epoch)
    token = tdl.wait(ctx, sig, epoch)
    ptr = tdl.consume_token(buf, token)
    tdl.putmem_block(ctx, ptr + 3 * BLOCK, ptr, n, peer, BLOCK)
    tdl.getmem_block(ctx, ptr + 4 * BLOCK, ptr, n, peer, BLOCK)


def main(arch: int = 90) -> int:
    assert not tdl.INTERPRET, "run with TDIST_INTERPRET=0"
    target = GPUTarget("cuda", arch, 32)
    count = 0
    for kernel, signature, constexprs in specialisations():
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=target)
        assert compiled.asm.get("cubin"), f"{kernel.__name__}: no cubin"
        count += 1
    print(f"compiled {count} kernel specialisations for sm_{arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:])))
