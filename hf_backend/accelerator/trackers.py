"""Experiment trackers: Accelerate's `GeneralTracker` and `on_main_process`, the built-in JSONL and
TensorBoard trackers, and those of third-party packages (wandb, trackio, swanlab, comet_ml, aim,
mlflow, clearml, dvclive), each importing its package only when built. `hf_backend.tracking` chooses
and runs them for an Accelerator."""

from __future__ import annotations

import functools
import importlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core import rank
from ..core.errors import HfBackendError
from ..core.notes import warn


def on_main_process(function: Callable) -> Callable:
    """Decorate a custom tracker's method: it runs only on the main process when the tracker has
    `main_process_only`."""

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not rank.is_main_process():
            return None
        return function(self, *args, **kwargs)

    return wrapper


def _plain(value: Any) -> Any:
    """Tensors and numpy values -> Python numbers (nested lists when not scalars), inside dicts and
    lists too."""
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
    """The numeric values (what most libraries take as metrics); a warning names each one left out.
    """
    kept = {}
    for key, value in _plain(values).items():
        if _numeric(value):
            kept[key] = value
        else:
            warn(f"{tracker}: {key!r} is a {type(value).__name__}, not a number; it is not logged")
    return kept


class GeneralTracker:
    """Base class of every tracker; subclass it for a custom one.

    A subclass sets the class attributes `name` and `requires_logging_directory`, defines the
    `tracker` property (the library's object), `store_init_configuration` and `log`, and optionally
    `start` (called by `init_trackers`) and `finish` (called by `end_training`). Its instance goes
    in `Accelerator(log_with=...)`.
    """

    main_process_only = True
    # set by each subclass (declared, not set here: __init__ checks that a custom tracker sets them)
    name: str
    requires_logging_directory: bool

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [attr for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if type(self).tracker is GeneralTracker.tracker:
            missing.append("tracker")
        if missing:
            raise HfBackendError(f"{type(self).__name__} must define "
                                 f"{', '.join(missing)} (see GeneralTracker)")

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
    """What `get_tracker` answers where the tracker does not run (other processes): every call does
    nothing."""

    requires_logging_directory = False

    def __init__(self, name: str) -> None:
        super().__init__(_blank=True)
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: None


class _LibraryTracker(GeneralTracker):
    """A built-in tracker: `start` imports `module` and opens the run (`init(project=run_name,
    **init_kwargs)` unless `_open` says otherwise); `tracker` is the run. `pip` is the package to
    install for `module`."""

    requires_logging_directory = False
    module: str | None = None
    pip: str | None = None

    def __init__(self, run_name: str | None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.init_kwargs = run_name, kwargs
        self.run: Any = None  # the library's run (None before `start`)

    @property
    def tracker(self) -> Any:
        return self.run

    def start(self) -> None:
        self.lib: Any = importlib.import_module(self.module) if self.module else None  # the library's module
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
    """hf_backend's own file tracker, no package needed: `logging_dir/<run_name>/metrics.jsonl` gets
    one line per `log` call, `{"step": ..., "time": ..., "values": {...}}` (tensors and numpy values
    as numbers), and `config.json` the configuration. `tracker` is the metrics file's path (pandas:
    `read_json(path, lines=True)`)."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        if kwargs:
            raise HfBackendError("the jsonl tracker takes no init_kwargs; got "
                                 f"{', '.join(sorted(kwargs))}")
        super().__init__(run_name)
        self.logging_dir = Path(logging_dir) / run_name
        self.run = self.logging_dir / "metrics.jsonl"
        self._file: Any = None

    def start(self) -> None:
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        # append: a resumed run continues its file
        self._file = self.run.open("a", encoding="utf-8")

    def store_init_configuration(self, values: dict) -> None:
        text = json.dumps(_plain(values), indent=2, default=str)
        (self.logging_dir / "config.json").write_text(text + "\n", encoding="utf-8")

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"the jsonl tracker's log takes no keyword arguments; got {', '.join(sorted(kwargs))}")
        record = {"step": step, "time": round(time.time(), 3), "values": _plain(values)}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()  # a crash loses no line logged before it

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker(_LibraryTracker):
    """torch's SummaryWriter in `logging_dir/<run_name>` (init_kwargs go to it); the configuration as
    hparams in its `hparams` sub-run. Numbers are scalars, strings text, dicts of numbers
    `add_scalars`."""

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
                warn(f"tensorboard: {key!r} is a {type(value).__name__}, not a number, string or "
                     "dict of numbers; it is not logged")
        self.run.flush()

    def finish(self) -> None:
        self.run.close()


class WandBTracker(_LibraryTracker):
    """`wandb.init(project=run_name, **init_kwargs)`."""

    name = module = pip = "wandb"

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)


class TrackioTracker(_LibraryTracker):
    """`trackio.init(project=run_name, **init_kwargs)`; the configuration goes with the run's logs.
    """

    name = module = pip = "trackio"


class SwanLabTracker(_LibraryTracker):
    """`swanlab.init(project=run_name, **init_kwargs)`."""

    name = module = pip = "swanlab"

    def store_init_configuration(self, values: dict) -> None:
        self.lib.config.update(values)


class CometMLTracker(_LibraryTracker):
    """`comet_ml.start(project_name=run_name, **init_kwargs)` (`comet_ml.Experiment` before 3.41).
    """

    name = module = "comet_ml"
    pip = "comet-ml"

    def _open(self, lib: Any) -> Any:
        return getattr(lib, "start", lib.Experiment)(project_name=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.run.log_parameters(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.run.set_step(step)
        for key, value in _plain(values).items():
            if _numeric(value):
                self.run.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, dict):
                self.run.log_metrics(value, step=step, **kwargs)
            else:
                self.run.log_other(key, value, **kwargs)

    def finish(self) -> None:
        self.run.end()


class AimTracker(_LibraryTracker):
    """`aim.Run(repo=logging_dir, **init_kwargs)`, named after the run."""

    name = module = pip = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike = ".", **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.aim_repo_path = str(logging_dir)

    def _open(self, lib: Any) -> Any:
        run = lib.Run(repo=self.aim_repo_path, **self.init_kwargs)
        run.name = self.run_name
        return run

    def store_init_configuration(self, values: dict) -> None:
        self.run["hparams"] = _plain(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for key, value in _plain(values).items():
            self.run.track(value, name=key, step=step, **kwargs)

    def finish(self) -> None:
        self.run.close()


class MLflowTracker(_LibraryTracker):
    """A run in the MLflow experiment named after the project (created when missing). As in Accelerate,
    the MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID, MLFLOW_TAGS and MLFLOW_NESTED_RUN variables win over
    the arguments."""

    name = module = pip = "mlflow"

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike | None = None,
                 run_id: str | None = None, tags: dict | str | None = None, nested_run: bool = False,
                 run_name: str | None = None, description: str | None = None) -> None:
        super().__init__(os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name))
        tags, nested = os.environ.get("MLFLOW_TAGS", tags), os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.artifact_location = None if logging_dir is None else str(logging_dir)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.start_kwargs = {"run_id": os.environ.get("MLFLOW_RUN_ID", run_id), "run_name": run_name,
                             "description": description, "tags": self.tags,
                             "nested": nested.lower() in ("1", "true", "yes") if isinstance(nested, str) else nested}

    def _open(self, lib: Any) -> Any:
        experiment = lib.get_experiment_by_name(self.run_name)
        experiment_id = experiment.experiment_id if experiment is not None else lib.create_experiment(
            self.run_name, artifact_location=self.artifact_location, tags=self.tags)
        return lib.start_run(experiment_id=experiment_id, **self.start_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        """As run parameters, 100 per call (MLflow's batch limit); a value over its 6000 characters is
        left out."""
        params = {k: str(v) for k, v in _plain(values).items()}
        for key in [k for k, v in params.items() if len(v) > 6000]:
            warn(f"mlflow: parameter {key!r} is longer than 6000 characters; it is not logged")
            del params[key]
        items = list(params.items())
        for i in range(0, len(items), 100):
            self.lib.log_params(dict(items[i:i + 100]))

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.lib.log_metrics(_numbers(values, self.name), step=step, **kwargs)

    def finish(self) -> None:
        self.lib.end_run()


class ClearMLTracker(_LibraryTracker):
    """The script's current ClearML Task if it started one (the script closes it), else `Task.init`
    with the run name as project and task name (CLEARML_PROJECT / CLEARML_TASK win). With a step, a
    key starting eval_, test_ or train_ is reported in that series, others in train; without a step,
    as a single value."""

    name = module = pip = "clearml"

    def _open(self, lib: Any) -> Any:
        self.external = lib.Task.current_task() is not None
        kwargs = {"project_name": os.environ.get("CLEARML_PROJECT", self.run_name),
                  "task_name": os.environ.get("CLEARML_TASK", self.run_name), **self.init_kwargs}
        return lib.Task.current_task() or lib.Task.init(**kwargs)

    def store_init_configuration(self, values: dict) -> Any:
        return self.run.connect_configuration(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        clearml_logger = self.run.get_logger()
        for key, value in _numbers(values, self.name).items():
            if step is None:
                clearml_logger.report_single_value(name=key, value=value, **kwargs)
                continue
            prefix = next((p for p in ("eval_", "test_", "train_") if key.startswith(p)), "")
            title, series = (key[len(prefix):], prefix[:-1]) if prefix else (key, "train")
            clearml_logger.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    def finish(self) -> None:
        if not self.external:
            self.run.close()


class DVCLiveTracker(_LibraryTracker):
    """`dvclive.Live(**init_kwargs)`, or the `live` object passed in init_kwargs; one `next_step` per
    `log`."""

    name = module = pip = "dvclive"

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.live = live

    def _open(self, lib: Any) -> Any:
        return self.live if self.live is not None else lib.Live(**self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.run.log_params(_plain(values))

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.run.step = step
        for key, value in _numbers(values, self.name).items():
            self.run.log_metric(key, value, **kwargs)
        self.run.next_step()

    def finish(self) -> None:
        self.run.end()


# "all" takes the installed ones in this order
