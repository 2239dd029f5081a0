"""Strategies: how a model is placed, wrapped, synchronized and saved. One module each, one interface (base.py)."""

from __future__ import annotations

from ..options import Handlers
from ..precision import Precision
from ..state import ProcessState
from .base import Strategy
from .ddp import DDPStrategy
from .single import SingleDeviceStrategy


def select_strategy(state: ProcessState, precision: Precision, handlers: Handlers) -> Strategy:
    """Chosen once per Accelerator."""
    cls = DDPStrategy if state.distributed else SingleDeviceStrategy
    return cls(state, precision, handlers)


__all__ = ["DDPStrategy", "SingleDeviceStrategy", "Strategy", "select_strategy"]
