"""accelerator.profile(): torch.profiler built from ProfileKwargs, one Chrome trace per process.

Run as a script (`python test_profiling.py --out r.json --trace-dir d`, in 1 or 2 processes) this file is also the
multi-process job the tests start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hf_backend import Accelerator
from hf_backend.config.options import ProfileKwargs
from hf_backend.core.errors import HfBackendError
from hf_backend.runtime.profiling import profile


def _work(tag: str) -> None:
    with torch.profiler.record_function(tag):
        torch.mm(torch.randn(16, 16), torch.randn(16, 16))


def _names(trace_file: Path) -> set[str]:
    trace = json.loads(trace_file.read_text())
    assert trace["traceEvents"], f"{trace_file} has no trace events"
    return {event.get("name", "") for event in trace["traceEvents"]}


def test_profile_records_the_ops_run_inside_and_writes_the_trace(tmp_path):
    handler = ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir=str(tmp_path / "traces"))
    with profile(handler, 0) as prof:
        _work("inside")
    _work("outside")
    keys = {event.key for event in prof.key_averages()}
    assert {"inside", "aten::mm"} <= keys and "outside" not in keys
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["profile_0.json"]  # Accelerate's file name
    assert "inside" in _names(tmp_path / "traces" / "profile_0.json")


def test_no_trace_without_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with profile(ProfileKwargs(), 0) as prof:
        _work("inside")
    assert "inside" in {event.key for event in prof.key_averages()}
    assert list(tmp_path.iterdir()) == []


def test_schedule_records_only_the_active_steps(tmp_path):
    ready = []
    handler = ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
                            on_trace_ready=lambda p: ready.append(sorted(e.key for e in p.key_averages()
                                                                         if e.key.startswith("step_"))),
                            output_trace_dir=str(tmp_path))
    with profile(handler, 3) as prof:
        for i in range(6):
            _work(f"step_{i}")
            prof.step()
    assert ready == [["step_2", "step_3"]]  # wait 1, warm up 1, record 2, then nothing (repeat=1)
    names = _names(tmp_path / "profile_3.json")
    assert {"step_2", "step_3"} <= names and not names & {"step_0", "step_1", "step_4", "step_5"}


def test_through_the_accelerator_with_its_handler_or_another(tmp_path):
    accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(output_trace_dir=str(tmp_path / "a"))])
    with accelerator.profile() as prof:
        _work("via_handler")
    assert "via_handler" in {event.key for event in prof.key_averages()}
    assert "via_handler" in _names(tmp_path / "a" / "profile_0.json")
    with accelerator.profile(ProfileKwargs(output_trace_dir=str(tmp_path / "b"))):
        _work("override")
    assert "override" in _names(tmp_path / "b" / "profile_0.json")


@pytest.mark.parametrize(("handler", "words"), [
    (ProfileKwargs(activities=["gpu"]), "'gpu'"),
    (ProfileKwargs(activities=["cuda"]), "'cuda'"),
    (ProfileKwargs(schedule_option={"wait": 1, "active": 1, "every": 2}), "'every'"),
    (ProfileKwargs(schedule_option={"wait": 1}), "'active'"),
    (ProfileKwargs(schedule_option={"active": 0}), "active=0"),
])
def test_bad_options_are_one_line(handler, words):
    if "cuda" in words and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: 'cuda' is a valid activity")
    with pytest.raises(HfBackendError) as err, profile(handler, 0):
        pass
    message = str(err.value)
    assert words in message and "\n" not in message


def test_two_processes_write_one_trace_each(tmp_path):
    from helpers import run_report

    report = run_report(Path(__file__).resolve(), tmp_path / "r.json", ["--trace-dir", str(tmp_path / "t")], nproc=2)
    assert report["world"] == 2
    assert report["files_after_block"] == ["profile_0.json", "profile_1.json"]  # all there when the block ends
    for rank in (0, 1):
        names = _names(tmp_path / "t" / f"profile_{rank}.json")
        assert f"rank_{rank}_work" in names and f"rank_{1 - rank}_work" not in names


def _worker(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace-dir", required=True)
    args = parser.parse_args(argv)
    accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(activities=["cpu"], output_trace_dir=args.trace_dir)])
    with accelerator.profile():
        _work(f"rank_{accelerator.process_index}_work")
    files = sorted(p.name for p in Path(args.trace_dir).iterdir())
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({"world": accelerator.num_processes, "files_after_block": files}))
    accelerator.end_training()


if __name__ == "__main__":
    _worker(sys.argv[1:])
