"""Strategies: how a model is placed, wrapped, synchronized and saved. One module each, one interface (base.py)."""

from __future__ import annotations

from ..config.plugins import FullyShardedDataParallelPlugin
from ..errors import HfBackendError
from ..log import note
from ..options import Handlers
from ..precision import Precision
from ..state import ProcessState
from .base import Strategy
from .ddp import DDPStrategy
from .fsdp import FSDPStrategy
from .single import SingleDeviceStrategy


def select_strategy(state: ProcessState, precision: Precision, handlers: Handlers,
                    distributed_type: str | None = None,
                    fsdp_plugin: FullyShardedDataParallelPlugin | None = None) -> Strategy:
    """Chosen once per Accelerator; `distributed_type` is what a launcher's config asked for, if anything."""
    if distributed_type == "DEEPSPEED":
        raise HfBackendError(
            "distributed_type DEEPSPEED (from the launcher's config) needs a strategy this version of hf_backend "
            "does not have yet; launch with MULTI_CPU/MULTI_GPU (plain --num_processes) for DDP"
        )
    if fsdp_plugin is not None:
        if state.distributed:
            return FSDPStrategy(state, precision, handlers, fsdp_plugin)
        fsdp_plugin.resolved()  # still report a bad option
        note("FSDP asked for in a single process: training unsharded (sharded checkpoints still load)")
    cls = DDPStrategy if state.distributed else SingleDeviceStrategy
    return cls(state, precision, handlers)


__all__ = ["DDPStrategy", "FSDPStrategy", "SingleDeviceStrategy", "Strategy", "select_strategy"]
