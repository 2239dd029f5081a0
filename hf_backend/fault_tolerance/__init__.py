"""Replica groups on torchft (off unless asked for): docs/fault_tolerance.md. settings.py holds the settings,
groups.py what both modes share, every_step.py and periodic.py the two modes (the connector picks one)."""

from __future__ import annotations

from .every_step import EveryStep
from .groups import ReplicaGroups
from .periodic import Periodic
from .settings import FaultTolerance, resolve, serve_lighthouse

__all__ = ["EveryStep", "FaultTolerance", "Periodic", "ReplicaGroups", "resolve", "serve_lighthouse"]
