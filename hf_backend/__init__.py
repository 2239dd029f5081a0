"""hf_backend: a training backend for Hugging Face Transformers.

`from hf_backend import Accelerator` is the engine; it imports without transformers. Every public name is imported on
first use, so the command line (`hf-backend config`, `--version`) starts without importing torch, and `Trainer` /
`TrainingArguments` (transformers' classes on the engine) only import transformers when asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE = {
    "Accelerator": ".accelerator",
    "DeepSpeedPlugin": ".config.plugins",
    "FullyShardedDataParallelPlugin": ".config.plugins",
    "HfBackendError": ".errors",
    "AutocastKwargs": ".options",
    "DataLoaderConfiguration": ".options",
    "DistributedDataParallelKwargs": ".options",
    "GradientAccumulationPlugin": ".options",
    "GradScalerKwargs": ".options",
    "InitProcessGroupKwargs": ".options",
    "ProjectConfiguration": ".options",
    "DistributedType": ".state",
    "Trainer": ".trainer",
    "TrainingArguments": ".trainer",
}

if TYPE_CHECKING:
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
    from .trainer import Trainer, TrainingArguments


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hf_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [  # the same names as _WHERE, spelled out for tools that read __all__ statically
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
