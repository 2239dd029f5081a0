"""The environment variables through which a launcher hands settings to `Accelerator()` in each process."""

from __future__ import annotations

import os

PREFIX = "HF_BACKEND_"
MIXED_PRECISION = PREFIX + "MIXED_PRECISION"
GRADIENT_ACCUMULATION_STEPS = PREFIX + "GRADIENT_ACCUMULATION_STEPS"
USE_CPU = PREFIX + "USE_CPU"


def launcher_setting(name: str) -> str | None:
    """The value a launcher set for `name`, or None; empty strings count as unset."""
    value = os.environ.get(name, "")
    return value or None
