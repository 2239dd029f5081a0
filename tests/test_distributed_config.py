"""Models transformers sharded itself, `from_pretrained(dir, distributed_config=DistributedConfig(...))` (FSDP2,
FSDP2 x TP, HSDP), on the engine (issue 42, tests/scripts/distributed_config.py): the model's grid becomes the run's,
an Accelerator loop and hf_backend.Trainer train them as one process trains the whole model (the same global batch
of 8), their checkpoints resume on other grids and in one process, `save_pretrained(distributed_checkpoint=True)`
loads back with `from_pretrained`, and a grid other than the model's is one line."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from helpers import run_report, run_script

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed")

SCRIPT = "distributed_config.py"
GRIDS = {"fsdp": ("1,2,1", 2, 2), "fsdp_tp": ("1,2,2", 4, 2), "hsdp": ("2,2,1", 4, 4)}  # grid, processes, dp
LOSS, PARAMS = 1e-6, 2e-5  # per-step loss; parameters after 4 AdamW steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dc_model") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("dc_runs")

    def run(name: str, args: list[str], nproc: int = 1) -> dict:
        return run_report(SCRIPT, root / f"{name}.json", ["--model-dir", str(model_dir), *args], nproc=nproc,
                          timeout=300)

    done = {"one": run("one", []), "trainer_one": run("trainer_one", ["--trainer", "--output-dir", str(root / "t1")])}
    for name, (grid, nproc, _) in GRIDS.items():
        done[name] = run(name, ["--grid", grid, "--checkpoint", str(root / f"ck_{name}"), "--saved",
                                str(root / f"saved_{name}")], nproc)
    done["fsdp_in_one"] = run("fsdp_in_one", ["--resume", str(root / "ck_fsdp")])
    done["hsdp_on_fsdp_tp"] = run("hsdp_on_fsdp_tp", ["--grid", "1,2,2", "--resume", str(root / "ck_hsdp")], 4)
    for name in ("fsdp", "fsdp_tp"):
        grid, nproc, dp = GRIDS[name]
        extra = ["--checkpoint", "yes", "--saved", str(root / f"model_{name}")] if name == "fsdp" else []
        done[f"trainer_{name}"] = run(f"trainer_{name}", ["--grid", grid, "--trainer", "--data-parallel", str(dp),
                                                          "--output-dir", str(root / f"t_{name}"), *extra], nproc)
    done["trainer_resumed"] = run("trainer_resumed", [
        "--grid", "1,2,2", "--trainer", "--data-parallel", "2", "--output-dir", str(root / "t_resumed"), "--resume",
        str(root / "t_fsdp" / "checkpoint-2")], 4)
    return done


def _largest(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


def _steps(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(GRIDS))
def test_an_accelerator_loop_trains_the_model_on_its_grid_as_one_process(runs, name):
    one, run = runs["one"], runs[name]
    assert run["data_parallel"] == GRIDS[name][2]
    assert _steps(run["losses"], one["losses"]) <= LOSS
    assert _largest(run["params"], one["params"]) <= PARAMS
    assert _largest(run["reloaded"], run["params"]) == 0.0  # save_pretrained(distributed_checkpoint) -> load


def test_checkpoints_resume_in_one_process_and_on_another_grid(runs):
    one = runs["one"]
    for name in ("fsdp_in_one", "hsdp_on_fsdp_tp"):  # saved after step 2
        assert _steps(runs[name]["losses"], one["losses"][2:]) <= LOSS, name
        assert _largest(runs[name]["params"], one["params"]) <= PARAMS, name


def test_the_trainer_takes_the_grid_from_the_model_checkpoints_and_resumes(runs):
    """The Trainer's grid is the model's; it checkpoints these models (transformers.Trainer refuses to: it cannot
    save their optimizer state), a checkpoint resumes on another grid, and save_model writes full weights."""
    one = runs["trainer_one"]
    for name, grid in (("trainer_fsdp", [1, 2, 1]), ("trainer_fsdp_tp", [1, 2, 2]), ("trainer_resumed", [1, 2, 2])):
        run = runs[name]
        assert [run["grid"][k] for k in ("dp_replicate_size", "dp_shard_size", "tp_size")] == grid, name
        assert _steps(run["losses"], one["losses"]) <= LOSS, name
        assert _largest(run["params"], one["params"]) <= PARAMS, name
    assert _largest(runs["trainer_fsdp"]["reloaded"], runs["trainer_fsdp"]["params"]) == 0.0


def test_another_grid_than_the_models_is_one_line(model_dir, tmp_path):
    proc = run_script(SCRIPT, ["--out", str(tmp_path / "r.json"), "--model-dir", str(model_dir), "--grid", "1,2,1",
                               "--no-grid"], nproc=2, check=False)
    assert proc.returncode != 0
    assert ("prepare(): the model was sharded over dp_shard 2 by from_pretrained (distributed_config= or tp_plan=: "
            "transformers' own mesh over every process), but this run's grid is plain data parallelism (no mesh); "
            "build the Accelerator with parallelism_config=ParallelismConfig(dp_shard_size=2)") in proc.stderr


def test_pipeline_and_expert_parallel_configs_are_refused():
    from hf_backend.core.errors import ConfigError
    from hf_backend.parallel.dims import MeshShape, loaded_shape

    def model(**sizes):
        config = types.SimpleNamespace(dp_replicate_size=1, fsdp_size=2, tp_size=1, pp_size=1, ep_size=1)
        vars(config).update(sizes)
        return types.SimpleNamespace(is_distributed_loading_by_transformers=True,
                                     config=types.SimpleNamespace(distributed_config=config))

    assert loaded_shape(model()) == MeshShape(dp_shard=2)
    assert loaded_shape(types.SimpleNamespace(tp_size=2)) == MeshShape(tp=2)  # tp_plan before DistributedConfig
    assert loaded_shape(torch.nn.Linear(2, 2)) is None
    with pytest.raises(ConfigError, match=r"DistributedConfig\(pp_size=2\): .*set ParallelismConfig\(pp_size=2\)"):
        loaded_shape(model(pp_size=2))
    with pytest.raises(ConfigError, match=r"^the model was loaded with DistributedConfig\(ep_size=2\): hf_backend "
                                          r"splits the experts itself; load it without ep_size and set "
                                          r"ParallelismConfig\(ep_size=2\)$"):
        loaded_shape(model(ep_size=2))
