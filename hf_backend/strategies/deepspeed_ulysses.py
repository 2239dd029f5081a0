"""DeepSpeed's own Ulysses sequence parallelism (ALST), when DeepSpeed is the strategy and
`ParallelismConfig(sp_size=S, sp_backend="deepspeed")` asks for it: Accelerate's route, run by DeepSpeed.

DeepSpeed makes the sequence-parallel groups (`parallel_state_sp`, handed to `deepspeed.initialize` as
its `mpu`) and swaps its all-to-all attention in for the model's attention implementation in
transformers' registry (`UlyssesSPAttentionHF.register_with_transformers`: process-wide, DeepSpeed's
doing, asked for by choosing its ALST). Its loader adapter gathers one batch from each of the S ranks
and hands every rank its slice of each in turn, labels shifted (`shift_labels`), so one optimizer step
of S ranks trains on one rank's batch and a loader is S times as long. The loss over the slices is the
script's to combine (transformers' Trainer does it: its `deepspeed_sp_compute_loss`). ZeRO partitions
over every process; DeepSpeed's data parallelism is the world / S.

That combined loss (the slices' losses all-gathered and weighed by their target counts: every rank
holds the group's whole loss) backpropagates S times each slice's share (the all-gather's backward
sums the S ranks' identical contributions). ZeRO-3 averages the gradients over every process, which
makes them one process's; ZeRO-0, 1 and 2 over DeepSpeed's data parallelism only, which leaves them S
times as large (measured on DeepSpeed 0.19.8: the gradient norm S times one process's, SGD's steps S
times as large; AdamW and active clipping hide it). Below ZeRO-3 `backward` divides the loss by S, so
the gradients are one process's at every stage.

hf_backend's own Ulysses (strategies/ulysses.py) is the one on the mesh path (FSDP); this module only
wires DeepSpeed's in.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..config.options import Handlers
from ..config.plugins import DeepSpeedPlugin
from ..core.errors import HfBackendError
from ..parallel.dims import MeshShape
from ..runtime.process import ProcessState
from ..training.gradient_state import GradientState
from ..training.precision import Precision
from .capabilities import SequenceLoader
from .deepspeed import DeepSpeedStrategy


class DeepSpeedUlyssesStrategy(DeepSpeedStrategy, SequenceLoader):
    """DeepSpeed ZeRO with its ALST sequence parallelism over `shape.sp` ranks."""

    def __init__(self, process: ProcessState, precision: Precision, handlers: Handlers, plugin: DeepSpeedPlugin,
                 gradient_state: GradientState, split_batches: bool, shape: MeshShape) -> None:
        super().__init__(process, precision, handlers, plugin, gradient_state, split_batches)
        self.shape = shape
        self.sequence_parallel = shape.sp
        self._groups: Any = None  # DeepSpeed's parallel_state_sp, once the engine is built

    def _resolve(self, config: dict[str, Any], model: torch.nn.Module, loader: DataLoader | None) -> dict[str, Any]:
        """DeepSpeed's batch is its data parallelism's, the world / S (transformers' Trainer fills in the
        world's: corrected here, as Accelerate does)."""
        config = super()._resolve(config, model, loader)
        config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] \
            * self.process.num_processes // self.sequence_parallel
        return config

    def _engine_arguments(self, model: torch.nn.Module) -> dict[str, Any]:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        config = getattr(model, "config", None)
        attention = getattr(config, "_attn_implementation", None)
        if attention in (None, "eager"):
            raise HfBackendError(f"sp_size={self.shape.sp} with DeepSpeed (its ALST): {type(model).__name__} "
                                 f"attends with {attention!r}; load it with attn_implementation='sdpa' (or a "
                                 "flash attention)")
        self._groups = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=self.shape.sp,
            micro_batch_size=self.config["train_micro_batch_size_per_gpu"], seq_length_is_variable=True,
            disable_in_eval=True)
        return {"mpu": self._groups}

    def backward(self, loss: torch.Tensor, accumulation_steps: int, sync: bool, **kwargs: Any) -> None:
        """`loss`: the group's combined loss, the same on each of its S ranks (the module docstring)."""
        if self.zero_stage < 3:
            loss = loss / self.sequence_parallel
        super().backward(loss, accumulation_steps, sync, **kwargs)

    def sequence_loader(self, loader: Any) -> Any:
        """`loader` (each rank's own batches) through DeepSpeed's adapter: this rank's slice of each
        of the group's batches in turn (Accelerate's `deepspeed_ulysses_dl_adapter`)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        if self._groups is None:
            raise HfBackendError("deepspeed_ulysses_dl_adapter: prepare the model first (DeepSpeed makes the "
                                 "sequence-parallel groups with its engine)")
        groups = self._groups
        return _Contiguous(UlyssesSPDataLoaderAdapter(
            loader, sp_rank=groups.get_sequence_parallel_rank(), sp_group=groups.get_sequence_parallel_group(),
            sp_world_size=groups.get_sequence_parallel_world_size(), device=self.process.device))


class _Contiguous:
    """DeepSpeed's adapter, its slices made contiguous: it cuts them as views along the sequence, and
    transformers' loss `view`s the shifted labels, which fails for a view of a batch of more than one
    row on a CPU (on a GPU the copy to the device makes them contiguous)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    def __len__(self) -> int:
        return len(self.adapter)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        batch = next(self.adapter)
        return {key: value.contiguous() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
