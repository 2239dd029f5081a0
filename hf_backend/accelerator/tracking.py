"""Experiment tracking with Accelerate's API: `Accelerator(log_with=..., project_dir=...)`,
`init_trackers`, `log`, `get_tracker`, `end_training`.

`Tracking` checks `log_with` when the Accelerator is built (an unknown name, a missing package or a
missing logging directory fails before training starts, not at the first `log`) and builds the
trackers in `init_trackers`. Trackers with `main_process_only` (all built-in ones) run on the main
process only; elsewhere `log` does nothing and `get_tracker` answers a tracker whose every call does
nothing, so a script calls them on every process. The trackers themselves are in
hf_backend/accelerator/trackers.py; this module also offers them under Accelerate's path
(`accelerate.tracking`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from ..core import checks
from ..core.enums import LoggerType
from ..core.errors import HfBackendError
from ..core.notes import note
from .trackers import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    GeneralTracker,
    JSONLTracker,
    MLflowTracker,
    SwanLabTracker,
    TensorBoardTracker,
    TrackioTracker,
    WandBTracker,
    _LibraryTracker,
    _NoOpTracker,
    on_main_process,
)


@functools.cache
def _builtin() -> dict[str, type[_LibraryTracker]]:
    return {cls.name: cls for cls in (JSONLTracker, TensorBoardTracker, WandBTracker, TrackioTracker, CometMLTracker,
                                      MLflowTracker, ClearMLTracker, DVCLiveTracker, SwanLabTracker, AimTracker)}


def _installed(name: str) -> bool:
    module = _builtin()[name].module
    return module is None or importlib.util.find_spec(module) is not None


def get_available_trackers() -> list[LoggerType]:
    """The built-in trackers whose package is installed: what `log_with="all"` uses."""
    return [LoggerType(name) for name in _builtin() if _installed(name)]


class Tracking:
    """The trackers of one Accelerator: `log_with` checked at construction, the trackers built in
    `init_trackers`."""

    def __init__(self, log_with: Any, logging_dir: str | os.PathLike | None, is_main_process: bool) -> None:
        self.logging_dir = None if logging_dir is None else str(logging_dir)
        self.is_main_process = is_main_process
        # a user's instance, or a class that init_trackers builds
        self._specs: list[GeneralTracker | type[_LibraryTracker]] = self._resolve(log_with)
        self._trackers: list[GeneralTracker] = []
        self._started = False

    def _resolve(self, log_with: Any) -> list[GeneralTracker | type[_LibraryTracker]]:
        items = list(log_with) if isinstance(log_with, (list, tuple)) else [] if log_with is None else [log_with]
        instances: list[GeneralTracker | type[_LibraryTracker]] = []
        names: list[str] = []
        for item in items:
            if isinstance(item, (str, LoggerType)):
                names.append(str(item).lower())
            elif not isinstance(item, GeneralTracker):
                hint = f"; pass an instance, {item.__name__}(...)" if isinstance(item, type) else ""
                raise HfBackendError(f"log_with={item!r} is not a tracker name "
                                     f"or a GeneralTracker instance{hint}")
            elif getattr(item, "name", None) and hasattr(item, "requires_logging_directory"):
                instances.append(item)
            else:
                raise HfBackendError(f"{type(item).__name__} must define name and "
                                     "requires_logging_directory")
        asked = set(names)
        if "all" in names:
            names = [n for n in names if n != "all"] + [str(t) for t in get_available_trackers()]
        return instances + [self._class_for(name, name in asked) for name in dict.fromkeys(names)]

    def _class_for(self, name: str, asked: bool) -> type[_LibraryTracker]:
        if name not in _builtin():
            raise HfBackendError(f"log_with={name!r} is not a tracker; use one of "
                                 f"{', '.join(LoggerType.list())}, or a GeneralTracker instance")
        cls = _builtin()[name]
        if not _installed(name):
            raise HfBackendError(f"log_with={name!r} needs the {cls.module} package, which is not "
                                 f"installed: pip install {cls.pip}")
        if cls.requires_logging_directory and self.logging_dir is None:
            raise HfBackendError(f"log_with={name if asked else 'all'!r}: the {name} tracker "
                                 "writes files and no logging directory was given; pass "
                                 "Accelerator(project_dir=...) (or "
                                 "ProjectConfiguration(logging_dir=...))")
        return cls

    @property
    def names(self) -> list[str]:
        """The names of the trackers `log_with` asked for (the same on every process)."""
        return [spec.name for spec in self._specs]

    @property
    def log_with(self) -> list[LoggerType | GeneralTracker]:
        """Accelerate's `accelerator.log_with`: the trackers asked for, "all" expanded, names as
        LoggerType."""
        return [spec if isinstance(spec, GeneralTracker) else LoggerType(spec.name) for spec in self._specs]

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers running on this process (main-process-only ones run on the main process alone).
        """
        return list(self._trackers)

    def _by_tracker(self, kwargs: dict | None, argument: str) -> dict:
        """A key that names no tracker at all is an error; the name of a tracker not in use is ignored
        (a script may carry wandb's kwargs and run where "all" does not include wandb)."""
        kwargs = {str(k): v for k, v in (kwargs or {}).items()}
        unknown = sorted(set(kwargs) - {*_builtin(), *self.names})
        if unknown:
            raise HfBackendError(f"{argument} has {', '.join(unknown)}, which is not a tracker; "
                                 "its keys are tracker names "
                                 f"({', '.join(self.names) or 'log_with is None'})")
        return kwargs

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Build and start the trackers (`project_name` names each one's run or project) and store
        `config`."""
        if self._started:
            raise HfBackendError("init_trackers was already called; call end_training() before "
                                 "starting another run")
        if not isinstance(project_name, str) or not project_name:
            raise HfBackendError(f"init_trackers(project_name={checks.show(project_name)}): give "
                                 "the run a name (a non-empty string)")
        if config is not None and not isinstance(config, Mapping):
            raise HfBackendError(f"init_trackers(config={checks.show(config)}): "
                                 "pass a dict of hyperparameters")
        init_kwargs = self._by_tracker(init_kwargs, "init_kwargs")
        trackers: list[GeneralTracker] = []
        for spec in self._specs:
            if spec.main_process_only and not self.is_main_process:
                continue
            if isinstance(spec, GeneralTracker):
                trackers.append(spec)
            elif spec.requires_logging_directory:
                trackers.append(spec(project_name, logging_dir=self.logging_dir, **init_kwargs.get(spec.name, {})))
            else:
                trackers.append(spec(project_name, **init_kwargs.get(spec.name, {})))
        for tracker in trackers:
            tracker.start()
        if config is not None:
            for tracker in trackers:
                tracker.store_init_configuration(config)
        self._trackers, self._started = trackers, True

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log `values` to every tracker running on this process (a no-op on the others)."""
        if not isinstance(values, Mapping):
            raise HfBackendError(f"log(values={checks.show(values)}): pass a dict of names to values, e.g. "
                                 "{'loss': 0.5}")
        checks.whole(step, "log step", optional=True)
        if not self._started:
            if not self._specs:
                note("accelerator.log(...) logs nothing: no tracker was asked for "
                     "(Accelerator(log_with=...))")
                return
            raise HfBackendError("accelerator.log() before "
                                 "accelerator.init_trackers(project_name): call init_trackers "
                                 "first (after end_training(), again)")
        log_kwargs = self._by_tracker(log_kwargs, "log_kwargs")
        for tracker in self._trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called `name` (its library object with `unwrap`); a no-op tracker where it does
        not run."""
        name = str(name)
        if name not in self.names:
            raise HfBackendError(f"get_tracker({name!r}): no such tracker in use; log_with has "
                                 f"{', '.join(self.names) or 'none'}")
        if not self._started:
            raise HfBackendError(f"get_tracker({name!r}) before init_trackers(project_name): call "
                                 "init_trackers first")
        for tracker in self._trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        return _NoOpTracker(name)

    def finish(self) -> None:
        """Finish every running tracker: each is tried, then the first error is raised."""
        trackers, self._trackers, self._started = self._trackers, [], False
        error: Exception | None = None
        for tracker in trackers:
            try:
                tracker.finish()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error


__all__ = ["AimTracker", "ClearMLTracker", "CometMLTracker", "DVCLiveTracker", "GeneralTracker", "JSONLTracker",
           "MLflowTracker", "SwanLabTracker", "TensorBoardTracker", "TrackioTracker", "Tracking", "WandBTracker",
           "get_available_trackers", "on_main_process"]
