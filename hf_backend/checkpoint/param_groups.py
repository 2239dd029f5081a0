"""A full optimizer state, and its scheduler's, fitted to the param groups of the optimizer they are
loaded into.

DeepSpeed drops a param group that has no parameters; torch keeps it. transformers' Trainer makes
such a group for a LoRA model (its no-decay group: an adapter has no biases or norms), so the same
run has two param groups under one process, DDP and FSDP and one under ZeRO. The non-empty groups
keep their order, so they correspond one to one; a group with no parameters takes its
hyperparameters, and its scheduler entries, from the optimizer and scheduler it is loaded into (its
learning rate moves nothing).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ..core.errors import HfBackendError

# For each param group of the optimizer loaded into: the saved group it takes, or None (it has no
# parameters).
GroupMap = list[int | None]


def group_map(saved: list[int], current: list[int], path: Path) -> GroupMap | None:
    """`saved`, `current`: the number of parameters in each param group. None when the groups
    correspond as they are; else the saved group of each current one (None for an empty one)."""
    if len(saved) == len(current):
        return None
    full_saved = [j for j, count in enumerate(saved) if count]
    if len(full_saved) != sum(1 for count in current if count):
        raise HfBackendError(f"{path}: its optimizer has param groups of "
                             f"{saved} parameters, this one {current}; resume "
                             "with the optimizer set up as when it was saved")
    taken = iter(full_saved)
    return [next(taken) if count else None for count in current]


def fit_optimizer_state(state_dict: dict[str, Any], mapping: GroupMap,
                        current_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter names with its param groups in the order of `mapping`.
    """
    saved = state_dict["param_groups"]
    groups = [copy.copy(saved[j]) if j is not None else
              {**{k: v for k, v in current_groups[i].items() if k != "params"}, "params": []}
              for i, j in enumerate(mapping)]
    return {**state_dict, "param_groups": groups}


def fit_scheduler_state(state: dict[str, Any], mapping: GroupMap, current: dict[str, Any]) -> dict[str, Any]:
    """A scheduler's state whose per-group lists (`base_lrs`, `_last_lr`, `lr_lambdas`, ...) follow
    `mapping`;
    `current`: the state of the scheduler loaded into, which gives an empty group's entries."""
    fitted = dict(state)
    for key, values in state.items():
        now = current.get(key)
        if isinstance(values, list) and isinstance(now, list) and len(now) == len(mapping) != len(values):
            fitted[key] = [copy.deepcopy(values[j]) if j is not None else now[i] for i, j in enumerate(mapping)]
    return fitted
