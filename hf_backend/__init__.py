"""hf_backend: a training backend for Hugging Face Transformers.

`from hf_backend import Accelerator` is the engine; it imports without transformers. `Trainer` and
`TrainingArguments` (transformers' classes on the engine) are imported on first use.
"""

from typing import Any

from .accelerator import Accelerator
from .config.plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from .errors import HfBackendError
from .options import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)
from .state import DistributedType

__version__ = "0.1.0"

_TRAINER_NAMES = ("Trainer", "TrainingArguments")


def __getattr__(name: str) -> Any:
    if name in _TRAINER_NAMES:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hf_backend' has no attribute {name!r}")


__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "HfBackendError",
    "InitProcessGroupKwargs",
    "ProjectConfiguration",
    "Trainer",
    "TrainingArguments",
]
