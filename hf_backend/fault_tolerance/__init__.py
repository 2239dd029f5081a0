"""Replica groups on torchft (off unless asked for): docs/fault_tolerance.md. settings.py holds the settings,
groups.py what both modes share, every_step.py and periodic.py the two modes; `join` builds this process's."""

from __future__ import annotations

from ..parallel.dims import DataShard
from ..runtime.process import ProcessState
from ..training.gradient_state import GradientState
from ..training.prepared import PreparedObjects
from .every_step import EveryStep
from .groups import ReplicaGroups
from .periodic import Periodic
from .settings import FaultTolerance, resolve, serve_lighthouse


def join(config: FaultTolerance, process: ProcessState, objects: PreparedObjects, gradient_state: GradientState,
         shard: DataShard, first_start: bool) -> ReplicaGroups:
    """This process's replica groups: meeting every step, or every `config.sync_every` steps."""
    mode = EveryStep if config.sync_every == 1 else Periodic
    return mode(config, process, objects, gradient_state, shard, first_start)


__all__ = ["EveryStep", "FaultTolerance", "Periodic", "ReplicaGroups", "join", "resolve", "serve_lighthouse"]
