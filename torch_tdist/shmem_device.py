"""NVSHMEM (or ROCSHMEM) device functions for tdist kernels, named like Triton-distributed's
``libshmem_device``.

These reach any PE, also on other nodes, where ``torch_tdist.language``'s loads and stores
reach P2P-mapped peers only. Addresses are symmetric: ``dest`` and ``sig_addr`` point into
this rank's heap, and the call acts on the same offset of ``pe``'s heap. Sizes are in
bytes, signals are 64-bit heap slots, ``pe`` is the rank in the heap's group.

    from torch_tdist import shmem_device as shmem

    @shmem.jit
    def kernel(dst, src, sig, nbytes, peer, epoch):
        shmem.putmem_signal_nbi_block(dst, src, nbytes, sig, epoch, shmem.NVSHMEM_SIGNAL_SET, peer)
        shmem.signal_wait_until(sig, shmem.NVSHMEM_CMP_GE, epoch)

Compiled (GPUs), the calls are NVSHMEM's own, linked from ``libnvshmem_device.bc``, and the
group's heap must use the ``nvshmem`` transport. With a ROCm build of torch (AMD GPUs, where the
SHMEM transport is ``rocshmem``) the same names call ROCSHMEM's device functions (the
work-group ones for NVSHMEM's block ones), linked from ``librocshmem_device.bc``, with the
``NVSHMEM_*`` constants translated to ROCSHMEM's values. Under the interpreter (CPU) the same calls
are carried out over the heap's shared-memory mappings, so kernels written with them are
tested without GPUs. Every call is block-scoped: all threads of a program make it together,
as NVSHMEM's ``*_block`` calls require.
"""

import ctypes
import operator

import torch
import triton
import triton.language as tl

from . import language

# NVSHMEM's values (nvshmem_common_transport.h, nvshmem_constants.h)
NVSHMEM_SIGNAL_SET = tl.constexpr(9)
NVSHMEM_SIGNAL_ADD = tl.constexpr(10)
NVSHMEM_CMP_EQ = tl.constexpr(0)
NVSHMEM_CMP_NE = tl.constexpr(1)
NVSHMEM_CMP_GT = tl.constexpr(2)
NVSHMEM_CMP_LE = tl.constexpr(3)
NVSHMEM_CMP_LT = tl.constexpr(4)
NVSHMEM_CMP_GE = tl.constexpr(5)

ROCSHMEM = tl.constexpr(torch.version.hip is not None)
"""Whether compiled kernels call ROCSHMEM (a ROCm build of torch) rather than NVSHMEM."""

# tdist's call: (NVSHMEM's device function, ROCSHMEM's), chosen when kernels are compiled
_SYMBOLS = {
    "putmem": ("nvshmemx_putmem_block", "rocshmem_putmem_wg"),
    "putmem_nbi": ("nvshmemx_putmem_nbi_block", "rocshmem_putmem_nbi_wg"),
    "putmem_signal": ("nvshmemx_putmem_signal_block", "rocshmem_putmem_signal_wg"),
    "putmem_signal_nbi": ("nvshmemx_putmem_signal_nbi_block", "rocshmem_putmem_signal_nbi_wg"),
    "fence": ("nvshmem_fence", "rocshmem_fence"),
    "quiet": ("nvshmem_quiet", "rocshmem_quiet"),
    # NVSHMEM's wait returns the value seen; ROCSHMEM's returns nothing, the fetch reads it
    "wait_until": ("nvshmem_signal_wait_until", "rocshmem_ulong_wait_until"),
    "signal_fetch": (None, "rocshmem_signal_fetch"),
}


def symbol(call: str) -> str:
    """The device function behind tdist's ``call`` for this process's GPUs."""
    return _SYMBOLS[call][int(ROCSHMEM.value)]


def device_library(arch: int = 90) -> str:
    """Path of NVSHMEM's device bitcode (the nvidia-nvshmem wheel's): the one built for
    ``arch`` (compute capability as 90) where the wheel ships one per architecture."""
    from .transports import nvshmem

    return nvshmem.device_library(arch)


if language.INTERPRET:
    jit = language.jit

    _int = language.host_int

    def _remote(ptr, pe):
        """``ptr`` (a pointer into this rank's heap) as the same offset of ``pe``'s heap."""
        from .heap import heap_at

        heap = heap_at(_int(ptr))
        delta = heap.peer_delta(_int(pe))
        return ptr + delta // (ptr.dtype.element_ty.primitive_bitwidth // 8), delta, heap

    def putmem_block(dest, source, nbytes, pe):
        _, delta, _ = _remote(dest, pe)
        ctypes.memmove(_int(dest) + delta, _int(source), _int(nbytes))

    def putmem_signal_block(dest, source, nbytes, sig_addr, signal, sig_op, pe):
        putmem_block(dest, source, nbytes, pe)
        signal_op(sig_addr, signal, sig_op, pe)

    def signal_op(sig_addr, signal, sig_op, pe):
        target, _, _ = _remote(sig_addr, pe)
        value = tl.cast(_int(signal), target.dtype.element_ty)
        if _int(sig_op) == NVSHMEM_SIGNAL_ADD.value:
            tl.atomic_add(target, value, sem="release", scope="sys")
        else:
            tl.atomic_xchg(target, value, sem="release", scope="sys")

    _COMPARE = {0: operator.eq, 1: operator.ne, 2: operator.gt, 3: operator.le, 4: operator.lt, 5: operator.ge}

    def signal_wait_until(sig_addr, cmp, cmp_val):
        from .heap import heap_at

        compare, wanted = _COMPARE[_int(cmp)], _int(cmp_val)
        heap = heap_at(_int(sig_addr))
        return language.spin_until(sig_addr, lambda seen: compare(seen, wanted), heap.timeout_s,
                                   f"a value {compare.__name__} {wanted}", heap.abort_address)

    def fence():
        pass  # the copies above completed in program order

    def quiet():
        pass

    putmem_nbi_block = putmem_block
    putmem_signal_nbi_block = putmem_signal_block

else:
    from triton.language import core
    from triton.runtime.jit import KernelInterface

    if ROCSHMEM:
        def _libraries_for(device: int) -> dict:
            from .transports import rocshmem

            return {"librocshmem_device": rocshmem.device_library()}

        def _init_module(module):
            from . import _C

            _C.rocshmem_init_module(module)
    else:
        def _libraries_for(device: int) -> dict:
            major, minor = torch.cuda.get_device_capability(device)
            return {"libnvshmem_device": device_library(10 * major + minor)}

        def _init_module(module):
            from . import _C

            _C.nvshmem_init_module(module)

    class _ShmemKernel(KernelInterface):
        """A kernel linked with the SHMEM device library; each loaded module gets its
        device state (``nvshmemx_cumodule_init``, ``rocshmem_hipmodule_init``) before its
        first launch."""

        def __init__(self, fn):
            self.fn = fn
            self._ready = set()
            self._libraries = {}  # device index -> extern_libs

        def run(self, *args, grid, warmup, **kwargs):
            if "extern_libs" not in kwargs:
                device = torch.cuda.current_device()
                if device not in self._libraries:
                    self._libraries[device] = _libraries_for(device)
                kwargs["extern_libs"] = self._libraries[device]
            kernel = self.fn.run(*args, grid=grid, warmup=True, **kwargs)
            kernel._init_handles()
            if kernel.module not in self._ready:
                _init_module(kernel.module)
                self._ready.add(kernel.module)
            if warmup:
                return kernel
            return self.fn.run(*args, grid=grid, warmup=False, **kwargs)

    def jit(fn=None, **kwargs):
        """``triton.jit`` for kernels that make NVSHMEM calls (interpreted on the CPU)."""
        if fn is None:
            return lambda f: _ShmemKernel(triton.jit(f, **kwargs))
        return _ShmemKernel(triton.jit(fn, **kwargs))

    _I64, _I32, _U64 = core.dtype("int64"), core.dtype("int32"), core.dtype("uint64")

    def _extern(symbol, args, types, result, _semantic):
        return core.extern_elementwise("", "", args, {tuple(types): (symbol, result)},
                                       is_pure=False, _semantic=_semantic)

    def _put_call(symbol):
        @core.extern
        def call(dest, source, nbytes, pe, _semantic=None):
            return _extern(symbol, [dest, source, nbytes, pe], [_I64, _I64, _I64, _I32], _I32, _semantic)
        return call

    def _put_signal_call(symbol):
        @core.extern
        def call(dest, source, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
            return _extern(symbol, [dest, source, nbytes, sig_addr, signal, sig_op, pe],
                           [_I64, _I64, _I64, _I64, _U64, _I32, _I32], _I32, _semantic)
        return call

    _putmem = _put_call(symbol("putmem"))
    _putmem_nbi = _put_call(symbol("putmem_nbi"))
    _putmem_signal = _put_signal_call(symbol("putmem_signal"))
    _putmem_signal_nbi = _put_signal_call(symbol("putmem_signal_nbi"))

    @core.extern
    def _wait(sig_addr, cmp, cmp_val, _semantic=None):
        # (ROCSHMEM's returns void: declared as returning the value, unused there, as Triton
        # needs a result type)
        return _extern(symbol("wait_until"), [sig_addr, cmp, cmp_val], [_I64, _I32, _U64], _U64,
                       _semantic)

    @core.extern
    def _fetch(sig_addr, _semantic=None):
        return _extern(symbol("signal_fetch"), [sig_addr], [_I64], _U64, _semantic)

    @core.extern
    def fence(_semantic=None):
        """Orders this PE's puts to each PE: later ones land after earlier ones."""
        return _extern(symbol("fence"), [], [], _I32, _semantic)

    @core.extern
    def quiet(_semantic=None):
        """Waits until every put this PE issued has landed."""
        return _extern(symbol("quiet"), [], [], _I32, _semantic)

    @triton.jit
    def _sig_op(sig_op):
        """``sig_op`` (NVSHMEM's value) as the library's."""
        op = tl.cast(sig_op, tl.int32)
        if ROCSHMEM:  # ROCSHMEM_SIGNAL_SET 0, ROCSHMEM_SIGNAL_ADD 1
            op = tl.where(op == NVSHMEM_SIGNAL_ADD, 1, 0)
        return op

    @triton.jit
    def putmem_block(dest, source, nbytes, pe):
        """Copies ``nbytes`` from local ``source`` to symmetric ``dest`` on ``pe``; returns
        when ``source`` may be reused."""
        _putmem(tl.cast(dest, tl.int64), tl.cast(source, tl.int64),
             tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))

    @triton.jit
    def putmem_nbi_block(dest, source, nbytes, pe):
        """Like :func:`putmem_block`, but returns at once (complete after :func:`quiet`)."""
        _putmem_nbi(tl.cast(dest, tl.int64), tl.cast(source, tl.int64),
             tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))

    @triton.jit
    def putmem_signal_block(dest, source, nbytes, sig_addr, signal, sig_op, pe):
        """:func:`putmem_block`, then ``sig_op`` (set or add) of ``signal`` on ``pe``'s
        ``sig_addr``, which a reader sees only after the data."""
        _putmem_signal(tl.cast(dest, tl.int64),
                    tl.cast(source, tl.int64), tl.cast(nbytes, tl.int64), tl.cast(sig_addr, tl.int64),
                    tl.cast(signal, tl.uint64), _sig_op(sig_op), tl.cast(pe, tl.int32))

    @triton.jit
    def putmem_signal_nbi_block(dest, source, nbytes, sig_addr, signal, sig_op, pe):
        """Like :func:`putmem_signal_block`, but returns at once."""
        _putmem_signal_nbi(tl.cast(dest, tl.int64),
                    tl.cast(source, tl.int64), tl.cast(nbytes, tl.int64), tl.cast(sig_addr, tl.int64),
                    tl.cast(signal, tl.uint64), _sig_op(sig_op), tl.cast(pe, tl.int32))

    @triton.jit
    def signal_op(sig_addr, signal, sig_op, pe):
        """``sig_op`` (set or add) of ``signal`` on ``pe``'s ``sig_addr``, once per program,
        ordered after this program's earlier puts to ``pe``."""
        _putmem_signal(tl.cast(sig_addr, tl.int64),
                    tl.cast(sig_addr, tl.int64), tl.cast(0, tl.int64), tl.cast(sig_addr, tl.int64),
                    tl.cast(signal, tl.uint64), _sig_op(sig_op), tl.cast(pe, tl.int32))

    @triton.jit
    def signal_wait_until(sig_addr, cmp, cmp_val):
        """Waits until this PE's ``sig_addr`` compares to ``cmp_val`` as ``cmp`` says; returns
        the value seen."""
        compare = tl.cast(cmp, tl.int32)
        if ROCSHMEM:  # ROCSHMEM's order: EQ NE GT GE LT LE
            compare = tl.where(compare == NVSHMEM_CMP_GE, 3, tl.where(compare == NVSHMEM_CMP_LE, 5, compare))
        seen = _wait(tl.cast(sig_addr, tl.int64), compare, tl.cast(cmp_val, tl.uint64))
        if ROCSHMEM:
            seen = _fetch(tl.cast(sig_addr, tl.int64))
        return seen
