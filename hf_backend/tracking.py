"""Experiment tracking with Accelerate's API: `Accelerator(log_with=..., project_dir=...)`, `init_trackers`, `log`,
`get_tracker`, `end_training`.

`Tracking` checks `log_with` when the Accelerator is built (an unknown name, a missing package or a missing logging
directory fails before training starts, not at the first `log`) and builds the trackers in `init_trackers`. Trackers
with `main_process_only` (all built-in ones) run on the main process only; elsewhere `log` does nothing and
`get_tracker` answers a tracker whose every call does nothing, so a script calls them on every process.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import checks, rank
from .enums import LoggerType
from .errors import HfBackendError
from .log import note, warn


def on_main_process(function: Callable) -> Callable:
    """Decorate a custom tracker's method: it runs only on the main process when the tracker has `main_process_only`."""

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not rank.is_main_process():
            return None
        return function(self, *args, **kwargs)

    return wrapper


def _plain(value: Any) -> Any:
    """Tensors and numpy values -> Python numbers (nested lists when not scalars), inside dicts and lists too."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if type(value).__module__.split(".")[0] in ("torch", "numpy") and hasattr(value, "tolist"):
        return value.tolist()
    return value


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float))


def _numbers(values: dict, tracker: str) -> dict:
    """The numeric values (what most libraries take as metrics); a warning names each one left out."""
    kept = {}
    for key, value in _plain(values).items():
        if _numeric(value):
            kept[key] = value
        else:
            warn(f"{tracker}: {key!r} is a {type(value).__name__}, not a number; it is not logged")
    return kept


class GeneralTracker:
    """Base class of every tracker; subclass it for a custom one.

    A subclass sets the class attributes `name` and `requires_logging_directory`, defines the `tracker` property (the
    library's object), `store_init_configuration` and `log`, and optionally `start` (called by `init_trackers`) and
    `finish` (called by `end_training`). Its instance goes in `Accelerator(log_with=...)`.
    """

    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [attr for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if type(self).tracker is GeneralTracker.tracker:
            missing.append("tracker")
        if missing:
            raise HfBackendError(f"{type(self).__name__} must define {', '.join(missing)} (see GeneralTracker)")

    @property
    def tracker(self) -> Any:
        """The library's object (wandb's run, TensorBoard's SummaryWriter, ...)."""
        return None

    def start(self) -> None:
        """Create the run; `init_trackers` calls it on the processes that use this tracker."""

    def store_init_configuration(self, values: dict) -> None:
        """Record `values` as the run's hyperparameters."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Record `values` (name -> number, string, ...) at `step`."""

    def finish(self) -> None:
        """Close the run."""


class _NoOpTracker(GeneralTracker):
    """What `get_tracker` answers where the tracker does not run (other processes): every call does nothing."""

    requires_logging_directory = False

    def __init__(self, name: str) -> None:
        super().__init__(_blank=True)
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: None


class _LibraryTracker(GeneralTracker):
    """A built-in tracker: `start` imports `module` and opens the run (`init(project=run_name, **init_kwargs)` unless
    `_open` says otherwise); `tracker` is the run. `pip` is the package to install for `module`."""

    requires_logging_directory = False
    module: str | None = None
    pip: str | None = None

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.init_kwargs, self.run = run_name, kwargs, None

    @property
    def tracker(self) -> Any:
        return self.run

    def start(self) -> None:
        self.lib = importlib.import_module(self.module) if self.module else None
        self.run = self._open(self.lib)

    def _open(self, lib: Any) -> Any:
        return lib.init(project=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(_plain(values))

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class JSONLTracker(_LibraryTracker):
    """hf_backend's own file tracker, no package needed: `logging_dir/<run_name>/metrics.jsonl` gets one line per
    `log` call, `{"step": ..., "time": ..., "values": {...}}` (tensors and numpy values as numbers), and `config.json`
    the configuration. `tracker` is the metrics file's path (pandas: `read_json(path, lines=True)`)."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        if kwargs:
            raise HfBackendError(f"the jsonl tracker takes no init_kwargs; got {', '.join(sorted(kwargs))}")
        super().__init__(run_name)
        self.logging_dir = Path(logging_dir) / run_name
        self.run = self.logging_dir / "metrics.jsonl"
        self._file: Any = None

    def start(self) -> None:
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.run.open("a", encoding="utf-8")  # append: a resumed run continues its file

    def store_init_configuration(self, values: dict) -> None:
        text = json.dumps(_plain(values), indent=2, default=str)
        (self.logging_dir / "config.json").write_text(text + "\n", encoding="utf-8")

    def log(self, values: dict, step: int | None = None) -> None:
        record = {"step": step, "time": round(time.time(), 3), "values": _plain(values)}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()  # a crash loses no line logged before it

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker(_LibraryTracker):
    """torch's SummaryWriter in `logging_dir/<run_name>` (init_kwargs go to it); the configuration as hparams in its
    `hparams` sub-run. Numbers are scalars, strings text, dicts of numbers `add_scalars`."""

    name = module = pip = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.logging_dir = os.path.join(logging_dir, run_name)

    @property
    def writer(self) -> Any:  # Accelerate's attribute name
        return self.run

    def _open(self, lib: Any) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(self.logging_dir, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        hparams = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in _plain(values).items()}
        self.run.add_hparams(hparams, metric_dict={}, run_name="hparams")

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for key, value in _plain(values).items():
            if _numeric(value):
                self.run.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.run.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict) and all(_numeric(v) for v in value.values()):
                self.run.add_scalars(key, value, global_step=step, **kwargs)
            else:
                warn(f"tensorboard: {key!r} is a {type(value).__name__}, not a number, string or dict of numbers; "
                     "it is not logged")
        self.run.flush()

    def finish(self) -> None:
        self.run.close()


@functools.cache
def _builtin() -> dict[str, type[_LibraryTracker]]:
    from .tracking_integrations import (
        AimTracker,
        ClearMLTracker,
        CometMLTracker,
        DVCLiveTracker,
        MLflowTracker,
        SwanLabTracker,
        TrackioTracker,
        WandBTracker,
    )

    return {cls.name: cls for cls in (JSONLTracker, TensorBoardTracker, WandBTracker, TrackioTracker, CometMLTracker,
                                      MLflowTracker, ClearMLTracker, DVCLiveTracker, SwanLabTracker, AimTracker)}


def _installed(name: str) -> bool:
    module = _builtin()[name].module
    return module is None or importlib.util.find_spec(module) is not None


def get_available_trackers() -> list[LoggerType]:
    """The built-in trackers whose package is installed: what `log_with="all"` uses."""
    return [LoggerType(name) for name in _builtin() if _installed(name)]


class Tracking:
    """The trackers of one Accelerator: `log_with` checked at construction, the trackers built in `init_trackers`."""

    def __init__(self, log_with: Any, logging_dir: str | os.PathLike | None, is_main_process: bool) -> None:
        self.logging_dir = None if logging_dir is None else str(logging_dir)
        self.is_main_process = is_main_process
        # a user's instance, or a class that init_trackers builds
        self._specs: list[GeneralTracker | type[GeneralTracker]] = self._resolve(log_with)
        self._trackers: list[GeneralTracker] = []
        self._started = False

    def _resolve(self, log_with: Any) -> list[GeneralTracker | type[GeneralTracker]]:
        items = list(log_with) if isinstance(log_with, (list, tuple)) else [] if log_with is None else [log_with]
        instances: list[GeneralTracker | type[GeneralTracker]] = []
        names: list[str] = []
        for item in items:
            if isinstance(item, (str, LoggerType)):
                names.append(str(item).lower())
            elif not isinstance(item, GeneralTracker):
                hint = f"; pass an instance, {item.__name__}(...)" if isinstance(item, type) else ""
                raise HfBackendError(f"log_with={item!r} is not a tracker name or a GeneralTracker instance{hint}")
            elif getattr(item, "name", None) and hasattr(item, "requires_logging_directory"):
                instances.append(item)
            else:
                raise HfBackendError(f"{type(item).__name__} must define name and requires_logging_directory")
        asked = set(names)
        if "all" in names:
            names = [n for n in names if n != "all"] + [str(t) for t in get_available_trackers()]
        return instances + [self._class_for(name, name in asked) for name in dict.fromkeys(names)]

    def _class_for(self, name: str, asked: bool) -> type[GeneralTracker]:
        if name not in _builtin():
            raise HfBackendError(f"log_with={name!r} is not a tracker; use one of {', '.join(LoggerType.list())}, "
                                 "or a GeneralTracker instance")
        cls = _builtin()[name]
        if not _installed(name):
            raise HfBackendError(f"log_with={name!r} needs the {cls.module} package, which is not installed: "
                                 f"pip install {cls.pip}")
        if cls.requires_logging_directory and self.logging_dir is None:
            raise HfBackendError(f"log_with={name if asked else 'all'!r}: the {name} tracker writes files and no "
                                 "logging directory was given; pass Accelerator(project_dir=...) (or "
                                 "ProjectConfiguration(logging_dir=...))")
        return cls

    @property
    def names(self) -> list[str]:
        """The names of the trackers `log_with` asked for (the same on every process)."""
        return [spec.name for spec in self._specs]

    @property
    def log_with(self) -> list[LoggerType | GeneralTracker]:
        """Accelerate's `accelerator.log_with`: the trackers asked for, "all" expanded, names as LoggerType."""
        return [spec if isinstance(spec, GeneralTracker) else LoggerType(spec.name) for spec in self._specs]

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers running on this process (main-process-only ones run on the main process alone)."""
        return list(self._trackers)

    def _by_tracker(self, kwargs: dict | None, argument: str) -> dict:
        """A key that names no tracker at all is an error; the name of a tracker not in use is ignored (a script may
        carry wandb's kwargs and run where "all" does not include wandb)."""
        kwargs = {str(k): v for k, v in (kwargs or {}).items()}
        unknown = sorted(set(kwargs) - {*_builtin(), *self.names})
        if unknown:
            raise HfBackendError(f"{argument} has {', '.join(unknown)}, which is not a tracker; its keys are tracker "
                                 f"names ({', '.join(self.names) or 'log_with is None'})")
        return kwargs

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Build and start the trackers (`project_name` names each one's run or project) and store `config`."""
        if self._started:
            raise HfBackendError("init_trackers was already called; call end_training() before starting another run")
        if not isinstance(project_name, str) or not project_name:
            raise HfBackendError(f"init_trackers(project_name={checks.show(project_name)}): give the run a name (a "
                                 "non-empty string)")
        if config is not None and not isinstance(config, Mapping):
            raise HfBackendError(f"init_trackers(config={checks.show(config)}): pass a dict of hyperparameters")
        init_kwargs = self._by_tracker(init_kwargs, "init_kwargs")
        trackers: list[GeneralTracker] = []
        for spec in self._specs:
            if spec.main_process_only and not self.is_main_process:
                continue
            if isinstance(spec, GeneralTracker):
                trackers.append(spec)
            elif spec.requires_logging_directory:
                trackers.append(spec(project_name, self.logging_dir, **init_kwargs.get(spec.name, {})))
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
                note("accelerator.log(...) logs nothing: no tracker was asked for (Accelerator(log_with=...))")
                return
            raise HfBackendError("accelerator.log() before accelerator.init_trackers(project_name): call "
                                 "init_trackers first (after end_training(), again)")
        log_kwargs = self._by_tracker(log_kwargs, "log_kwargs")
        for tracker in self._trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called `name` (its library object with `unwrap`); a no-op tracker where it does not run."""
        name = str(name)
        if name not in self.names:
            raise HfBackendError(f"get_tracker({name!r}): no such tracker in use; log_with has "
                                 f"{', '.join(self.names) or 'none'}")
        if not self._started:
            raise HfBackendError(f"get_tracker({name!r}) before init_trackers(project_name): call init_trackers first")
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
