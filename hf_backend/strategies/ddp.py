"""Data parallel over processes with torch's DistributedDataParallel (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from ..state import DistributedType
from .base import Strategy


class DDPStrategy(Strategy):
    @property
    def distributed_type(self) -> DistributedType:  # type: ignore[override]
        return DistributedType.MULTI_GPU if self.state.device.type == "cuda" else DistributedType.MULTI_CPU

    def setup_model(self, model: torch.nn.Module, device_placement: bool = True,
                    evaluation_mode: bool = False) -> torch.nn.Module:
        model = super().setup_model(model, device_placement)
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronize (a model only evaluated, or frozen)
        device_ids = [self.state.device.index] if self.state.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers at construction: ranks that seeded differently agree.
        return DistributedDataParallel(model, device_ids=device_ids, **self.handlers.ddp.to_kwargs())

    def is_wrapper(self, model: torch.nn.Module) -> bool:
        return isinstance(model, DistributedDataParallel)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()
