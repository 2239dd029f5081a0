"""Strategies: how a model is placed, wrapped, synchronized and saved. One module each, one interface (base.py)."""

from __future__ import annotations

from ..config.backend import DATA_PARALLEL, Backend
from ..gradient_state import GradientState
from ..log import note
from ..options import Handlers
from ..precision import Precision
from ..state import ProcessState
from .base import Strategy
from .ddp import DDPStrategy
from .deepspeed import DeepSpeedStrategy
from .fsdp import FSDPStrategy
from .single import SingleDeviceStrategy


def select_strategy(process: ProcessState, precision: Precision, handlers: Handlers, backend: Backend | None = None,
                    gradient_state: GradientState | None = None, split_batches: bool = False) -> Strategy:
    """Chosen once per Accelerator, from `backend` (`config.backend.choose_backend`, with its options resolved) and
    the world size. FSDP or DeepSpeed asked for in a single process train unsharded, with a note."""
    backend = backend or Backend(DATA_PARALLEL)
    if backend.fsdp is not None:
        if process.distributed:
            return FSDPStrategy(process, precision, handlers, backend.fsdp)
        note("FSDP asked for in a single process: training unsharded (sharded checkpoints still load)")
    if backend.deepspeed is not None:
        if process.distributed:
            return DeepSpeedStrategy(process, precision, handlers, backend.deepspeed, gradient_state, split_batches)
        config = backend.deepspeed.config()  # still report a bad option
        unused = [f"{key} ({config[key].get('type', '?')})" for key in ("optimizer", "scheduler")
                  if isinstance(config.get(key), dict)]
        note("DeepSpeed asked for in a single process: training without it (ZeRO has nothing to partition)"
             + (f"; the config's {' and '.join(unused)} sections are not used: the script's (or the Trainer's) "
                "optimizer and scheduler train" if unused else ""))
    cls = DDPStrategy if process.distributed else SingleDeviceStrategy
    return cls(process, precision, handlers)


__all__ = ["DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "SingleDeviceStrategy", "Strategy", "select_strategy"]
