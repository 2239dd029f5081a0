"""benchmarks/gpu_trainer.py needs a GPU for its figures; CI has none, so its --smoke mode runs the same three variants
(bare loop, transformers.Trainer, hf_backend.Trainer) on the CPU with a tiny BERT: the script's code cannot rot
unnoticed between GPU runs. The same for benchmarks/gpu_llm.py (a tiny Llama)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_env

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_benchmark_runs_its_three_variants_in_smoke_mode(tmp_path):
    """Each variant in its own process, as on the GPU, at batch 8 (the batch search is the next test's)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_trainer.py"), "--smoke", "--steps", "12",
                           "--repeats", "1", "--batch", "8", "--json", str(out)],
                          capture_output=True, text=True, env=cli_env(), timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| bare", "| transformers", "| hf_backend"], proc.stdout
    results = json.loads(out.read_text())
    assert results["batch"] == 8 and results["seq"] == 128 and "failures" not in results
    assert "batch 8: fits all three" not in proc.stdout  # given, not searched
    for variant, runs in results["runs"].items():
        assert [run["steps"] for run in runs] == [12], variant
        assert runs[0]["samples_per_s"] > 0 and runs[0]["first_step_s"] > 0 and runs[0]["peak_gib"] is None


def test_the_gpu_benchmarks_batch_search_takes_the_largest_batch_every_variant_fits(monkeypatch, capsys):
    """The search doubles the batch from 8 while every variant runs 3 steps, stops at the first out-of-memory or at
    --max-batch, and stops the benchmark at a failure that is not memory (its runs faked here: on the CPU nothing
    runs out of memory, and the previous test runs the variants' processes)."""
    spec = importlib.util.spec_from_file_location("gpu_trainer", ROOT / "benchmarks" / "gpu_trainer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    asked = []

    def run(variant, steps, batch, smoke=False):
        asked.append((variant, steps, batch))
        if variant == "hf_backend" and batch == 99:
            return {"error": "ImportError: no module"}
        return {"oom": variant == "transformers" and batch >= 32}

    monkeypatch.setattr(bench, "_run", run)
    assert bench._largest_batch(8, smoke=True) == 8 and {b for _, _, b in asked} == {8}
    assert bench._largest_batch(64, smoke=True) == 16
    assert {s for _, s, _ in asked} == {3}
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:] == ["batch 8: fits all three", "batch 16: fits all three",
                          "batch 32: out of memory in transformers"]
    monkeypatch.setattr(bench, "_run", lambda variant, steps, batch, smoke=False: run(variant, steps, 99))
    with pytest.raises(SystemExit) as stop:
        bench._largest_batch(8, smoke=True)
    assert "failed for another reason than memory" in str(stop.value) and "ImportError" in str(stop.value)


def test_too_few_steps_for_a_steady_state_is_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_trainer.py"), "--smoke", "--steps", "5"],
                          capture_output=True, text=True, env=cli_env(), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].endswith("--steps 5: samples/s is taken over the steps after the 10th; "
                                                 "give at least 12")


def test_the_llm_gpu_benchmark_runs_in_smoke_mode(tmp_path):
    """benchmarks/gpu_llm.py on a tiny Llama, full and LoRA: the bare loop, hf_backend.Trainer and
    TRL's SFTTrainer on the engine (the stock variants differ from these by their imports)."""
    out = tmp_path / "llm.json"
    variants = ["bare", "hf_backend", "trl_engine"]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_llm.py"), "--smoke",
                           "--steps", "5", "--variants", *variants, "--json", str(out)],
                          capture_output=True, text=True, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split(" | ")[:2] for line in proc.stdout.splitlines()
            if line.startswith("| ") and "variant" not in line]
    expected = [[f"| {mode}", variant] for mode in ("full", "lora") for variant in variants]
    assert rows == expected, proc.stdout
    results = json.loads(out.read_text())
    assert results["seq"] == 64 and "failures" not in results
    for mode, adapter in (("full", False), ("lora", True)):
        for variant in variants:
            [run] = results["runs"][mode][variant]
            assert run["steps"] == 5 and run["tokens_per_s"] > 0 and run["first_step_s"] > 0
            assert (run["trainable"] < run["parameters"]) is adapter and run["peak_gib"] is None


def test_the_sequence_memory_benchmark_runs_and_splits_the_memory(tmp_path):
    """benchmarks/sequence_memory.py on short sequences, one process against cp 2 (the ring): its table and JSON, and
    a step that takes less memory per rank on 2 ranks than on one."""
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sequence_memory.py"), "--lengths", "1024,2048",
                           "--settings", "one process,cp 2", "--json", str(out)],
                          capture_output=True, text=True, env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    one, cp = results["one process"]["2048"]["step_mib"], results["cp 2"]["2048"]["step_mib"]
    assert 0 < cp < 0.75 * one, (one, cp)
    assert results["cp 2"]["planned_mib"] < results["one process"]["planned_mib"]


def test_the_logits_memory_benchmark_runs_and_the_chunks_hold_a_fraction(tmp_path):
    """benchmarks/logits_memory.py at a smaller size (vocabulary 65,536, 2,048 tokens: 512 MiB of fp32 logits), the
    Trainer on the whole logits against its default: under a quarter of the peak, the same losses and parameters
    within 1e-6."""
    out = tmp_path / "logits.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "logits_memory.py"), "--vocab", "65536",
                           "--tokens", "2048", "--variants", "hf_backend chunked_loss=False,hf_backend",
                           "--json", str(out)], capture_output=True, text=True, env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    whole, chunked = runs["hf_backend chunked_loss=False"], runs["hf_backend"]
    assert 0 < chunked["step_mib"] < 0.25 * whole["step_mib"], (whole, chunked)
    assert len(chunked["losses"]) == 2 and chunked["loss_difference"] <= 1e-6
    assert chunked["parameter_difference"] <= 1e-6
