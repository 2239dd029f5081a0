"""Strategies: how a model is placed, wrapped, synchronized and saved. One module each, one interface
(base.py)."""

from __future__ import annotations

import dataclasses

from ..config.backend import DATA_PARALLEL, Backend
from ..config.fsdp import FsdpOptions
from ..config.options import Handlers
from ..core.errors import HfBackendError
from ..core.notes import note
from ..parallel.dims import MeshShape
from ..runtime.process import ProcessState
from ..training.gradient_state import GradientState
from ..training.precision import Precision
from .base import Strategy
from .ddp import DDPStrategy
from .deepspeed import DeepSpeedStrategy
from .deepspeed_ulysses import DeepSpeedUlyssesStrategy
from .fsdp import FSDPStrategy
from .pipeline_strategy import PipelineStrategy
from .single import SingleDeviceStrategy

_DEEPSPEED_GRID = ("parallelism_config with DeepSpeed: DeepSpeed takes sequence parallelism alone (sp_size "
                   "with sp_backend='deepspeed', its ALST); hf_backend applies tensor, context, expert and its own "
                   "sequence parallelism on its native path; drop deepspeed (shard with dp_shard_size) or those sizes")


def select_strategy(process: ProcessState, precision: Precision, handlers: Handlers, backend: Backend | None = None,
                    gradient_state: GradientState | None = None, split_batches: bool = False,
                    shape: MeshShape | None = None) -> Strategy:
    """Chosen once per Accelerator, from `backend` (`config.backend.choose_backend`, with its options
    resolved), the process grid a ParallelismConfig asked for (`shape`) and the world size. FSDP or
    DeepSpeed asked for in a single process train unsharded, with a note. A grid that shards
    anything (tp, cp, sp, dp_shard) is the native mesh path, with the FSDP options given or the
    defaults; one of replicas only is DDP. DeepSpeed takes a grid of sequence parallelism alone,
    `sp_backend="deepspeed"`: its own ALST (deepspeed_ulysses.py)."""
    backend = backend or Backend(DATA_PARALLEL)
    if shape is not None and shape.needs_mesh:
        if backend.deepspeed is not None:
            if shape.deepspeed_ulysses and process.distributed:
                assert gradient_state is not None  # the Accelerator's, which DeepSpeed's accumulation reads
                return DeepSpeedUlyssesStrategy(process, precision, handlers, backend.deepspeed, gradient_state,
                                                split_batches, shape)
            raise HfBackendError(_DEEPSPEED_GRID)
        # hf_backend's Ulysses, whichever the config named
        shape = dataclasses.replace(shape, sp_backend="hf_backend")
        mesh_path = PipelineStrategy if shape.pp > 1 else FSDPStrategy
        return mesh_path(process, precision, handlers, backend.fsdp or FsdpOptions(), shape)
    if backend.fsdp is not None:
        if process.distributed:
            return FSDPStrategy(process, precision, handlers, backend.fsdp)
        note("FSDP asked for in a single process: training "
             "unsharded (sharded checkpoints still load)")
    if backend.deepspeed is not None:
        if process.distributed:
            assert gradient_state is not None  # the Accelerator's, which DeepSpeed's accumulation reads
            return DeepSpeedStrategy(process, precision, handlers, backend.deepspeed, gradient_state, split_batches)
        config = backend.deepspeed.config()  # still report a bad option
        unused = [f"{key} ({config[key].get('type', '?')})" for key in ("optimizer", "scheduler")
                  if isinstance(config.get(key), dict)]
        note("DeepSpeed asked for in a single process: training "
             "without it (ZeRO has nothing to partition)"
             + (f"; the config's {' and '.join(unused)} sections are not used: the script's (or the Trainer's) "
                "optimizer and scheduler train" if unused else ""))
    cls = DDPStrategy if process.distributed else SingleDeviceStrategy
    return cls(process, precision, handlers)


__all__ = ["DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "PipelineStrategy", "SingleDeviceStrategy", "Strategy",
           "select_strategy"]
