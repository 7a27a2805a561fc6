"""Launch plans: a call's one launch as C++ replays it for the next call of the same shape
(``csrc/device_path.hpp``, ``LaunchPlan``), and the recorded launches of the pipelined ops."""

from __future__ import annotations

import torch

from .. import language
from .base import LAUNCH_ROLE_PTR


class LaunchPlans:
    """The Executor's launch plans (it records ``_launched``, ``_replayable`` and ``_planned``)."""

    def _plan(self, src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor | None = None):
        """The call's launch as C++ can replay it for the next call of this shape (see
        ``csrc/device_path.hpp``): ``(function, grid, threads, shared bytes, params, dependent
        launch)``, each param ``(kind, value)`` with kind 0/1 a 64/32-bit literal, LAUNCH_ROLE_PTR the input's
        address, LAUNCH_ROLE_PTR + 1 the output's and LAUNCH_ROLE_PTR + 2 the all-to-all ``table``'s
        (C++ writes each call's own). None when the call was not one plain launch on ``src``
        and ``dst``."""
        if language.INTERPRET or self._check_calls or len(self._launched) != 1 or not self._replayable:
            return None
        (kernel, compiled, grid, args, meta), = self._launched
        self._launched = []
        roles = {"src": (src.data_ptr(), LAUNCH_ROLE_PTR), "dst": (dst.data_ptr(), LAUNCH_ROLE_PTR + 1)}
        if table is not None:
            roles["tables"] = (table.data_ptr(), LAUNCH_ROLE_PTR + 2)

        def bind(name, value):
            if name not in roles:
                return 0, value.data_ptr()
            if value.data_ptr() != roles[name][0] or value.data_ptr() % 16:
                return None  # a copy of the caller's tensor, or unaligned
            return roles[name][1], 0
        return self._launch_tuple(kernel, compiled, grid, args, meta, bind)

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
