"""QLoRA on bitsandbytes' CUDA kernels and a compiled step with inductor's GPU kernels (issue 45's GPU lane): the same
scripts the CPU tests run (tests/test_qlora.py, tests/test_compile.py), here on the local GPU in one process."""

from __future__ import annotations

import pytest
from helpers import difference_to_largest as relative
from helpers import run_report
from test_llm import run


def test_qlora_on_cuda_is_peft_on_stock_transformers(tmp_path) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    qlora = ["--qlora", "4", "--lora", "--batch-size", "8"]
    stock, ours = run(tmp_path, "stock", [*qlora, "--stock"], nproc=1), run(tmp_path, "ours", qlora, nproc=1)
    assert ours["trainable"] == stock["trainable"] and all("lora_" in name for name in ours["trainable"])
    assert relative(ours["losses"], stock["losses"]) < 1e-4
    assert relative(ours["params"], stock["params"]) < 1e-4
    assert ours["losses"][-1] < ours["losses"][0]
    for step, files in ours["checkpoints"].items():
        assert "adapter_model.safetensors" in files and "model.safetensors" not in files, (step, files)


@pytest.mark.parametrize("mode", ["regional", "whole"])
def test_inductor_on_cuda_trains_as_eagerly(tmp_path, mode) -> None:
    # SGD: an update proportional to the gradient, so inductor's other summation order stays at its own size
    common = ["--grid", "single", "--optimizer", "sgd"]
    eager = run_report("compile_loop.py", tmp_path / "eager.json", [*common, "--compile", "eager"], timeout=600)
    compiled = run_report("compile_loop.py", tmp_path / f"{mode}.json",
                          [*common, "--compile", mode, "--backend", "inductor"], timeout=600)
    print(f"inductor on cuda, {mode}: first step {compiled['seconds'][0]:.1f} s, then "
          f"{min(compiled['seconds'][1:]) * 1e3:.1f} ms (eager {min(eager['seconds'][1:]) * 1e3:.1f} ms)")
    assert relative(compiled["losses"], eager["losses"]) < 1e-4
    for name, values in eager["params"].items():
        assert relative(compiled["params"][name], values) < 1e-4, name
    graphs = compiled["graphs"]
    assert graphs == [graphs[0]] * len(graphs), graphs
