"""The facade users hold, `Accelerator` (facade.py), and its members: saving (saving.py), experiment tracking
(tracking.py, trackers.py), restarts (elastic.py), Accelerate's forwarding and refused members (compat.py)."""

from .facade import Accelerator

__all__ = ["Accelerator"]
