"""torch.compile on the engine (tests/scripts/compile_loop.py): a tiny Llama compiled whole or by regions
(`TorchDynamoPlugin(use_regional_compilation=True)`: each decoder layer compiled in place,
hf_backend/strategies/compile.py) trains as eagerly under DDP, FSDP2, tp 2 (inside FSDP2 over 2: 4 processes), cp 2
and ZeRO-3, step by step, with the same collectives: FSDP2's all-gather before each unit's forward and reduce-scatter
after its backward run as often as in eager mode, so a compiled block that skipped FSDP's hooks would fail here.
(Tensor parallelism's own all-reduces run inside the compiled graphs, where no Python call counts them: its losses,
norms and parameters show them.)"""

from __future__ import annotations

import pytest
from helpers import difference_to_largest as relative
from helpers import run_report

SCRIPT = "compile_loop.py"
GRIDS = {"ddp": "ddp", "fsdp": "fsdp", "tp2": "1x2x2", "cp2": "1x1x1x2", "zero3": "zero3"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(grid, mode, backend="aot_eager", optimizer="adamw"): the report of that run, each run once per module."""
    tmp, done = tmp_path_factory.mktemp("compile"), {}

    def report(grid: str, mode: str, backend: str = "aot_eager", optimizer: str = "adamw") -> dict:
        key = (grid, mode, backend, optimizer)
        if key not in done:
            done[key] = run_report(SCRIPT, tmp / f"{'-'.join(key)}.json", [
                "--grid", GRIDS[grid], "--compile", mode, "--backend", backend, "--optimizer", optimizer],
                nproc=4 if grid == "tp2" else 2, timeout=600)
        return done[key]

    return report


def assert_as_eager(compiled: dict, eager: dict) -> None:
    """Losses, clipped norms and the parameters at the end within 1e-5; the same collectives at every step."""
    for step, (a, b) in enumerate(zip(compiled["losses"], eager["losses"], strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    assert relative(compiled["norms"], eager["norms"]) < 1e-5
    for name, values in eager["params"].items():
        assert relative(compiled["params"][name], values) < 1e-5, name
    assert compiled["collectives"] == eager["collectives"]  # every step, every kind
    graphs = compiled["graphs"]
    assert graphs[0] > 0 and graphs == [graphs[0]] * len(graphs), graphs  # a fixed shape compiles once


@pytest.mark.parametrize("grid", list(GRIDS))
def test_compiled_training_is_eager_training(run, grid) -> None:
    eager = run(grid, "eager")
    kinds = eager["collectives"][0]
    if grid in ("fsdp", "tp2", "cp2"):
        assert kinds["all_gather_single"] >= 3 and kinds["reduce_scatter_single"] == 3, kinds  # 2 layers + the root
    elif grid == "ddp":
        assert kinds["ddp_bucket_all_reduce"] >= 1, kinds  # (DeepSpeed's own collectives are not counted)
    # DeepSpeed compiles a whole engine with its own `compile` (not run here: docs/engine.md); by regions is ours
    for mode in ("regional",) if grid == "zero3" else ("regional", "whole"):
        assert_as_eager(run(grid, mode), eager)


def test_regional_compilation_compiles_one_layer_graph(run) -> None:
    """Two decoder layers, one graph: the second layer reuses the first's."""
    regional, whole = run("fsdp", "regional"), run("fsdp", "whole")
    assert regional["graphs"][-1] < whole["graphs"][-1], (regional["graphs"], whole["graphs"])


def test_inductor_regional_compilation_under_fsdp(run) -> None:
    # SGD: inductor's kernels sum in another order, and AdamW's first steps would turn the 1e-7 differences of small
    # gradients into 1e-4 of the parameters (its update is about the sign of such a gradient)
    eager, compiled = run("fsdp", "eager", optimizer="sgd"), run("fsdp", "regional", "inductor", optimizer="sgd")
    print(f"inductor, by regions: first step {compiled['seconds'][0]:.1f} s, then "
          f"{min(compiled['seconds'][1:]) * 1e3:.0f} ms (eager {min(eager['seconds'][1:]) * 1e3:.0f} ms)")
    assert_as_eager(compiled, eager)


def test_compile_regions_compiles_each_repeated_block_in_place() -> None:
    import torch

    from hf_backend.utils import compile_regions, compile_regions_fsdp2, has_compiled_regions

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(4, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    model = Model()
    keys = list(model.state_dict())
    assert compile_regions(model, backend="eager") is model and has_compiled_regions(model)
    assert all(layer._compiled_call_impl is not None for layer in model.layers)
    assert model.embed._compiled_call_impl is None and list(model.state_dict()) == keys  # the rest stays eager
    calls = [layer._compiled_call_impl for layer in model.layers]
    compile_regions_fsdp2(model, backend="eager")  # compiled already: left as it is
    assert [layer._compiled_call_impl for layer in model.layers] == calls
