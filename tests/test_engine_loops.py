"""The Accelerate tutorial loop on the engine, in one process and in two (gloo): parity, accumulation, resume."""

from __future__ import annotations

import pytest
from helpers import run_report

LOOP = "tutorial_loop.py"


def _close(a: list[float], b: list[float], tol: float) -> float:
    assert len(a) == len(b)
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= tol, f"max difference {worst} > {tol}"
    return worst


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    """One process, batch 16, shuffled, AdamW + linear schedule, 2 epochs of 8 steps."""
    return run_report(LOOP, tmp_path_factory.mktemp("base") / "r.json", ["--batch-size", "16"])


def test_one_process_loop_trains_and_gathers_every_eval_row(baseline):
    assert baseline["world"] == 1 and baseline["batches_per_epoch"] == 8
    assert len(baseline["losses"]) == 16
    assert baseline["losses"][-1] < baseline["losses"][0]
    # 37 rows: divides by neither the eval batch (8) nor the world size.
    assert baseline["eval_rows"] == 37
    assert baseline["lr"] == 0.0  # the linear schedule ran its full length


def test_two_processes_train_one_model_like_one_process_with_twice_the_batch(baseline, tmp_path):
    two = run_report(LOOP, tmp_path / "r.json", ["--batch-size", "8", "--seed-per-rank"], nproc=2)
    assert two["world"] == 2 and two["batches_per_epoch"] == 8
    assert two["ranks_agree"], "ranks seeded differently must still hold identical parameters after every step"
    _close(two["losses"], baseline["losses"], 1e-6)
    _close(two["params"], baseline["params"], 1e-6)
    assert two["eval_rows"] == 37
    assert two["eval_labels"] == baseline["eval_labels"], "gather_for_metrics must keep the dataset order"
    assert two["lr"] == 0.0, "the schedule sized from the 1-process loader length must span the 2-process run"


@pytest.mark.parametrize(("nproc", "batch"), [(1, 8), (2, 4)])
def test_gradient_accumulation_equals_the_large_batch(baseline, tmp_path, nproc, batch):
    acc = run_report(LOOP, tmp_path / "r.json", ["--batch-size", str(batch), "--grad-accum", "2"], nproc=nproc)
    assert acc["ranks_agree"]
    _close(acc["losses"], baseline["losses"], 1e-6)
    _close(acc["params"], baseline["params"], 1e-6)


def test_split_batches_splits_the_global_batch(baseline, tmp_path):
    split = run_report(LOOP, tmp_path / "r.json", ["--batch-size", "16", "--split-batches"], nproc=2)
    assert split["batches_per_epoch"] == 8
    _close(split["losses"], baseline["losses"], 1e-6)
    _close(split["params"], baseline["params"], 1e-6)


def _resumed(tmp_path, nproc: int, stop: int, extra: list[str], resume_nproc: int | None = None,
             resume_extra: list[str] | None = None) -> tuple[dict, dict]:
    ckpt = str(tmp_path / "ckpt")
    first = run_report(LOOP, tmp_path / "first.json", [*extra, "--stop-after", str(stop), "--checkpoint", ckpt],
                       nproc=nproc)
    second = run_report(LOOP, tmp_path / "second.json", [*(resume_extra or extra), "--resume", "--checkpoint", ckpt],
                        nproc=resume_nproc or nproc)
    return first, second


def test_resume_mid_epoch_in_one_process_is_bitwise(tmp_path):
    args = ["--batch-size", "16", "--dropout", "0.2"]
    full = run_report(LOOP, tmp_path / "full.json", args)
    first, second = _resumed(tmp_path, 1, 5, args)  # step 5 of 8: the middle of the first epoch
    assert first["losses"] + second["losses"] == full["losses"]
    assert second["params"] == full["params"]
    assert second["eval_labels"] == full["eval_labels"]


def test_resume_mid_epoch_in_two_processes(tmp_path):
    args = ["--batch-size", "8", "--grad-accum", "1"]
    full = run_report(LOOP, tmp_path / "full.json", args, nproc=2)
    first, second = _resumed(tmp_path, 2, 11, args)  # step 11: the middle of the second epoch
    _close(first["losses"] + second["losses"], full["losses"], 1e-7)
    _close(second["params"], full["params"], 1e-7)


def test_checkpoint_from_two_processes_resumes_in_one(baseline, tmp_path):
    # split_batches keeps the global batch (and so the schedule's length) independent of the world size.
    args = ["--batch-size", "16", "--split-batches"]
    first, second = _resumed(tmp_path, 2, 5, args, resume_nproc=1)
    _close(first["losses"] + second["losses"], baseline["losses"], 1e-6)
    _close(second["params"], baseline["params"], 1e-6)
