"""DeepSpeed's own Ulysses (ALST) when DeepSpeed is the strategy (issue 44): `ParallelismConfig(sp_size=2,
sp_backend="deepspeed")` with a DeepSpeed config, from an Accelerator loop written as Accelerate's ALST example (the
loader prepared with the model goes through DeepSpeed's adapter; the slices' losses combined by their target counts)
and from hf_backend.Trainer (transformers' own ALST paths: the adapter, its loss), against one process training the
same rows: losses within 1e-6, gradient norms within 1e-5, parameters within 5e-5 (AdamW, clipping at 0.5). The
norms catch what AdamW and clipping hide: below ZeRO-3, DeepSpeed leaves such a loss's gradients sp times as large
(hf_backend divides them back).
"""

from __future__ import annotations

import math

import pytest
from helpers import run_report

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

LOSS, NORM, PARAMS = 1e-6, 1e-5, 5e-5


def _steps(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 4 and all(math.isfinite(x) for x in [*a, *b])
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize(("world", "zero"), [(2, 2), (4, 3)], ids=["sp2-zero2", "sp2xdp2-zero3"])
def test_an_alst_loop_trains_as_one_process(tmp_path, world, zero):
    one = run_report("alst_loop.py", tmp_path / "one.json", ["--grid", "single", "--world", str(world), "--sp", "2"])
    many = run_report("alst_loop.py", tmp_path / "alst.json", ["--sp", "2", "--zero", str(zero)], nproc=world,
                      timeout=300)
    assert many["grid"]["sp_size"] == 2 and many["grid"]["sp_backend"] == "deepspeed"
    assert _steps(one["losses"], many["losses"]) <= LOSS
    assert _steps(one["norms"], many["norms"]) <= NORM, (one["norms"], many["norms"])
    assert one["norms"][0] > 0.5  # the clipping acted
    assert max(abs(x - y) for name in one["params"]
               for x, y in zip(one["params"][name], many["params"][name], strict=True)) <= PARAMS


def test_the_trainer_runs_deepspeeds_alst_as_one_process(tmp_path):
    """TrainingArguments(deepspeed=ZeRO-2, parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))
    on 2 processes, batches of 4 per process padded to one width (on gloo DeepSpeed's adapter gathers the group's
    batches, which must be as long): each step trains one process's batch, so one process with batches of 4 is the
    reference."""
    common = ["--steps", "4", "--save-steps", "10", "--pad-multiple", "24", "--batch-size", "4"]
    one = run_report("llm_trainer.py", tmp_path / "one.json", ["--output-dir", str(tmp_path / "one"), "--positions",
                                                              *common])
    many = run_report("llm_trainer.py", tmp_path / "alst.json", ["--output-dir", str(tmp_path / "alst"), "--strategy",
                                                                "zero2", "--alst", "2", *common], nproc=2, timeout=300)
    assert _steps(one["losses"], many["losses"]) <= LOSS
    assert _steps(one["grad_norms"], many["grad_norms"]) <= NORM
    assert max(abs(x - y) for x, y in zip(one["params"], many["params"], strict=True)) <= PARAMS
