"""StepHooks: what the engine tells whoever follows its training steps, at the points a step is made of. The
Accelerator holds one (this default, which changes nothing, or fault tolerance's replica groups:
hf_backend/fault_tolerance) and asks it there; a hook receives the parts of the step it needs, never the
Accelerator."""

from __future__ import annotations

from typing import Any

import torch

from ..parallel.dims import DataShard


class StepHooks:
    def data_shard(self, shard: DataShard) -> DataShard:
        """Which part of each global batch this process reads, given the strategy's answer."""
        return shard

    def loader_prepared(self, loader: Any) -> None:
        """A training loader was prepared (over `data_shard`); it hands out one step's batch at a time."""

    def after_backward(self, models: list[torch.nn.Module]) -> None:
        """A synchronising backward is done: the gradients of `models` are this process's whole step's."""

    def commit(self) -> bool:
        """Before the optimizers step: whether this step's update is applied (once per step)."""
        return True

    def after_optimizer_step(self) -> None:
        """An optimizer stepped."""

    def close(self) -> None:
        """Training ended."""
