"""Replica groups on torchft (off unless asked for): docs/fault_tolerance.md."""

from .groups import FaultTolerance, ReplicaGroups, resolve, serve_lighthouse

__all__ = ["FaultTolerance", "ReplicaGroups", "resolve", "serve_lighthouse"]
