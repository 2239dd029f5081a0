"""Type and range checks for public arguments, each applied once, where the argument enters (an option object's
constructor, `Accelerator(...)`, a method's first line), so a bad value is one line naming it and the fix rather
than a traceback or a silently wrong run."""

from __future__ import annotations

import numbers
import os
from typing import Any

from .errors import HfBackendError


def show(value: Any) -> str:
    """A bounded repr: a huge value never floods a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def flag(value: Any, name: str, optional: bool = False) -> bool | None:
    """True or False (or None when `optional`); strings such as "no" are truthy, so they are refused."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise HfBackendError(f"{name}={show(value)} must be True or False")
    return value


def whole(value: Any, name: str, minimum: int = 0, maximum: int | None = None, optional: bool = False,
          fix: str = "") -> int | None:
    """An integer in [minimum, maximum] (or None when `optional`); bools and floats such as 2.5 are refused."""
    if value is None and optional:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum
            or (maximum is not None and value > maximum)):
        raise HfBackendError(f"{name}={show(value)} must be an integer{_range(minimum, maximum)}{fix}")
    return int(value)


def number(value: Any, name: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (positive and not value > 0):
        raise HfBackendError(f"{name}={show(value)} must be a{' positive' if positive else ''} number")
    return float(value)


def path(value: Any, name: str, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise HfBackendError(f"{name}={show(value)} must be a path (str or os.PathLike)")
    return os.fspath(value)


def _range(minimum: int, maximum: int | None) -> str:
    return f" >= {minimum}" if maximum is None else f" from {minimum} to {maximum}"
