"""Type and range checks for public arguments, each applied once, where the argument enters (an option
object's constructor, `Accelerator(...)`, a method's first line), so a bad value is one line naming
it and the fix rather than a traceback or a silently wrong run."""

from __future__ import annotations

import math
import numbers
import os
import reprlib
from typing import Any

from .errors import HfBackendError


class _BoundedRepr(reprlib.Repr):
    """repr() that looks at a bounded part of a value: the first items of a container, 2 levels deep,
    the start of a string, and the size (not the digits) of a huge integer, so no value makes an
    error message slow or long."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 2, 60, 60
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4

    def repr_str(self, x: str, level: int) -> str:
        return repr(x[:self.maxstring]) + ("..." if len(x) > self.maxstring else "")

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<a {int(x.bit_length() * math.log10(2)) + 1}-digit integer>"
        return repr(x)


_REPR = _BoundedRepr()


def show(value: Any) -> str:
    """A value as an error message quotes it: a bounded repr, at most 60 characters (a huge value never
    makes a message slow or long)."""
    text = _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def flag(value: Any, name: str, optional: bool = False) -> bool | None:
    """True or False (or None when `optional`); strings such as "no" are truthy, so they are refused.
    """
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise HfBackendError(f"{name}={show(value)} must be True or False")
    return value


def whole(value: Any, name: str, minimum: int = 0, maximum: int | None = None, optional: bool = False,
          fix: str = "") -> int | None:
    """An integer in [minimum, maximum] (or None when `optional`); bools and floats such as 2.5 are
    refused."""
    if value is None and optional:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum
            or (maximum is not None and int(value) > maximum)):
        raise HfBackendError(f"{name}={show(value)} must be an "
                             f"integer{_range(minimum, maximum)}{fix}")
    return int(value)


def number(value: Any, name: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (positive and not float(value) > 0):
        raise HfBackendError(f"{name}={show(value)} must be "
                             f"a{' positive' if positive else ''} number")
    return float(value)


def path(value: Any, name: str, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise HfBackendError(f"{name}={show(value)} must be a path (str or os.PathLike)")
    return os.fspath(value)


def _range(minimum: int, maximum: int | None) -> str:
    return f" >= {minimum}" if maximum is None else f" from {minimum} to {maximum}"
