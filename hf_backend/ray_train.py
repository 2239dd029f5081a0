"""Checkpoints of an hf_backend run inside Ray Train's `TorchTrainer`.

Inside a Ray worker nothing else changes: Ray has already set up the process group (gloo on CPU
workers) and the torchrun-style environment, and `Accelerator()` takes world size, rank, local rank
and device from them.

What Ray adds is where checkpoints live. Ray persists a checkpoint by uploading each worker's
reported directory into one directory of the run's storage, merging the files of all workers. So
`report` writes this process's part of the state (exactly what `save_state` writes, without the
staging that needs one shared directory) into a directory of its own, on every process: rank 0's
full files (under DeepSpeed gathered from the ZeRO partitions), and each process's random state and,
under FSDP's SHARDED_STATE_DICT, its shards. Merged in storage they are one complete `save_state`
checkpoint, which `restore` (or `load_state` on `checkpoint.as_directory()`) reads back with any
strategy and world size.

    from hf_backend import Accelerator, ray_train

    def train_func(config):
        accelerator = Accelerator()
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        accelerator.register_for_checkpointing(progress)
        ray_train.restore(accelerator)           # continues from Ray's latest checkpoint, if the run has one
        for epoch in range(progress.epoch, epochs):
            ...
            ray_train.report(accelerator, {"loss": loss}, model=model)   # on every worker

Requires `ray[train]` (the `ray` extra); this module is the only part of hf_backend that imports
Ray.
"""

from __future__ import annotations

import numbers
import tempfile
from pathlib import Path
from typing import Any

import torch

from .accelerator.facade import Accelerator
from .checkpoint import manifest
from .checkpoint.layout import RAY_MODEL_DIR
from .core.errors import HfBackendError


def _ray_train() -> Any:
    try:
        import ray.train
    except ImportError:
        raise HfBackendError("hf_backend.ray_train needs Ray Train: "
                             "pip install 'hf_backend[ray]'") from None
    return ray.train


def plain_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Ray stores metrics as plain values: one-element tensors and numpy scalars become Python numbers.
    """
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise HfBackendError(f"report: metric {key!r} is a tensor of {value.numel()} "
                                     "elements; report a number (e.g. loss.item() or a mean)")
            value = value.item()
        elif isinstance(value, numbers.Number) and hasattr(value, "item"):
            value = value.item()
        out[key] = value
    return out


def report(accelerator: Accelerator, metrics: dict[str, Any], *, model: torch.nn.Module | None = None,
           checkpoint_state: bool = True) -> None:
    """Report `metrics` to Ray with a checkpoint of the training state; call it on every worker (it is
    collective, and Ray needs every worker to report the same number of times).

    `checkpoint_state=False` reports the metrics alone. `model`: also save that model's full weights
    under `model/` of the checkpoint in the `from_pretrained` layout (`save_model`).
    """
    train = _ray_train()
    metrics = plain_metrics(metrics)
    if not checkpoint_state and model is None:
        train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix=f"hf_backend_ray_rank{accelerator.process_index}_") as tmp:
        directory = Path(tmp)
        if checkpoint_state:
            accelerator.checkpoint_io.write(directory)
            # its own files: the other processes' parts join them in Ray's merge
            if accelerator.is_main_process:
                manifest.seal(directory)
        if model is not None:
            accelerator.save_model(model, directory / RAY_MODEL_DIR)
        # Upload is synchronous: the directory is in storage when report returns and can go.
        train.report(metrics, checkpoint=train.Checkpoint.from_directory(tmp))


def restore(accelerator: Accelerator, checkpoint_to_load: Any = None) -> Any:
    """Load the latest checkpoint Ray has for this run (after a worker failure, or a new `TorchTrainer`
    with the same `RunConfig(name=..., storage_path=...)`) into the prepared objects; returns it, or
    None when there is none.

    `checkpoint_to_load`: a `ray.train.Checkpoint` (e.g. passed in through `train_loop_config`) to
    load instead. Call it on every worker, after `prepare` and `register_for_checkpointing`.
    """
    found = checkpoint_to_load if checkpoint_to_load is not None else _ray_train().get_checkpoint()
    if found is None:
        return None
    with found.as_directory() as directory:
        accelerator.load_state(directory)
    return found
