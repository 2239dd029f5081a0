"""hf_backend: a training backend for Hugging Face Transformers.

`from hf_backend import Accelerator` is the engine; it imports without transformers. Every public
name is imported on first use, so the command line (`hf-backend config`, `--version`) starts without
importing torch, and `Trainer` / `TrainingArguments` (transformers' classes on the engine) only
import transformers when asked for.

The public names are the imports under `if TYPE_CHECKING:` below, the one list: type checkers read
them there, and at run time `_WHERE` is read from the same lines (each name, the module it is
imported from on first use).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # the public names (redundant aliases: explicit re-exports)
    from .accelerator.facade import Accelerator as Accelerator
    from .accelerator.states import PartialState as PartialState
    from .config.options import AutocastKwargs as AutocastKwargs
    from .config.options import DataLoaderConfiguration as DataLoaderConfiguration
    from .config.options import DistributedDataParallelKwargs as DistributedDataParallelKwargs
    from .config.options import GradientAccumulationPlugin as GradientAccumulationPlugin
    from .config.options import GradScalerKwargs as GradScalerKwargs
    from .config.options import InitProcessGroupKwargs as InitProcessGroupKwargs
    from .config.options import ProfileKwargs as ProfileKwargs
    from .config.options import ProjectConfiguration as ProjectConfiguration
    from .config.plugins import DeepSpeedPlugin as DeepSpeedPlugin
    from .config.plugins import FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin
    from .core.availability import is_rich_available as is_rich_available
    from .core.enums import DDPCommunicationHookType as DDPCommunicationHookType
    from .core.enums import DistributedType as DistributedType
    from .core.errors import HfBackendError as HfBackendError
    from .data.loader import skip_first_batches as skip_first_batches
    from .launch.notebook import debug_launcher as debug_launcher
    from .launch.notebook import notebook_launcher as notebook_launcher
    from .parallel.config import ParallelismConfig as ParallelismConfig
    from .parallel.config import TorchTensorParallelConfig as TorchTensorParallelConfig
    from .runtime.process import add_process_group_plugin as add_process_group_plugin
    from .runtime.seeding import synchronize_rng_states as synchronize_rng_states
    from .trainer import Trainer as Trainer
    from .trainer import TrainingArguments as TrainingArguments
    from .trainer import on_engine as on_engine
    from .training.chunked_loss import chunked_loss as chunked_loss
    from .training.local_sgd import LocalSGD as LocalSGD
    from .training.memory import find_executable_batch_size as find_executable_batch_size


def _public_names() -> dict[str, str]:
    """Each public name and its module (".accelerator"), from this file's `if TYPE_CHECKING:` imports.
    """
    tree = ast.parse(Path(__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return {alias.asname or alias.name: "." * node.level + (node.module or "")
            for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}


_WHERE = _public_names()
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    """A public name, imported on first use; an Accelerate name hf_backend refuses
    (`init_empty_weights`, the module `big_modeling`, ...: hf_backend.compat lists them) is its one
    line. `import hf_backend.big_modeling` is Python's
    ModuleNotFoundError: answering that form too would take an import hook on the whole process."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("__"):
        from .core.refused import REFUSED_NAMES, refuse

        if name in REFUSED_NAMES:
            raise refuse(__name__, name)
    raise AttributeError(f"module 'hf_backend' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
