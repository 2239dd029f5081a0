"""Experiment tracking through the Accelerator (hf_backend.tracking): what each tracker writes, how `log_with` is
read and refused, and that only the main process writes."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import numpy as np
import pytest
import torch
from helpers import run_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hf_backend import Accelerator, HfBackendError, ProjectConfiguration
from hf_backend.core.enums import LoggerType
from hf_backend.tracking import GeneralTracker, JSONLTracker, TensorBoardTracker, on_main_process


def _refused(match: str, **kwargs) -> str:
    with pytest.raises(HfBackendError, match=match) as caught:
        Accelerator(**kwargs)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_tensorboard_scalars_and_steps_read_back(tmp_path):
    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    acc.init_trackers("run", config={"lr": 0.1, "layers": [1, 2]}, init_kwargs={"tensorboard": {"flush_secs": 5}})
    for step in range(3):
        acc.log({"loss": torch.tensor(1.0 / (step + 1)), "acc": np.float32(step / 4), "note": f"s{step}"}, step=step)
    writer = acc.get_tracker("tensorboard", unwrap=True)
    assert isinstance(acc.get_tracker("tensorboard"), TensorBoardTracker) and writer.flush_secs == 5
    acc.end_training()

    events = EventAccumulator(str(tmp_path / "run")).Reload()
    assert {"loss", "acc"} <= set(events.Tags()["scalars"])
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss")] == [(0, 1.0), (1, 0.5), (2, 0.33333)]
    assert [(e.step, e.value) for e in events.Scalars("acc")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert list((tmp_path / "run" / "hparams").glob("events.out.tfevents.*"))  # the config, as hparams


def test_jsonl_lines_and_config(tmp_path):
    acc = Accelerator(log_with="jsonl", project_config=ProjectConfiguration(logging_dir=str(tmp_path / "logs")))
    acc.init_trackers("exp", config={"lr": torch.tensor(0.5), "name": "bert", "sizes": np.arange(3)})
    acc.log({"loss": torch.tensor(2.0, requires_grad=True), "acc": np.float64(0.75), "split": "train"}, step=7)
    acc.log({"matrix": torch.eye(2), "count": np.int64(3)})
    path = acc.get_tracker("jsonl", unwrap=True)
    acc.end_training()

    assert path == tmp_path / "logs" / "exp" / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["values"]) for r in lines] == [
        (7, {"loss": 2.0, "acc": 0.75, "split": "train"}),
        (None, {"matrix": [[1.0, 0.0], [0.0, 1.0]], "count": 3}),
    ]
    assert all(isinstance(r["time"], float) for r in lines)
    config = json.loads((tmp_path / "logs" / "exp" / "config.json").read_text())
    assert config == {"lr": 0.5, "name": "bert", "sizes": [0, 1, 2]}

    again = Accelerator(log_with="jsonl", project_dir=tmp_path / "logs")  # a resumed run appends
    again.init_trackers("exp")
    again.log({"loss": 1.0}, step=8)
    again.end_training()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [7, None, 8]


class Recorder(GeneralTracker):
    """A custom tracker as Accelerate's docs write one: its own __init__, no super().__init__()."""

    name = "recorder"
    requires_logging_directory = False

    @on_main_process
    def __init__(self, run_name: str):
        self.run_name, self.config, self.calls, self.finished = run_name, None, [], False

    @property
    def tracker(self):
        return self.calls

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.config = dict(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.calls.append((dict(values), step, kwargs))

    def finish(self):
        self.finished = True


def test_a_custom_tracker_gets_the_config_the_logs_and_finish(tmp_path):
    recorder = Recorder("my_run")
    acc = Accelerator(log_with=[recorder, "jsonl"], project_dir=tmp_path)
    acc.init_trackers("proj", config={"lr": 3e-4})
    acc.log({"loss": 0.5}, step=1, log_kwargs={"recorder": {"commit": False}})
    acc.log({"loss": 0.25}, step=2)
    assert acc.trackers[0] is recorder and acc.get_tracker("recorder") is recorder
    assert acc.get_tracker("recorder", unwrap=True) is recorder.calls
    acc.end_training()
    assert recorder.config == {"lr": 3e-4} and recorder.finished
    assert recorder.calls == [({"loss": 0.5}, 1, {"commit": False}), ({"loss": 0.25}, 2, {})]

    class Incomplete(GeneralTracker):
        name = "incomplete"
        requires_logging_directory = False

    with pytest.raises(HfBackendError, match="Incomplete must define tracker"):
        Incomplete()


def test_all_is_jsonl_tensorboard_and_every_installed_library(tmp_path):
    acc = Accelerator(log_with="all", project_dir=tmp_path)
    others = [n for n in ("wandb", "trackio", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab", "aim")
              if importlib.util.find_spec(n) is not None]
    assert acc.tracking.names == ["jsonl", "tensorboard", *others]
    assert acc.log_with == [LoggerType.JSONL, LoggerType.TENSORBOARD, *map(LoggerType, others)]  # Accelerate's list
    assert acc.tracking.names == [str(t) for t in Accelerator(log_with=LoggerType.ALL, project_dir=tmp_path)
                                  .tracking.names]
    _refused(r"log_with='all': the jsonl tracker writes files .* pass Accelerator\(project_dir=", log_with="all")


def test_logger_types_and_lists(tmp_path):
    acc = Accelerator(log_with=[LoggerType.JSONL, "tensorboard", LoggerType.TENSORBOARD, "JSONL"], project_dir=tmp_path)
    acc.init_trackers("run")
    assert [type(t) for t in acc.trackers] == [JSONLTracker, TensorBoardTracker]  # repeats count once
    acc.end_training()
    assert Accelerator(log_with=LoggerType.JSONL, project_dir=tmp_path).tracking.names == ["jsonl"]
    assert Accelerator(log_with=("jsonl",), project_dir=tmp_path).tracking.names == ["jsonl"]
    _refused("log_with=<class .*Recorder'> is not a tracker name .* pass an instance, Recorder", log_with=Recorder)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_missing_package_is_named_with_its_install_command(tmp_path):
    message = _refused("wandb", log_with=["jsonl", LoggerType.WANDB], project_dir=tmp_path)
    assert message == "log_with='wandb' needs the wandb package, which is not installed: pip install wandb"


def test_an_unknown_name_lists_the_valid_ones(tmp_path):
    message = _refused("tensorbaord", log_with="tensorbaord", project_dir=tmp_path)
    assert message.startswith("log_with='tensorbaord' is not a tracker; use one of all, aim, tensorboard, wandb")
    assert "jsonl" in message and "GeneralTracker instance" in message


def test_a_file_tracker_without_a_logging_directory_says_to_pass_project_dir():
    message = _refused("tensorboard", log_with="tensorboard")
    assert message.startswith("log_with='tensorboard': the tensorboard tracker writes files and no logging directory")
    assert "Accelerator(project_dir=...)" in message and "ProjectConfiguration(logging_dir=...)" in message


def test_misuse_is_one_line(tmp_path):
    acc = Accelerator(log_with="jsonl", project_dir=tmp_path)
    with pytest.raises(HfBackendError, match=r"log\(\) before accelerator.init_trackers"):
        acc.log({"loss": 1.0})
    with pytest.raises(HfBackendError, match="before init_trackers"):
        acc.get_tracker("jsonl")
    acc.init_trackers("run")
    with pytest.raises(HfBackendError, match="get_tracker\\('wandb'\\): no such tracker in use; log_with has jsonl"):
        acc.get_tracker("wandb")
    with pytest.raises(HfBackendError, match="log_kwargs has jsnol, which is not a tracker"):
        acc.log({"loss": 1.0}, log_kwargs={"jsnol": {}})
    with pytest.raises(HfBackendError, match="init_trackers was already called"):
        acc.init_trackers("run")
    acc.end_training()
    with pytest.raises(HfBackendError, match="before accelerator.init_trackers"):
        acc.log({"loss": 1.0})
    Accelerator().log({"loss": 1.0})  # no log_with: nothing to log to, as in Accelerate


_TWO_RANKS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from hf_backend import Accelerator
    from hf_backend.tracking import GeneralTracker

    class PerRank(GeneralTracker):
        name, requires_logging_directory, main_process_only = "per_rank", False, False

        def __init__(self, path):
            self.path = path

        @property
        def tracker(self):
            return self.path

        def log(self, values, step=None, **kwargs):
            with open(self.path, "a") as out:
                out.write(json.dumps([step, values]) + "\\n")

    out = Path(sys.argv[1])
    acc = Accelerator(log_with=["jsonl", "tensorboard", PerRank(out / f"rank{__import__('os').environ['RANK']}.txt")],
                      project_dir=out)
    acc.init_trackers("run", config={"world": acc.num_processes})
    for step in range(3):
        acc.log({"loss": float(step)}, step=step)
    tb = acc.get_tracker("tensorboard", unwrap=True)
    tb.add_scalar("extra", 1.0, 0)  # a no-op on rank 1
    acc.get_tracker("jsonl").log({"direct": 1.0})
    report = {"trackers": [t.name for t in acc.trackers], "tb": type(tb).__name__}
    (out / f"report{acc.process_index}.json").write_text(json.dumps(report))
    acc.end_training()
""")


def test_two_processes_only_rank_0_writes_the_main_process_trackers(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    out = tmp_path / "out"
    out.mkdir()
    run_script(script, [str(out)], nproc=2, timeout=120)

    reports = [json.loads((out / f"report{r}.json").read_text()) for r in range(2)]
    assert reports[0] == {"trackers": ["per_rank", "jsonl", "tensorboard"], "tb": "SummaryWriter"}
    assert reports[1] == {"trackers": ["per_rank"], "tb": "_NoOpTracker"}
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["values"] for line in lines] == [{"loss": 0.0}, {"loss": 1.0}, {"loss": 2.0},
                                                              {"direct": 1.0}]
    assert len(list((out / "run").glob("events.out.tfevents.*"))) == 1  # one writer: rank 0's
    events = EventAccumulator(str(out / "run")).Reload()
    assert [e.value for e in events.Scalars("loss")] == [0.0, 1.0, 2.0]
    assert json.loads((out / "run" / "config.json").read_text()) == {"world": 2}
    for rank in range(2):  # a tracker with main_process_only = False runs on every process
        assert (out / f"rank{rank}.txt").read_text().count("loss") == 3
