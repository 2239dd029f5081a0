"""Which process this is, before (or without) the process state: the one answer the rest of hf_backend
asks.

Once `Accelerator()` / `PartialState()` has set up the process state, `ProcessState` (state.py)
holds the answer; this module answers the same way without it: the default process group's rank and
size when one is set up (by anyone: the engine, Ray, the user), else torchrun's `RANK` /
`WORLD_SIZE`, else a single process. It never imports torch itself, so the command line and the
one-line notes stay light.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType


def _group() -> ModuleType | None:
    # nothing to ask when torch.distributed was never imported
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def process_index() -> int:
    dist = _group()
    return dist.get_rank() if dist is not None else int(os.environ.get("RANK", "0") or 0)


def num_processes() -> int:
    dist = _group()
    return dist.get_world_size() if dist is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)


def group_size() -> int:
    """The processes a collective spans: the default group's (1 when there is none, whatever torchrun's
    environment
    says: there is nothing to communicate with)."""
    dist = _group()
    return dist.get_world_size() if dist is not None else 1


def is_main_process() -> bool:
    return process_index() == 0
