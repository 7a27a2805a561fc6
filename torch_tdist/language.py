"""Device-side primitives for kernels that talk to peers through the symmetric heap.

Every kernel gets one ``ctx`` argument: the group's context tensor (``heap.ctx``), int64 on
the group's device. Its layout (``CTX_*`` below) carries this rank, the world size, the wait
timeout and each peer's heap base address as mapped into this process, so pointer
translation is ``remote = base[peer] + (ptr - base[rank])`` (the Iris scheme).

Names follow Triton-distributed's where they mean the same thing (``rank``, ``num_ranks``,
``symm_at``, ``wait``, ``notify``, ``consume_token``, ``putmem_block``/``getmem_block``), with
``ctx`` as the first argument because stock Triton has no per-kernel global state.

The same source runs compiled on a GPU and under the Triton interpreter on the CPU, one
process per rank, peers' memory reached through shared-memory mappings. Decorate kernels
with :func:`jit` (not ``triton.jit``) so the choice is made once, here.
"""

import ctypes
import operator
import time

import numpy

import triton
import triton.language as tl

from .config import decide_interpret

HEAP_ALIGN = 256  # bytes; every heap base is a multiple of it (symm_at relies on it)

# Layout of the ctx tensor (constexpr so compiled kernels may read them; ``.value`` on the host)
CTX_RANK = tl.constexpr(0)
CTX_WORLD = tl.constexpr(1)
CTX_TIMEOUT_MS = tl.constexpr(2)
CTX_ABORT = tl.constexpr(3)  # address of the group's abort word as kernels see it, 0 for none
# GPU waits read the abort word (host memory, over PCIe) once per this many polls. Reading it every
# 1024 polls slowed the fused all-gather + matmul 25x on H200s (its copy-engine pushes crawled while
# 132 programs waited); 16384 polls cost nothing there, and a dead peer is still noticed within
# 0.4 s of the abort (tests/gpu_dead_peer.py at 131072: 10.0-10.4 s for a 10 s timeout).
ABORT_POLLS = tl.constexpr(16384)
CTX_BASES = tl.constexpr(8)
# The rest of the abort word's page (host memory; GPUs map it), in int64 words from the abort
# word: the signal arrays the library's kernels wait on, MAX_REGIONS of (first slot's address,
# slots per peer, peers), each peer's slots together, zeros after the last; then a word per
# program (program % STUCK_RECORDS) where a GPU wait that was stuck when the group was aborted
# leaves the address of the slot it waited on. The C++ watchdog names those slots' peers. A group
# publishes as many regions as its registered algorithms declare (at most MAX_REGIONS).
PAGE_REGIONS = tl.constexpr(8)
MAX_REGIONS = tl.constexpr(12)
PAGE_STUCK = tl.constexpr(48)
STUCK_RECORDS = tl.constexpr(64)


INTERPRET = decide_interpret()
"""True when kernels run under the Triton interpreter (no GPU, or TDIST_INTERPRET=1)."""


def _dependent_launch() -> bool:
    import torch

    # (a group may still launch without it: its config's dependent_launch)
    return not INTERPRET and torch.version.hip is None


# The AMD architectures every kernel is compiled for (tests/test_compile.py checks each on the
# CPU): MI300X and MI355X. A ROCm GPU of another architecture is refused when a group is created.
AMD_ARCHS = ("gfx942", "gfx950")


def check_amd_arch(arch: str) -> None:
    """Raises a ValueError unless ``arch``, an AMD GPU's architecture as ROCm names it
    (``gcnArchName``: "gfx942" or with its features, "gfx942:sramecc+:xnack-"), is one of
    :data:`AMD_ARCHS`. Triton would compile the kernels for any architecture it knows; only these
    are checked to compile (on the CPU, every kernel), so another one is refused, by name."""
    base = str(arch).split(":")[0]
    if base not in AMD_ARCHS:
        raise ValueError(f"tdist: this GPU is {base or repr(arch)}; tdist's kernels are built for "
                         f"{', '.join(AMD_ARCHS)} (language.AMD_ARCHS). Use another backend for this GPU "
                         f"(e.g. nccl, RCCL on ROCm), or add {base or 'its architecture'} to language.AMD_ARCHS "
                         f"once every kernel compiles for it (python -m tests.compile_kernels {base or 'ARCH'}).")

DEPENDENT_LAUNCH = _dependent_launch()
"""Whether kernels can be launched with programmatic dependent launch (CUDA GPUs): see
:func:`wait_prior_kernels`."""


if INTERPRET:
    from triton.runtime.interpreter import GridExecutor, InterpretedFunction

    class _InPlaceGridExecutor(GridExecutor):
        # The stock executor copies every tensor argument's storage back onto itself after
        # the launch. For symmetric memory that write-back would overwrite whatever peers
        # stored into it meanwhile (a signal, a put), so CPU arguments are used in place.
        def _restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
            tensors = [a for a in list(args_dev) + list(kwargs.values()) if hasattr(a, "data_ptr")]
            if any(t.device.type != "cpu" for t in tensors):
                super()._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

    class _InPlaceInterpretedFunction(InterpretedFunction):
        def run(self, *args, grid, warmup, **kwargs):
            if warmup:
                return
            fn = self.rewrite()
            return _InPlaceGridExecutor(fn, self.arg_names, grid, self.pre_run_hooks)(*args, **kwargs)

    def jit(fn=None, **kwargs):
        """``triton.jit`` for tdist kernels: interpreted on the CPU, compiled on GPUs."""
        if fn is None:
            return lambda f: _InPlaceInterpretedFunction(f, **kwargs)
        return _InPlaceInterpretedFunction(fn, **kwargs)

else:
    jit = triton.jit


class PeerTimeoutError(TimeoutError):
    """A wait() in a kernel saw no signal from a peer within the group's timeout. ``address``:
    the signal slot waited on (None when unknown); ``satisfied(value)``: whether a value there
    would have ended the wait (the executor reads peers' slots with it to name the missing)."""

    address = None
    satisfied = None


class GroupAbortedError(PeerTimeoutError):
    """A wait gave up because the group was aborted (``ProcessGroupTDist.abort()``)."""


def aborted(abort_address: int) -> bool:
    """Whether the abort word at ``abort_address`` (0: none) is set."""
    return abort_address != 0 and ctypes.c_int64.from_address(abort_address).value != 0


@jit
def rank(ctx):
    return tl.load(ctx + CTX_RANK).to(tl.int32)


@jit
def num_ranks(ctx):
    return tl.load(ctx + CTX_WORLD).to(tl.int32)


@jit
def symm_at(ctx, ptr, peer):
    """The address of the symmetric object ``ptr`` (in this rank's heap) on ``peer``.

    Heap bases are aligned to HEAP_ALIGN bytes, so the distance between two of them is a
    multiple of 16 elements: the translated pointer keeps ``ptr``'s alignment, and loads
    through it stay as wide as loads through ``ptr`` (the compiler sees the 16 in ``* 16``;
    ``peer`` may be a block of any shape).
    """
    my_base = tl.load(ctx + CTX_BASES + rank(ctx))
    peer_base = tl.load(ctx + CTX_BASES + peer)
    elem_bytes: tl.constexpr = (ptr.dtype.element_ty.primitive_bitwidth + 7) // 8
    return ptr + (peer_base - my_base) // (16 * elem_bytes) * 16


@jit
def load(ctx, ptr, peer, mask=None, other=None):
    return tl.load(symm_at(ctx, ptr, peer), mask=mask, other=other)


@jit
def store(ctx, ptr, value, peer, mask=None):
    tl.store(symm_at(ctx, ptr, peer), value, mask=mask)


@jit
def store_polled(ctx, ptr, value, peer, mask=None):
    """:func:`store` of data that a peer polls for (:func:`wait_filled`: data that are their own
    signal): a strong store at system scope (PTX ``st.global.wt``; STG.E.STRONG.SYS on H200s),
    which a polling peer is bound to see. A plain store is weak: on 4 H200s peers polling for
    plain stores, fenced or not, sometimes saw them only once the storing kernel had ended."""
    tl.store(symm_at(ctx, ptr, peer), value, mask=mask, cache_modifier=".wt")


@jit
def atomic_add(ctx, ptr, value, peer):
    """Atomic add on ``peer``'s copy of ``ptr`` (acq_rel, system scope); returns the old value."""
    return tl.atomic_add(symm_at(ctx, ptr, peer), value, sem="acq_rel", scope="sys")


@jit
def atomic_cas(ctx, ptr, cmp, value, peer):
    target = symm_at(ctx, ptr, peer)
    kind = target.dtype.element_ty
    return tl.atomic_cas(target, tl.cast(cmp, kind), tl.cast(value, kind), sem="acq_rel", scope="sys")


@jit
def atomic_xchg(ctx, ptr, value, peer):
    return tl.atomic_xchg(symm_at(ctx, ptr, peer), value, sem="acq_rel", scope="sys")


@jit
def _larger(a, b):
    return tl.maximum(a, b)


@jit
def largest(x):
    """The largest element of the 1-D block ``x`` (``tl.max``, which the interpreter cannot call
    from here)."""
    return tl.reduce(x, 0, _larger)


@jit
def notify(ctx, sig, peer, value, mask=None):
    """Release: everything this program stored before is visible to ``peer`` once it sees ``value``.

    ``sig`` is an int64 slot in this rank's heap; the slot of the same offset on ``peer`` is set.
    ``peer`` may be a block of ranks (where ``mask`` holds): every one is signalled at once.
    """
    tl.atomic_xchg(symm_at(ctx, sig, peer), value, mask=mask, sem="release", scope="sys")


@jit
def notify_add(ctx, sig, peer, value):
    """Like :func:`notify`, but adds ``value`` to the slot (counting signals)."""
    tl.atomic_add(symm_at(ctx, sig, peer), value, sem="release", scope="sys")


def poll_until(read, satisfied, timeout_s: float, wanted: str, abort_address: int = 0) -> int:
    """Calls ``read()`` (an int from a signal slot), sleeping between polls (ranks share few
    cores), until ``satisfied`` of it; returns it. Gives up after ``timeout_s`` with a
    PeerTimeoutError, or once the abort word at ``abort_address`` is set with a
    GroupAbortedError. The host-side wait of every signal on the CPU."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while True:
        seen = read()
        if satisfied(seen):
            return seen
        if aborted(abort_address):
            raise GroupAbortedError(f"tdist: the group was aborted while waiting for {wanted} (saw {seen})")
        if time.monotonic() > deadline:
            raise PeerTimeoutError(f"tdist: no signal from a peer after {timeout_s:.1f} s "
                                   f"(waited for {wanted}, saw {seen})")
        time.sleep(pause)
        pause = min(pause * 2 + 1e-5, 1e-3)


if INTERPRET:

    @jit
    def wait(ctx, sig, value):
        """Acquire: spin until the local int64 slot ``sig`` holds ``value`` or more.

        Signals carry epochs that only grow, so ``>=`` never misses a signal that came early.
        Under the interpreter the spin sleeps between polls (ranks share few cores) and gives
        up after the group's timeout.
        """
        return _spin_to(sig, value, False, tl.load(ctx + CTX_TIMEOUT_MS), tl.load(ctx + CTX_ABORT))

    @jit
    def wait_equal(ctx, sig, value):
        """:func:`wait` for exactly ``value`` (a call's signature, not an epoch)."""
        return _spin_to(sig, value, True, tl.load(ctx + CTX_TIMEOUT_MS), tl.load(ctx + CTX_ABORT))

    @jit
    def wait_all(ctx, sigs, value, mask):
        """:func:`wait` for every slot of the block ``sigs`` where ``mask`` holds (``value``: one
        for all, or a block of one per slot)."""
        _spin_all(sigs, value, mask, tl.load(ctx + CTX_TIMEOUT_MS), tl.load(ctx + CTX_ABORT))

    @jit
    def wait_lines(ctx, lines, mask, flag):
        """Spin until every int64 line of the block ``lines`` where ``mask`` holds carries
        ``flag`` in its high half (a line is ``flag << 32 | 32 bits of data``, stored at once: see
        triton_kernels/lowlatency.py); returns the lines (0 where masked)."""
        _spin_lines(lines, mask, flag, tl.load(ctx + CTX_TIMEOUT_MS), tl.load(ctx + CTX_ABORT))
        return tl.load(lines, mask=mask, other=0)

    @jit
    def wait_filled(ctx, ptrs, mask):
        """Spin until no element of the block ``ptrs`` where ``mask`` holds is 0 (a mailbox at
        rest holds zeros and senders never send one); returns
        the elements (0 where masked)."""
        _spin_filled(ptrs, mask, tl.load(ctx + CTX_TIMEOUT_MS), tl.load(ctx + CTX_ABORT))
        return tl.load(ptrs, mask=mask, other=0)

    # Plain Python below: the interpreter rewrites jit functions' arithmetic into tensor ops.
    def host_int(value) -> int:
        """An interpreter scalar (or a constexpr, or an int) as a Python int."""
        if isinstance(value, tl.constexpr):
            value = value.value
        if hasattr(value, "handle"):
            return int(value.handle.data.reshape(-1)[0])
        return operator.index(value)

    def _spin_to(sig, value, equal, timeout_ms, abort_address):
        wanted = host_int(value)
        satisfied = (lambda seen: seen == wanted) if equal else (lambda seen: seen >= wanted)
        return spin_until(sig, satisfied, host_int(timeout_ms) / 1000.0, f"{'value' if equal else 'epoch'} {wanted}",
                          host_int(abort_address))

    def _spin_all(sigs, value, mask, timeout_ms, abort_address):
        live = mask.handle.data.reshape(-1).astype(bool)
        if not live.any():
            return
        wanted = [int(v) for v in numpy.broadcast_to(_values(value), live.shape)[live]]
        addresses = [int(a) for a in sigs.handle.data.reshape(-1)[live]]
        short = [0]  # the first slot short of its value at the last poll

        def seen_by_first_short():
            seen = tl.atomic_add(sigs, 0, mask=mask, sem="acquire", scope="sys").handle.data.reshape(-1)[live]
            short[0] = next((i for i, (s, w) in enumerate(zip(seen, wanted)) if s < w), None)
            return int(seen[short[0] if short[0] is not None else 0])
        try:
            poll_until(seen_by_first_short, lambda seen: short[0] is None, host_int(timeout_ms) / 1000.0,
                       f"epoch {max(wanted)}", host_int(abort_address))
        except PeerTimeoutError as err:
            i = short[0] or 0
            err.address, err.satisfied = addresses[i], (lambda seen: seen >= wanted[i])
            raise

    def _values(value):
        """An interpreter block, scalar, constexpr or int as a numpy array."""
        if isinstance(value, tl.constexpr):
            value = value.value
        return value.handle.data if hasattr(value, "handle") else numpy.asarray(value)

    def _spin_lines(lines, mask, flag, timeout_ms, abort_address):
        wanted = host_int(flag)
        _spin_block(lines, mask, lambda seen: ((seen >> 32) & 0xFFFFFFFF) == wanted,
                    f"lines with flag {wanted:#x}", timeout_ms, abort_address)

    def _spin_filled(ptrs, mask, timeout_ms, abort_address):
        _spin_block(ptrs, mask, lambda seen: seen != 0, "data in place of zeros", timeout_ms, abort_address)

    def _spin_block(ptrs, mask, arrived, wanted: str, timeout_ms, abort_address):
        """Polls the block ``ptrs`` where ``mask`` holds until ``arrived`` (of a numpy array of
        what was read) holds everywhere. On a timeout the error's slot is the int64 holding the
        first element short, and ``satisfied`` tells of an int64 whether that element arrived."""
        live = mask.handle.data.astype(bool)
        addresses = ptrs.handle.data
        bits = ptrs.dtype.element_ty.primitive_bitwidth

        def short():
            return live & ~arrived(tl.load(ptrs, mask=mask, other=0, volatile=True).handle.data)
        try:
            poll_until(lambda: int(short().sum()), lambda count: count == 0,
                       host_int(timeout_ms) / 1000.0, wanted, host_int(abort_address))
        except PeerTimeoutError as err:
            first = int(addresses[short()].reshape(-1)[0])
            err.address, shift = first // 8 * 8, first % 8 * 8
            err.satisfied = lambda seen: bool(arrived((seen >> shift) & ((1 << bits) - 1)))
            raise

    def spin_until(sig, satisfied, timeout_s: float, wanted: str, abort_address: int = 0):
        """Polls the int64 slot ``sig`` (acquire) until ``satisfied(value)`` (see
        :func:`poll_until`); returns the value as read."""
        last = []

        def read():
            last[:] = [tl.atomic_add(sig, 0, sem="acquire", scope="sys")]
            return host_int(last[0])
        try:
            poll_until(read, satisfied, timeout_s, wanted, abort_address)
        except PeerTimeoutError as err:
            err.address, err.satisfied = host_int(sig), satisfied
            raise
        return last[0]

else:

    @jit
    def wait(ctx, sig, value):
        """Acquire: spin until the local int64 slot ``sig`` holds ``value`` or more, or the
        group's abort word is set (then the program goes on with whatever it reads; the host
        raises for the group).

        Signals carry epochs that only grow, so ``>=`` never misses a signal that came early.
        """
        return _spin(ctx, sig, value, False)

    @jit
    def wait_equal(ctx, sig, value):
        """:func:`wait` for exactly ``value`` (a call's signature, not an epoch)."""
        return _spin(ctx, sig, value, True)

    @jit
    def wait_all(ctx, sigs, value, mask):
        """:func:`wait` for every slot of the block ``sigs`` where ``mask`` holds, all polled at
        once (a round trip per poll, not one per slot)."""
        abort = tl.load(ctx + CTX_ABORT)
        seen = tl.atomic_add(sigs, 0, mask=mask, sem="acquire", scope="sys")
        short = largest(tl.where(mask & (seen < value), 1, 0))
        polls = 0
        gave_up = abort < 0  # (False: an address)
        while (short != 0) & (not gave_up):
            seen = tl.atomic_add(sigs, 0, mask=mask, sem="acquire", scope="sys")
            short = largest(tl.where(mask & (seen < value), 1, 0))
            polls += 1
            if (polls % ABORT_POLLS == 0) & (abort != 0):
                gave_up = tl.load(abort.to(tl.pointer_type(tl.int64)), volatile=True) != 0
        if gave_up & (polls > ABORT_POLLS) & (short != 0):  # (it waited before the abort, not only after it)
            # a slot the last poll found short: the C++ watchdog names the peer it belongs to
            stuck = abort + 8 * (PAGE_STUCK + tl.program_id(0) % STUCK_RECORDS)
            tl.store(stuck.to(tl.pointer_type(tl.int64)),
                     largest(tl.where(mask & (seen < value), tl.cast(sigs, tl.int64), 0)))
        tl.debug_barrier()  # a thread per slot acquired; the whole program reads after them

    @jit
    def wait_lines(ctx, lines, mask, flag):
        """Spin until every int64 line of the block ``lines`` where ``mask`` holds carries
        ``flag`` in its high half (a line is ``flag << 32 | 32 bits of data``, stored at once: see
        triton_kernels/lowlatency.py), or the group's abort word is set; returns the lines (0
        where masked), read with volatile loads."""
        return _spin_block(ctx, lines, mask, flag, False)

    @jit
    def wait_filled(ctx, ptrs, mask):
        """Spin until no element of the block ``ptrs`` where ``mask`` holds is 0 (a mailbox at
        rest holds zeros and senders never send one), or the
        group's abort word is set; returns the elements (0 where masked), read with volatile
        loads."""
        return _spin_block(ctx, ptrs, mask, 0, True)

    @jit
    def _short_in_block(seen, mask, flag, FILLED: tl.constexpr):
        """Where a polled element is not there yet: 0 (FILLED), or a line without ``flag``."""
        if FILLED:
            return mask & (seen == 0)
        else:
            return mask & (((seen >> 32) & 0xFFFFFFFF) != flag)

    @jit
    def _poll_block(ptrs, mask, flag, FILLED: tl.constexpr):
        """One poll of the whole block: (what it read, 1 if an element is not there yet else 0)."""
        seen = tl.load(ptrs, mask=mask, other=0, volatile=True)
        return seen, largest(tl.ravel(tl.where(_short_in_block(seen, mask, flag, FILLED), 1, 0)))

    @jit
    def _spin_block(ctx, ptrs, mask, flag, FILLED: tl.constexpr):
        """The poll of wait_lines and wait_filled: the whole block at once, volatile loads."""
        abort = tl.load(ctx + CTX_ABORT)
        seen, short = _poll_block(ptrs, mask, flag, FILLED)
        polls = 0
        gave_up = abort < 0  # (False: an address)
        while (short != 0) & (not gave_up):
            seen, short = _poll_block(ptrs, mask, flag, FILLED)
            polls += 1
            if (polls % ABORT_POLLS == 0) & (abort != 0):
                gave_up = tl.load(abort.to(tl.pointer_type(tl.int64)), volatile=True) != 0
        if gave_up & (polls > ABORT_POLLS) & (short != 0):  # (as in wait_all; the int64 holding it)
            stuck = abort + 8 * (PAGE_STUCK + tl.program_id(0) % STUCK_RECORDS)
            tl.store(stuck.to(tl.pointer_type(tl.int64)),
                     largest(tl.ravel(tl.where(_short_in_block(seen, mask, flag, FILLED),
                                               tl.cast(ptrs, tl.int64) // 8 * 8, 0))))
        return seen

    @jit
    def _short_of(seen, value, EQUAL: tl.constexpr):
        if EQUAL:
            return seen != value
        else:
            return seen < value

    @jit
    def _spin(ctx, sig, value, EQUAL: tl.constexpr):
        abort = tl.load(ctx + CTX_ABORT)
        seen = tl.atomic_add(sig, 0, sem="acquire", scope="sys")
        polls = 0
        gave_up = abort < 0  # (False: an address)
        while _short_of(seen, value, EQUAL) & (not gave_up):
            seen = tl.atomic_add(sig, 0, sem="acquire", scope="sys")
            polls += 1
            if (polls % ABORT_POLLS == 0) & (abort != 0):
                gave_up = tl.load(abort.to(tl.pointer_type(tl.int64)), volatile=True) != 0
        if gave_up & (polls > ABORT_POLLS):  # (it waited before the abort, not only after it)
            stuck = abort + 8 * (PAGE_STUCK + tl.program_id(0) % STUCK_RECORDS)
            tl.store(stuck.to(tl.pointer_type(tl.int64)), tl.cast(sig, tl.int64))
        tl.debug_barrier()  # one thread acquired; the whole program reads after it
        return seen


if not DEPENDENT_LAUNCH:
    # (jit functions, empty: a compiled kernel may call only those; AMD GPUs compile this branch)
    @jit
    def wait_prior_kernels():
        """Programmatic dependent launch: this kernel waits here until the kernel before it on
        the stream has finished and its memory is visible. Nothing before this call may read
        what earlier kernels write (the ctx tensor is safe). A no-op where kernels run one after
        another anyway (the interpreter, AMD GPUs), and on NVIDIA GPUs where the kernel was
        launched without it (a group's ``dependent_launch`` option off)."""
        pass

    @jit
    def start_next_kernel():
        """Lets the next kernel on the stream (if it was launched for it, ``launch_pdl=True``)
        be scheduled now, to reach its :func:`wait_prior_kernels` while this one runs."""
        pass

else:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @jit
    def wait_prior_kernels():
        gdc_wait()

    @jit
    def start_next_kernel():
        gdc_launch_dependents()


@jit
def consume_token(value, token):
    """Orders ``value`` (usually a pointer) after the wait that returned ``token``.

    The acquire in :func:`wait` already orders later loads; this keeps kernels written for
    Triton-distributed portable.
    """
    return value


@jit
def putmem_block(ctx, dst, src, n, peer, BLOCK: tl.constexpr):
    """This program copies ``n`` elements from local ``src`` to symmetric ``dst`` on ``peer``."""
    remote = symm_at(ctx, dst, peer)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(remote + offs, tl.load(src + offs, mask=mask), mask=mask)


@jit
def getmem_block(ctx, dst, src, n, peer, BLOCK: tl.constexpr):
    """This program copies ``n`` elements from symmetric ``src`` on ``peer`` to local ``dst``."""
    remote = symm_at(ctx, src, peer)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(remote + offs, mask=mask), mask=mask)
