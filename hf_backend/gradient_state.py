"""What the training step needs to know about gradient accumulation and the loader being iterated.

One instance per Accelerator, shared with its prepared optimizers, schedulers and dataloaders.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .options import GradientAccumulationPlugin


class GradientState:
    def __init__(self, plugin: GradientAccumulationPlugin) -> None:
        self.plugin = plugin
        self.sync_gradients = True
        self._active: list[Any] = []  # prepared dataloaders being iterated, innermost last

    @property
    def num_steps(self) -> int:
        return self.plugin.num_steps

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin.adjust_scheduler

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self.plugin)

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Accelerate's name: transformers' Trainer decides the accumulation window itself and says so here."""
        self.sync_gradients = sync_gradients

    @property
    def active_dataloader(self) -> Any | None:
        return self._active[-1] if self._active else None

    @property
    def in_dataloader(self) -> bool:
        return bool(self._active)

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_dataloader
        return loader is not None and loader.end_of_dataloader

    @property
    def remainder(self) -> int:
        """Real rows in the last global batch of the active loader (-1 when unknown, 0 when it is full)."""
        loader = self.active_dataloader
        return -1 if loader is None else loader.remainder

    def enter_dataloader(self, loader: Any) -> None:
        self._active.append(loader)

    def exit_dataloader(self, loader: Any) -> None:
        if loader in self._active:
            self._active.remove(loader)
