"""Seeding and random-state synchronization across processes (Accelerate's `set_seed`,
`synchronize_rng_states`)."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from ..core.errors import HfBackendError
from .collectives import broadcast_object_list, world_size


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices); `device_specific` adds the process index to the
    seed."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise HfBackendError("set_seed: seed must be an integer, "
                             f"got {type(seed).__name__} {seed!r}")
    seed = int(seed)
    if device_specific:
        from .process import get_process_state

        seed += get_process_state().process_index
    if not 0 <= seed < 2**32:  # numpy's range
        raise HfBackendError(f"set_seed: seed={seed} must be from 0 to 2**32 - 1")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(rng_type: str | None = None, generator: torch.Generator | None = None) -> None:
    """Give every process rank 0's state of one generator: "torch" (the CPU default), "cuda" (this
    process's device), or "generator" (the one passed)."""
    rng_type = str(getattr(rng_type, "value", rng_type) or "torch")
    get: Callable[[], torch.Tensor]
    put: Callable[[torch.Tensor], object]
    if rng_type == "torch":
        get, put = torch.get_rng_state, torch.set_rng_state
    elif rng_type == "cuda":
        if not torch.cuda.is_available():
            return
        get, put = torch.cuda.get_rng_state, torch.cuda.set_rng_state
    elif rng_type == "generator":
        if generator is None:
            raise HfBackendError("synchronize_rng_state('generator') needs generator=<the "
                                 "torch.Generator to share>")
        get, put = generator.get_state, generator.set_state
    else:
        raise HfBackendError(f"synchronize_rng_state: rng type {rng_type!r} "
                             "is not one of torch, cuda, generator")
    if world_size() > 1:
        put(broadcast_object_list([get()])[0])


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)
