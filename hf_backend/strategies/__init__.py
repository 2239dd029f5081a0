"""Strategies: how a model is placed, wrapped, synchronized and saved. One module each, one interface (base.py)."""

from __future__ import annotations

from ..errors import HfBackendError
from ..options import Handlers
from ..precision import Precision
from ..state import ProcessState
from .base import Strategy
from .ddp import DDPStrategy
from .single import SingleDeviceStrategy


def select_strategy(state: ProcessState, precision: Precision, handlers: Handlers,
                    distributed_type: str | None = None) -> Strategy:
    """Chosen once per Accelerator; `distributed_type` is what a launcher's config asked for, if anything."""
    if distributed_type in ("FSDP", "DEEPSPEED"):
        raise HfBackendError(
            f"distributed_type {distributed_type} (from the launcher's config) needs a strategy this version of "
            "hf_backend does not have yet; launch with MULTI_CPU/MULTI_GPU (plain --num_processes) for DDP"
        )
    cls = DDPStrategy if state.distributed else SingleDeviceStrategy
    return cls(state, precision, handlers)


__all__ = ["DDPStrategy", "SingleDeviceStrategy", "Strategy", "select_strategy"]
