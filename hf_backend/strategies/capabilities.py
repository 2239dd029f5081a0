"""What some strategies can do and others cannot, as small interfaces a strategy has or lacks
(Lightning Fabric's `_Sharded`, `_BackwardSyncControl`), instead of methods a strategy overrides
only to raise.

`capability(strategy, Joinable)` hands the strategy back as that interface, or refuses in one line
naming the call and the fix: the one place such refusals are written.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, TypeVar

import torch

from ..core.errors import HfBackendError


class Joinable(ABC):
    """Processes whose loaders run out at different steps keep training until all are done
    (`join_uneven_inputs`, torch's Join). A sharded strategy cannot: a process out of data would
    leave the others waiting in their collectives."""

    @abstractmethod
    def join(self, joinables: list) -> contextlib.AbstractContextManager:
        """The context the training loop runs in."""


class SequenceLoader(ABC):
    """A strategy whose engine cuts the sequences in the loader (DeepSpeed's ALST adapter): loaders
    prepared with the model, and `deepspeed_ulysses_dl_adapter`, go through it."""

    @abstractmethod
    def sequence_loader(self, loader: Any) -> Any:
        """`loader` (each rank's own batches) as this rank's slices of its group's batches."""


class Pipelined(ABC):
    """Forward and backward in one call through a pipeline schedule (`accelerator.forward_backward`): the
    strategy of `ParallelismConfig(pp_size=P)`, whose stages sit on other ranks."""

    @abstractmethod
    def forward_backward(self, model: torch.nn.Module, batch: Any, accumulation_steps: int,
                         num_items_in_batch: torch.Tensor | float | None = None) -> torch.Tensor:
        """The batch's mean loss (with `num_items_in_batch`: its sum divided by that), on every rank, its
        gradients accumulated into the stages' parameters."""

    @abstractmethod
    def forward_only(self, model: torch.nn.Module, batch: Any, num_items_in_batch: torch.Tensor | float | None = None,
                     logits: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The batch through the stages without gradients: its loss (None without labels) and, with `logits`,
        its logits, on every rank."""


class ValueClipping:
    """Gradients clipped element-wise (`clip_grad_value_`), by default with torch's function; an
    engine that clips by norm itself has no such step."""

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)


_REFUSALS = {
    Joinable: "join_uneven_inputs is supported with DDP only: under {name} a process that runs "
              "out of data would hang the others; use even_batches=True (the default) instead",
    Pipelined: "forward_backward and forward_only run a pipeline schedule: they need ParallelismConfig(pp_size=...) "
               "above 1; under {name} call model(**batch) and accelerator.backward(loss)",
    ValueClipping: "clip_grad_value_ is not available with {name}; clip by norm instead "
                   "(clip_grad_norm_; DeepSpeed: set gradient_clipping in its config)",
}
_NAMES = {"DEEPSPEED": "DeepSpeed"}  # a strategy in messages, by its distributed type

Capability = TypeVar("Capability")


def capability(strategy: Any, kind: type[Capability]) -> Capability:
    """`strategy` as the capability `kind`; a strategy without it is refused in one line."""
    if not isinstance(strategy, kind):
        shown = str(getattr(strategy.distributed_type, "value", strategy.distributed_type))
        raise HfBackendError(_REFUSALS[kind].format(name=_NAMES.get(shown, shown)))
    return strategy
