"""The experiment trackers of third-party packages (wandb, trackio, swanlab, comet_ml, aim, mlflow, clearml,
dvclive): each imports its package only when built, and `hf_backend.tracking` refuses it in one line when the package
is missing."""

from __future__ import annotations

import json
import os
from typing import Any

from .log import warn
from .tracking import _LibraryTracker, _numbers, _numeric, _plain


class WandBTracker(_LibraryTracker):
    """`wandb.init(project=run_name, **init_kwargs)`."""

    name = module = pip = "wandb"

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)


class TrackioTracker(_LibraryTracker):
    """`trackio.init(project=run_name, **init_kwargs)`; the configuration goes with the run's logs."""

    name = module = pip = "trackio"


class SwanLabTracker(_LibraryTracker):
    """`swanlab.init(project=run_name, **init_kwargs)`."""

    name = module = pip = "swanlab"

    def store_init_configuration(self, values: dict) -> None:
        self.lib.config.update(values)


class CometMLTracker(_LibraryTracker):
    """`comet_ml.start(project_name=run_name, **init_kwargs)` (`comet_ml.Experiment` before 3.41)."""

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
    """A run in the MLflow experiment named after the project (created when missing). As in Accelerate, the
    MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID, MLFLOW_TAGS and MLFLOW_NESTED_RUN variables win over the arguments."""

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
        """As run parameters, 100 per call (MLflow's batch limit); a value over its 6000 characters is left out."""
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
    """The script's current ClearML Task if it started one (the script closes it), else `Task.init` with the run
    name as project and task name (CLEARML_PROJECT / CLEARML_TASK win). With a step, a key starting eval_, test_ or
    train_ is reported in that series, others in train; without a step, as a single value."""

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
    """`dvclive.Live(**init_kwargs)`, or the `live` object passed in init_kwargs; one `next_step` per `log`."""

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
