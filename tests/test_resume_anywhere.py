"""A checkpoint resumes under any strategy and world size, DeepSpeed ZeRO included (issue 18, item 5), and DeepSpeed's
own checkpoint files (transformers.Trainer's under DeepSpeed) are merged by consolidate without running pickled code.

Each case trains tests/scripts/resume_anywhere.py for 5 of 12 optimizer steps under strategy A in `a` processes,
saves, resumes under strategy B in `b` processes and takes the other 7; those 7 losses, learning rates and the final
logits are compared with an uninterrupted 12-step run under B. Every run steps on the same global batches (12
samples split over the processes), so the only differences allowed are the floating-point roundings of another
world size (a gradient averaged over 2 or 3 processes rather than summed in one, a loss averaged per process):
1e-6. Measured: the 7 losses bitwise equal in 7 of the 10 cases, 1.1e-7 relative from 3 processes and from ZeRO-3 to
FSDP, 2.3e-7 into DeepSpeed's CPU Adam (the uninterrupted run's first 5 steps are its own arithmetic); the final
logits within 3e-8 (CPU Adam: 2.7e-7); the bf16 case bitwise throughout. bf16 is compared
under one ZeRO stage: ZeRO-2 and ZeRO-3 in bf16 train apart by themselves (1e-3 in the weights after 5 steps).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_report
from safetensors.torch import load_file

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

SCRIPT = "resume_anywhere.py"
STOP = 5  # of resume_anywhere.TOTAL = 12
TOLERANCE = 1e-6
FIXTURE = Path(__file__).parent / "fixtures" / "deepspeed_zero2"  # DeepSpeed's own checkpoint (its README.md)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 12-step run of a strategy (and precision), run once per module."""
    runs: dict[tuple, dict] = {}

    def run(strategy: str, nproc: int, precision: str | None) -> dict:
        key = (strategy, nproc, precision)
        if key not in runs:
            directory = tmp_path_factory.mktemp("uninterrupted")
            runs[key] = run_report(SCRIPT, directory / "r.json", ["--strategy", strategy, *_precision(precision),
                                                                  "--final", str(directory / "final")], nproc=nproc)
            runs[key]["final"] = directory / "final"
        return runs[key]

    return run


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A strategy's (and precision's) checkpoint after STOP steps and its run's report, saved once per module: the
    cases that resume the same checkpoint elsewhere only read it."""
    runs: dict[tuple, tuple[dict, Path]] = {}

    def run(strategy: str, nproc: int, precision: str | None) -> tuple[dict, Path]:
        key = (strategy, nproc, precision)
        if key not in runs:
            directory = tmp_path_factory.mktemp("saved")
            report = run_report(SCRIPT, directory / "a.json", ["--strategy", strategy, *_precision(precision),
                                                               "--stop-after", str(STOP), "--checkpoint",
                                                               str(directory / "ckpt")], nproc=nproc)
            runs[key] = report, directory / "ckpt"
        return runs[key]

    return run


def _precision(precision: str | None) -> list[str]:
    return ["--mixed-precision", precision] if precision else []


def _relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("source, a, resumed, b, precision", [
    ("zero2", 2, "single", 1, None),  # ZeRO -> one process
    ("single", 1, "zero3", 2, None),  # one process -> ZeRO
    ("zero3", 2, "single", 1, None),
    ("ddp", 2, "zero1", 2, None),  # DDP -> ZeRO
    ("zero3", 2, "fsdp", 2, None),  # ZeRO -> FSDP
    ("fsdp", 2, "zero3", 2, None),  # FSDP's sharded (DCP) checkpoint -> ZeRO
    ("zero1", 3, "zero2", 2, None),  # ZeRO at another world size
    ("zero3", 2, "zero3", 2, "bf16"),  # the fp32 master weights are what is saved and restored
    ("zero0", 2, "single", 1, None),  # DeepSpeed without ZeRO
    ("single", 1, "zero2_offload", 2, None),  # into DeepSpeed's CPU Adam (compiled on first use, then cached)
])
def test_a_checkpoint_resumes_under_another_strategy_and_world_size(uninterrupted, saved, tmp_path, source, a,
                                                                      resumed, b, precision):
    first, checkpoint = saved(source, a, precision)
    native = ["--native", str(tmp_path / "native")] if resumed.startswith("zero") and resumed != "zero0" else []
    second = run_report(SCRIPT, tmp_path / "b.json", ["--strategy", resumed, *_precision(precision), "--resume",
                                                      str(checkpoint), "--done", str(STOP), "--final",
                                                      str(tmp_path / "final"), *native], nproc=b)
    reference = uninterrupted(resumed, b, precision)
    kinds = {"single": "NO", "ddp": "MULTI_CPU", "fsdp": "FSDP"}
    assert [first["distributed_type"], second["distributed_type"]] == [
        kinds.get(name, "DEEPSPEED") for name in (source, resumed)]
    assert len(first["losses"]) == STOP and len(second["losses"]) == len(reference["losses"]) - STOP
    assert second["lrs"] == reference["lrs"][STOP:]  # the schedule continues where it stopped
    assert _relative(second["losses"], reference["losses"][STOP:]) <= TOLERANCE
    logits, expected = torch.tensor(second["logits"]), torch.tensor(reference["logits"])
    torch.testing.assert_close(logits, expected, rtol=TOLERANCE, atol=TOLERANCE)
    if precision:  # bf16 losses and logits are too coarse to tell: the fp32 masters at the end are the same
        final, expected = load_file(tmp_path / "final" / "model.safetensors"), load_file(
            reference["final"] / "model.safetensors")
        assert all(torch.equal(final[k], expected[k]) for k in expected)
    if native:  # DeepSpeed's own format (transformers.Trainer's), merged in this one process: the same fp32 masters
        from hf_backend.checkpoint.deepspeed_files import native_weights

        merged, final = native_weights(tmp_path / "native", "global_step"), load_file(
            tmp_path / "final" / "model.safetensors")
        assert sorted(merged) == sorted(final) and all(torch.equal(merged[k], final[k]) for k in final)
    # what every strategy writes and reads: full fp32 weights and the optimizer state keyed by parameter name
    names = {p.name for p in checkpoint.iterdir()}
    if source != "fsdp":
        assert {"model.safetensors", "optimizer.bin"} <= names and "model_deepspeed" not in names, names
        weights = load_file(checkpoint / "model.safetensors")
        assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float32}
        state = torch.load(checkpoint / "optimizer.bin", weights_only=True)
        trainable = [name for group in state["param_groups"] for name in group["params"]]
        assert len(trainable) == 41 and set(state["state"]) == set(trainable) <= set(weights)
        assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} and float(s["step"]) == STOP
                   for s in state["state"].values())


def test_the_weights_of_a_deepspeed_checkpoint_are_read_without_pickle():
    """`native_weights` (hf-backend checkpoint consolidate) merges the fixture's two ZeRO-2 partitions into the
    weights the run that saved it saw, and leaves DeepSpeed's own zero_to_fp32 module as it was."""
    import deepspeed.utils.zero_to_fp32

    from hf_backend.checkpoint.deepspeed_files import native_weights

    weights = native_weights(FIXTURE, "global_step4")
    assert deepspeed.utils.zero_to_fp32.torch is torch
    expected = json.loads((FIXTURE / "expected.json").read_text())["weights"]
    assert sorted(weights) == sorted(expected)
    for name, values in expected.items():
        assert weights[name].dtype == torch.float32 and weights[name].flatten().tolist() == values


class _CreatesMarker:
    """Unpickled without `weights_only`, this creates the marker file: open(marker, "w")."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _poison(path: Path, marker: Path) -> None:
    torch.save({"module": {"weight": torch.zeros(2)}, "payload": _CreatesMarker(marker)}, path)


def test_the_poisoned_file_would_run_its_code(tmp_path):
    """The payload the refusal tests use is live: an unrestricted torch.load creates the marker."""
    marker = tmp_path / "marker"
    _poison(tmp_path / "file.pt", marker)
    torch.load(tmp_path / "file.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("poisoned", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
def test_consolidating_a_deepspeed_checkpoint_refuses_a_pickled_payload(tmp_path, poisoned):
    from hf_backend import HfBackendError
    from hf_backend.checkpoint.deepspeed_files import native_weights

    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    marker = tmp_path / "marker"
    _poison(tmp_path / "ckpt" / "global_step4" / poisoned, marker)
    with pytest.raises(HfBackendError, match=f"{poisoned} holds more than tensors") as raised:
        native_weights(tmp_path / "ckpt", "global_step4")
    assert "\n" not in str(raised.value) and not marker.exists()
