"""Accelerate's own PartialState, AcceleratorState and GradientState inside an engine run (hf_backend/
accelerate_state.py): code that still asks them (TRL, `accelerate.logging`, `accelerate.utils`) is told the engine's
processes, distributed type, precision and accumulation state, in one process and in two (tests/scripts/
accelerate_state.py); without accelerate loaded the engine does not load it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_script

pytest.importorskip("accelerate")

SCRIPT = "accelerate_state.py"


def reports(tmp: Path, name: str, nproc: int, args: list[str] = ()) -> list[dict]:
    out = tmp / name
    run_script(SCRIPT, ["--out", str(out), *args], nproc=nproc)
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(nproc)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("accelerate_state")
    return {"one": reports(tmp, "one", 1), "two": reports(tmp, "two", 2),
            "fsdp": reports(tmp, "fsdp", 2, ["--fsdp", "--mixed-precision", "bf16"])}


def test_set_seed_device_specific_seeds_each_rank_with_its_index(runs) -> None:
    """`accelerate.utils.set_seed(7, device_specific=True)` in rank 1 of 2 seeds with 8, as under Accelerate."""
    assert [r["seed"] for r in runs["two"]] == [7, 8]
    assert runs["one"][0]["seed"] == 7


def test_accelerate_states_report_the_engines_world(runs) -> None:
    for rank, report in enumerate(runs["two"]):
        assert report["accelerator_state"] == [2, rank, "DistributedType.MULTI_CPU", "no", "cpu"]
        assert report["partial_state"] == [2, rank, rank, rank == 0, "DistributedType.MULTI_CPU", True]
    assert runs["one"][0]["accelerator_state"] == [1, 0, "DistributedType.NO", "no", "cpu"]
    for rank, report in enumerate(runs["fsdp"]):
        assert report["accelerator_state"] == [2, rank, "DistributedType.FSDP", "bf16", "cpu"]
        assert report["fsdp_plugin_is_the_engines"]


def test_accelerate_collectives_span_the_engines_processes(runs) -> None:
    for report in runs["two"]:
        assert report["gathered_objects"] == ["rank0", "rank1"]
        assert report["broadcast"] == 1  # rank 0's object
        assert report["gathered"] == [1.0, 2.0]


def test_accelerate_gradient_state_follows_the_engines_accumulation(runs) -> None:
    """Inside `accumulate` with 2 steps: not syncing, then syncing; the last batch is the loader's end."""
    for name in ("one", "two"):
        seen = runs[name][0]["gradient_state"]
        assert [s[0] for s in seen] == [False, True] * (len(seen) // 2), name
        assert all(s[1] == 2 and s[2] for s in seen), name
        assert [s[3] for s in seen] == [False] * (len(seen) - 1) + [True], name
        assert runs[name][0]["gradient_state_after"] == [False, True], name


def test_run_glue_no_trainer_first_log_line(runs, tmp_path) -> None:
    """`logger.info(accelerator.state, main_process_only=False)` through accelerate.logging, as transformers'
    `*_no_trainer.py` scripts log first, prints Accelerate's text on each rank; `main_process_only` holds."""
    proc = run_script(SCRIPT, ["--out", str(tmp_path / "log")], nproc=2)
    text = proc.stdout + proc.stderr
    assert text.count("Distributed environment: MULTI_CPU  Backend: gloo") == 2
    assert "Num processes: 2" in text and "Mixed precision type: no" in text
    assert text.count("logged once") == 1


def test_the_engine_does_not_load_accelerate() -> None:
    code = ("import sys, torch, hf_backend\n"
            "acc = hf_backend.Accelerator()\n"
            "acc.prepare(torch.nn.Linear(2, 2))\n"
            "print('accelerate' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"
