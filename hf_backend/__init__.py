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
    "LocalSGD": ".local_sgd",
    "debug_launcher": ".launchers",
    "notebook_launcher": ".launchers",
    "skip_first_batches": ".data",
    "find_executable_batch_size": ".memory",
    "is_rich_available": ".availability",
    "DDPCommunicationHookType": ".enums",
    "ProfileKwargs": ".options",
    "PartialState": ".state",
    "synchronize_rng_states": ".seeding",
    "DeepSpeedPlugin": ".config.plugins",
    "FullyShardedDataParallelPlugin": ".config.plugins",
    "ParallelismConfig": ".config.parallelism",
    "TorchTensorParallelConfig": ".config.parallelism",
    "HfBackendError": ".errors",
    "AutocastKwargs": ".options",
    "DataLoaderConfiguration": ".options",
    "DistributedDataParallelKwargs": ".options",
    "GradientAccumulationPlugin": ".options",
    "GradScalerKwargs": ".options",
    "InitProcessGroupKwargs": ".options",
    "ProjectConfiguration": ".options",
    "DistributedType": ".state",
    "add_process_group_plugin": ".state",
    "Trainer": ".trainer",
    "TrainingArguments": ".trainer",
    "on_engine": ".trainer",
}

if TYPE_CHECKING:
    from .accelerator import Accelerator
    from .availability import is_rich_available
    from .config.parallelism import ParallelismConfig, TorchTensorParallelConfig
    from .config.plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from .data import skip_first_batches
    from .enums import DDPCommunicationHookType
    from .errors import HfBackendError
    from .launchers import debug_launcher, notebook_launcher
    from .local_sgd import LocalSGD
    from .memory import find_executable_batch_size
    from .options import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
        ProjectConfiguration,
    )
    from .seeding import synchronize_rng_states
    from .state import DistributedType, PartialState, add_process_group_plugin
    from .trainer import Trainer, TrainingArguments, on_engine


def __getattr__(name: str) -> Any:
    """A public name, imported on first use; an Accelerate name hf_backend refuses (`init_empty_weights`, the module
    `big_modeling`, ...: hf_backend.compat lists them) is its one line. `import hf_backend.big_modeling` is Python's
    ModuleNotFoundError: answering that form too would take an import hook on the whole process."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("__"):
        from .refused import REFUSED_NAMES, refuse

        if name in REFUSED_NAMES:
            raise refuse(__name__, name)
    raise AttributeError(f"module 'hf_backend' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [  # the same names as _WHERE, spelled out for tools that read __all__ statically
    "Accelerator",
    "DDPCommunicationHookType",
    "LocalSGD",
    "PartialState",
    "ProfileKwargs",
    "debug_launcher",
    "find_executable_batch_size",
    "is_rich_available",
    "notebook_launcher",
    "skip_first_batches",
    "synchronize_rng_states",
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
    "ParallelismConfig",
    "ProjectConfiguration",
    "TorchTensorParallelConfig",
    "Trainer",
    "TrainingArguments",
    "add_process_group_plugin",
    "on_engine",
]
