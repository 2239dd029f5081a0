"""`get_logger(name)`: a standard logger that knows about processes, as Accelerate's
`accelerate.logging`.

Each call takes `main_process_only=` (default True: only the main process emits it) and `in_order=`
(every process emits it, one process after the other, rank 0 first; collective, so call it on every
process).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ..core.errors import HfBackendError
from ..core.rank import is_main_process
from . import process as state


def _process() -> state.ProcessState | None:
    # the state Accelerator() / PartialState() set up; None before either exists
    return state._STATE


class MultiProcessAdapter(logging.LoggerAdapter):
    """A LoggerAdapter whose calls accept `main_process_only` and `in_order`."""

    # Accelerate's signature: two keywords of its own before logging's (which pass through **kwargs)
    def log(self, level: int, msg: Any, *args: Any, main_process_only: bool = True,  # type: ignore[override]
            in_order: bool = False, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        process = _process()
        if in_order:
            if process is None:
                raise HfBackendError("logging with in_order=True needs the processes set up: build "
                                     "Accelerator() or PartialState() first")
            for rank in range(process.num_processes):
                if rank == process.process_index:
                    self._emit(level, msg, args, kwargs)
                process.wait_for_everyone()
            return
        is_main = process.is_main_process if process is not None else is_main_process()
        if is_main or not main_process_only:
            self._emit(level, msg, args, kwargs)

    def _emit(self, level: int, msg: Any, args: tuple, kwargs: dict) -> None:
        msg, kwargs = self.process(msg, kwargs)
        kwargs.setdefault("stacklevel", 3)
        self.logger.log(level, msg, *args, **kwargs)

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        process = _process()
        if process is not None and process.num_processes > 1:
            msg = f"[RANK {process.process_index}] {msg}"
        return msg, kwargs

    @functools.lru_cache(None)  # noqa: B019 - one entry per distinct message, as warnings.warn does
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning`, once per distinct message."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger `name`, wrapped so calls take `main_process_only` / `in_order`. `log_level` (or the
    environment's ACCELERATE_LOG_LEVEL) sets its level."""
    level = log_level or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
