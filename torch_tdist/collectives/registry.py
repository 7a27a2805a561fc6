"""The registered algorithms, by name. Their order is routing's: the first eligible algorithm
that fits a call serves it (routing.py). TDIST_ALGORITHM may name any with ``selectable``."""

from __future__ import annotations

from .bulk import Bulk
from .hierarchical import Hierarchical
from .lowlatency import LowLatency
from .oneshot import OneShot
from .staged import Staged
from .streamed import Streamed
from .twoshot import TwoShot

ALGORITHMS = {
    "lowlatency": LowLatency,
    "bulk": Bulk,
    "streamed": Streamed,
    "twoshot": TwoShot,
    "oneshot": OneShot,
    "staged": Staged,
    "hierarchical": Hierarchical,
}


def create() -> dict:
    """A group's own instances of the registered algorithms, in registry order."""
    return {name: cls() for name, cls in ALGORITHMS.items()}


def selectable() -> tuple[str, ...]:
    """What TDIST_ALGORITHM may say."""
    return ("auto",) + tuple(name for name, cls in ALGORITHMS.items() if cls.selectable)
