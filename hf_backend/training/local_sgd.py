"""Local SGD: each process trains on its own for a few steps, then the processes average their
parameters.

Same surface as Accelerate's `accelerate.local_sgd.LocalSGD`:

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in train_dl:
            ...
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()

Inside the block DDP does not all-reduce gradients (the model is under `no_sync`), so each process's
optimizer steps on its own gradients; every `local_sgd_steps` calls of `step()`, and once more when
the block ends, every parameter is replaced by its mean over the processes.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..core.errors import HfBackendError
from ..core.notes import note
from ..runtime.collectives import reduce_flat


class LocalSGD:
    """Run `local_sgd_steps` optimizer steps per process between parameter averages (plain data
    parallelism only)."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        if getattr(accelerator, "replica_groups", None) is not None:
            raise HfBackendError("LocalSGD with fault_tolerance: replica groups meet every N steps with "
                                 "fault_tolerance_config sync_every=N (LocalSGD between the groups; DiLoCo with "
                                 "outer_lr and outer_momentum), docs/fault_tolerance.md; drop LocalSGD")
        if enabled and (isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int)
                        or local_sgd_steps < 1):
            raise HfBackendError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): give the number "
                                 "of optimizer steps between parameter averages, an int >= 1")
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.num_steps = 0
        self.enabled = bool(enabled) and accelerator.num_processes > 1
        if enabled and not self.enabled:
            note("LocalSGD in a single process: nothing to average, it does nothing")
        if self.enabled and not isinstance(model, DistributedDataParallel):
            raise HfBackendError(f"LocalSGD(model=...) averages whole parameters of a DDP model, not of a "
                                 f"{type(model).__name__} (FSDP and DeepSpeed shard them): train without "
                                 "fsdp_plugin/deepspeed_plugin and pass the model accelerator.prepare() returned")
        self._no_sync: contextlib.ExitStack | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = contextlib.ExitStack()
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.enabled or self._no_sync is None:
            return
        try:
            # After an error, another process may never reach the collective: averaging could hang,
            # so skip it.
            if exc_type is None:
                self._average()
        finally:
            self._no_sync.close()
            self._no_sync = None

    def step(self) -> None:
        """Count one optimizer step; average the parameters on every `local_sgd_steps`-th call."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        """Replace each floating-point parameter by its mean over the processes: one all-reduce per
        dtype."""
        self.accelerator.wait_for_everyone()
        floating = [param.data for param in self.model.parameters() if param.is_floating_point()]
        reduce_flat(floating, lambda flat: self.accelerator.reduce(flat, reduction="mean"))
