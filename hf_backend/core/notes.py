"""hf_backend's one-line notes and warnings, printed by the main process only (N ranks would repeat
them N times)."""

from __future__ import annotations

import logging

from .rank import is_main_process

logger = logging.getLogger("hf_backend")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("hf_backend: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

_said: set[str] = set()


def note(message: str) -> None:
    """An informational one-liner, once per process."""
    if message not in _said and is_main_process():
        _said.add(message)
        logger.info(message)


def warn(message: str) -> None:
    if message not in _said and is_main_process():
        _said.add(message)
        logger.warning(message)
