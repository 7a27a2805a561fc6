"""Call plans: a call's launches as C++ replays them for the next call of the same shape
(``csrc/device_path.hpp``, ``CallPlan``), and the recorded launches of the pipelined ops."""

from __future__ import annotations

import torch

from .. import language
from .base import LAUNCH_ROLE_PTR


class LaunchPlans:
    """The Executor's launch plans (it records ``_launched``, ``_replayable`` and ``_planned``)."""

    def _plan(self, src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor | None = None):
        """The call's launches as C++ can replay them for the next call of this shape (see
        ``csrc/device_path.hpp``, ``CallPlan``): a list, one per launch (per round of a message
        larger than a mailbox slot), of ``(function, grid, threads, shared bytes, params,
        dependent launch)``, each param ``(kind, value)`` with kind 0/1 a 64/32-bit literal,
        LAUNCH_ROLE_PTR the input's address plus ``value`` bytes, LAUNCH_ROLE_PTR + 1 the
        output's and LAUNCH_ROLE_PTR + 2 the all-to-all ``table``'s (C++ writes each call's own).
        None when the call was not only plain launches on ``src`` and ``dst``."""
        if language.INTERPRET or self._check_calls or not self._launched or not self._replayable:
            return None
        launched, self._launched = self._launched, []
        roles = {"src": (src, LAUNCH_ROLE_PTR), "dst": (dst, LAUNCH_ROLE_PTR + 1)}
        if table is not None:
            roles["tables"] = (table, LAUNCH_ROLE_PTR + 2)

        def within(value, t):
            """Whether ``value`` points into ``t``'s bytes, in its own memory (a copy the
            allocator placed right after it is not)."""
            offset = value.data_ptr() - t.data_ptr()
            return (value.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                    and 0 <= offset < max(t.numel() * t.element_size(), 1))

        def bind(name, value):
            if name not in roles:  # (a pointer into a call's tensor under another name: not replayable)
                inside = any(t.numel() and within(value, t) for t, _ in roles.values())
                return None if inside else (0, value.data_ptr())
            role, kind = roles[name]
            if role.data_ptr() % 16 or not role.is_contiguous() or not within(value, role):
                return None  # a copy of the caller's tensor, or unaligned
            return kind, value.data_ptr() - role.data_ptr()
        plans = [self._launch_tuple(kernel, compiled, grid, args, meta, bind)
                 for kernel, compiled, grid, args, meta in launched]
        return None if None in plans else plans

    def _launch_tuple(self, kernel, compiled, grid, args, meta, bind):
        """A recorded launch as ``LaunchPlan`` takes it: ``(function, grid, threads, shared
        bytes, params, dependent launch)``; ``bind(name, tensor)`` says what a pointer parameter
        holds, ``(kind, value)``, or None when it cannot be replayed (then None: neither can the
        launch). The tensors of literal pointers are kept alive."""
        md = compiled.metadata
        if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "global_scratch_size", 0)
                or getattr(md, "profile_scratch_size", 0) or getattr(md, "launch_cooperative_grid", False)
                or compiled.function is None):
            return None
        bound = dict(zip(kernel.arg_names, args), **meta)
        params, pinned = [], []
        for name, kind in compiled.src.signature.items():
            value = bound[name]
            if kind == "constexpr":
                continue
            if kind.startswith("*"):
                param = bind(name, value)
                if param is None:
                    return None
                params.append(param)
                if param[0] == 0:
                    pinned.append(value)
            elif kind in ("i32", "u32"):
                params.append((1, int(value) & 0xFFFFFFFF))
            elif kind in ("i64", "u64"):
                params.append((0, int(value) & 0xFFFFFFFFFFFFFFFF))
            else:
                return None
        params += [(0, 0), (0, 0)]  # Triton's global and profile scratch pointers: none
        self._planned.extend(pinned)
        # threads per block: the target's warp (AMD: a wavefront of 64) times the warps
        threads = getattr(md, "warp_size", 32) * md.num_warps
        return (compiled.function, (grid + (1, 1))[:3], threads, md.shared, params,
                bool(getattr(md, "launch_pdl", False)))
