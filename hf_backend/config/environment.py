"""The environment variables through which a launcher hands settings to `Accelerator()` in each process."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import HfBackendError
from ..log import warn

PREFIX = "HF_BACKEND_"
MIXED_PRECISION = PREFIX + "MIXED_PRECISION"
GRADIENT_ACCUMULATION_STEPS = PREFIX + "GRADIENT_ACCUMULATION_STEPS"
USE_CPU = PREFIX + "USE_CPU"


def launcher_setting(name: str) -> str | None:
    """The value a launcher set for `name`, or None; empty strings count as unset."""
    value = os.environ.get(name, "")
    return value or None


def resolve(name: str, explicit: Any, env_name: str, parse: Callable[[str], Any], default: Any) -> Any:
    """An explicit argument wins over what a launcher put in the environment, with a warning when they differ."""
    raw = launcher_setting(env_name)
    from_env = None
    if raw is not None:
        try:
            from_env = parse(raw)
        except ValueError:
            raise HfBackendError(f"environment variable {env_name}={raw!r} is not valid for {name}") from None
    if explicit is None:
        return default if from_env is None else from_env
    if from_env is not None and from_env != explicit:
        warn(f"{name}={explicit!r} given to Accelerator() overrides the launcher's {env_name}={raw}")
    return explicit


def parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise ValueError(raw)
