"""What the training step needs to know about gradient accumulation and the loader being iterated.

One instance per Accelerator, shared with its prepared optimizers, schedulers and dataloaders.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config.options import GradientAccumulationPlugin
from ..runtime import accelerate_state


class GradientState:
    """`plugin_kwargs` holds the accumulation options as Accelerate keeps them: `num_steps` always
    (Accelerate's plugin has no default for it, so the value given is kept, 1 included:
    transformers' Trainer reads `plugin_kwargs["num_steps"]`), the others when they differ from
    their defaults. Scripts and libraries read and change that dict
    (`plugin_kwargs["sync_each_batch"] = True`), and the properties below read it, so a change there
    takes effect."""

    def __init__(self, plugin: GradientAccumulationPlugin) -> None:
        self.plugin_kwargs: dict[str, Any] = {
            f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin)
            if f.name == "num_steps" or getattr(plugin, f.name) != f.default}
        # Accelerate's GradientState, when it follows this one (accelerate_state.py)
        self.mirror: dict | None = None
        self._sync_gradients = True
        self.micro_step = 0  # micro steps seen by accumulate() since the last sync (Accelerator.step)
        self._active: list[Any] = []  # prepared dataloaders being iterated, innermost last

    @property
    def sync_gradients(self) -> bool:
        return self._sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, sync: bool) -> None:
        self._sync_gradients = sync
        if self.mirror is not None:
            accelerate_state.write_gradient_state(self)

    def _option(self, name: str) -> Any:
        return self.plugin_kwargs.get(name, _DEFAULTS[name])

    @property
    def num_steps(self) -> int:
        return self._option("num_steps")

    @num_steps.setter
    def num_steps(self, steps: int) -> None:
        self.plugin_kwargs["num_steps"] = steps

    @property
    def adjust_scheduler(self) -> bool:
        return self._option("adjust_scheduler")

    @property
    def sync_with_dataloader(self) -> bool:
        return self._option("sync_with_dataloader")

    @property
    def sync_each_batch(self) -> bool:
        return self._option("sync_each_batch")

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's test scripts call it between runs; here each Accelerator has its own
        GradientState, so there is no shared state to clear."""

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Accelerate's name: transformers' Trainer decides the accumulation window itself and says so
        here."""
        self.sync_gradients = sync_gradients

    @property
    def active_dataloader(self) -> Any | None:
        return self._active[-1] if self._active else None

    @property
    def active_loaders(self) -> tuple[Any, ...]:
        """The prepared dataloaders being iterated, innermost last."""
        return tuple(self._active)

    @property
    def in_dataloader(self) -> bool:
        return bool(self._active)

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_dataloader
        return loader is not None and loader.end_of_dataloader

    @property
    def remainder(self) -> int:
        """Real rows in the last global batch of the active loader (-1 when unknown, 0 when it is
        full)."""
        loader = self.active_dataloader
        return -1 if loader is None else loader.remainder

    def enter_dataloader(self, loader: Any) -> None:
        self._active.append(loader)
        if self.mirror is not None:
            accelerate_state.write_gradient_state(self)

    def exit_dataloader(self, loader: Any) -> None:
        if loader in self._active:
            self._active.remove(loader)
        if self.mirror is not None:
            accelerate_state.write_gradient_state(self)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GradientAccumulationPlugin)}
