"""hf_backend: a training backend for Hugging Face Transformers.

`from hf_backend import Accelerator` is the engine; it imports without transformers. Every public name is imported on
first use, so the command line (`hf-backend config`, `--version`) starts without importing torch, and `Trainer` /
`TrainingArguments` (transformers' classes on the engine) only import transformers when asked for.
"""

from __future__ import annotations

import importlib
import sys
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
    "on_engine": ".trainer",
}

if TYPE_CHECKING:
    from .accelerator import Accelerator
    from .availability import is_rich_available
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
    from .state import DistributedType, PartialState
    from .trainer import Trainer, TrainingArguments, on_engine


# Accelerate's top-level names and modules that hf_backend refuses (hf_backend.compat says why, in one line).
_REFUSED = ("ParallelismConfig", "cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model",
            "infer_auto_device_map", "init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch",
            "load_checkpoint_in_model", "prepare_pippy", "big_modeling", "checkpointing", "commands", "data_loader",
            "hooks", "inference", "optimizer", "parallelism_config", "scheduler", "test_utils")


class _RefusedModules:
    """`import hf_backend.big_modeling` (a module of Accelerate's that hf_backend refuses) fails with its one line,
    not with ModuleNotFoundError; consulted only after every other finder found nothing."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> None:
        package, _, name = fullname.partition(".")
        if package == __name__ and name.split(".")[0] in _REFUSED:
            from .compat import refuse

            raise refuse(__name__, name.split(".")[0])


sys.meta_path.append(_RefusedModules)


def __getattr__(name: str) -> Any:
    if name in _REFUSED:
        from .compat import refuse

        raise refuse(__name__, name)
    if name not in _WHERE:
        raise AttributeError(f"module 'hf_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


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
    "ProjectConfiguration",
    "Trainer",
    "TrainingArguments",
    "on_engine",
]
