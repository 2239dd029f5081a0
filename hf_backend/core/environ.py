"""Environment variables set for the length of a block: the one helper behind Accelerate's
`patch_environment` / `clear_environment` (utils.py) and the notebook launcher's worker settings."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def patched(values: Mapping[str, str | None], restore_all: bool = False) -> Iterator[None]:
    """Set (None: unset) `values` in os.environ, and put back afterwards what was there: those names, or every
    variable with `restore_all` (what runs inside may set some of its own, as torch elastic's agent does)."""
    before = dict(os.environ)
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key in (set(os.environ) | set(before)) if restore_all else set(values):
            if key not in before:
                os.environ.pop(key, None)
            elif os.environ.get(key) != before[key]:
                os.environ[key] = before[key]
