"""The helpers Accelerate scripts import from `accelerate.utils`, under the same names."""

from __future__ import annotations

import random

import numpy as np
import torch

from .collectives import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
)
from .optim import DummyOptim, DummyScheduler
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


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices); `device_specific` adds the process index to the seed."""
    if device_specific:
        from .state import get_process_state

        seed += get_process_state().process_index
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


__all__ = [
    "AutocastKwargs", "DataLoaderConfiguration", "DistributedDataParallelKwargs", "DistributedType", "DummyOptim",
    "DummyScheduler",
    "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs", "ProjectConfiguration", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "pad_across_processes", "recursively_apply", "reduce",
    "send_to_device", "set_seed",
]
