"""The one interface every way of wrapping a model (one process, DDP, FSDP, DeepSpeed) implements.

The Accelerator picks a strategy once and routes every model-touching call through it; it never asks which one it has.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

import torch

from ..checkpoint import read_weights
from ..options import Handlers
from ..precision import Precision
from ..state import DistributedType, ProcessState


class Strategy:
    """Defaults are those of a plain, unwrapped model on one device; subclasses override what they change."""

    distributed_type = DistributedType.NO

    def __init__(self, state: ProcessState, precision: Precision, handlers: Handlers) -> None:
        self.state = state
        self.precision = precision
        self.handlers = handlers

    # -- preparing ---------------------------------------------------------------------------------------------------
    def setup_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        if device_placement:
            model = model.to(self.state.device)
        self.precision.wrap_forward(model)
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module: no parallel wrapper, no torch.compile wrapper."""
        while True:
            inner = getattr(model, "module", None) if self.is_wrapper(model) else getattr(model, "_orig_mod", None)
            if not isinstance(inner, torch.nn.Module):
                return model
            model = inner

    def is_wrapper(self, model: torch.nn.Module) -> bool:
        return False

    # -- training step -----------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.precision.scale_and_backward(loss, **kwargs)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    # -- state -------------------------------------------------------------------------------------------------------
    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict; collective for sharded strategies, so call it on every process."""
        return self.unwrap_model(model).state_dict()

    def load_model_state(self, model: torch.nn.Module, directory: str | os.PathLike, filename_stem: str) -> None:
        read_weights(self.unwrap_model(model), directory, filename_stem=filename_stem)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        optimizer.load_state_dict(state_dict)
