"""hf_backend: a training backend for Hugging Face Transformers.

`from hf_backend import Accelerator` is the engine; it imports without transformers.
"""

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
]
