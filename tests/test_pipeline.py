"""Pipeline parallelism's stages and schedules (hf_backend/strategies/pipeline.py; issue 56's first part), against one
process: tests/scripts/pp_loop.py on pp 2, pp 4 and pp 2 x dp_shard 2 (FSDP2 inside each stage), a tiny Llama and a tiny
dense Qwen3 of two decoder layers a stage, each schedule 2 SGD steps with clipping, every step's loss and clipped norm
and the parameters at the end within 1e-5 of one process's on the same global batch; an Accelerate loop on the engine
(`accelerator.forward_backward`, tests/scripts/pp_accelerate.py) the same way; then the layout, the bubble, the settings
and the one-line refusals."""

from __future__ import annotations

import re

import pytest
from helpers import run_report

pytest.importorskip("transformers")

TOLERANCE = 1e-5
# grid (pp, dp_replicate, dp_shard, tp) -> its schedules
SCHEDULES = {(2, 1, 1, 1): ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
             (4, 1, 1, 1): ["GPipe", "1F1B", "Interleaved1F1B"],
             (2, 1, 2, 1): ["GPipe", "1F1B", "Interleaved1F1B"],
             (2, 1, 1, 2): ["GPipe", "1F1B", "Interleaved1F1B"],
             (2, 1, 2, 2): ["1F1B"],  # FSDP over tp shards in each stage
             (2, 2, 2, 1): ["GPipe", "1F1B", "Interleaved1F1B"]}


def _grid(pp: int, replicate: int, shard: int, tp: int) -> str:
    sizes = {"dp_replicate": replicate, "dp_shard": shard, "tp": tp}
    return f"pp{pp}" + "".join(f"x{name}{size}" for name, size in sizes.items() if size > 1)


# the FSDP x tp stages once, on the model whose tp plan gathers heads (Qwen3's q_norm, k_norm)
MODELS = {sizes: ("qwen3",) if sizes == (2, 1, 2, 2) else ("llama", "qwen3") for sizes in SCHEDULES}
CASES = [(_grid(*sizes), model, schedule)
         for sizes, names in SCHEDULES.items() for model in MODELS[sizes] for schedule in names]
GRIDS = {_grid(*sizes): sizes for sizes in SCHEDULES}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root, done = tmp_path_factory.mktemp("pp"), {}

    def report(grid: str) -> dict:
        if grid not in done:
            sizes = GRIDS[grid]
            pp, replicate, shard, tp = sizes
            done[grid] = run_report("pp_loop.py", root / f"{grid}.json", [
                "--schedules", ",".join(SCHEDULES[sizes]), "--dp-replicate", str(replicate), "--dp-shard", str(shard),
                "--tp", str(tp), "--models", ",".join(MODELS[sizes]),
                "--microbatches", str(min(4, 8 // (replicate * shard)))],  # 8 rows a step over the dp ranks
                nproc=pp * replicate * shard * tp, timeout=300)
        return done[grid]

    return report


@pytest.mark.parametrize(("grid", "model", "schedule"), CASES)
def test_a_schedule_trains_as_one_process(reports, grid, model, schedule) -> None:
    report = reports(grid)
    run = report["runs"][f"{model}/{schedule}"]
    assert len(run["losses"]) == 2 and run["losses"][0] != run["losses"][1]
    assert run["loss"] <= TOLERANCE, (run["losses"], run["reference"])
    assert run["norm"] <= TOLERANCE and run["params"] <= TOLERANCE, run
    assert run["parameters_held"] == run["parameters"]  # every parameter in exactly one stage
    # rank r is (pp r // n, the rest r % n) with n = dp_shard x tp: the n ranks of a pp rank hold its stages
    dp = report["per_pp_rank"]
    assert all(rank == run["ranks"][i - i % dp] for i, rank in enumerate(run["ranks"]))
    ranks = run["ranks"][::dp]
    assert sorted(stage for rank in ranks for stage in rank["stages"]) == list(range(ranks[0]["num_stages"]))
    assert sorted(block for rank in ranks for part in rank["blocks"] for block in part) == list(range(report["layers"]))


def test_the_layout_splits_the_blocks_evenly_and_places_the_stages() -> None:
    from hf_backend.strategies.pipeline import layout

    assert layout("1F1B", 2, 1, 8) == (2, (1,), (range(0, 4), range(4, 8)))
    assert layout("GPipe", 3, 0, 8).blocks == (range(0, 2), range(2, 5), range(5, 8))  # the first stage embeds too
    assert layout("GPipe", 3, 0, 7).blocks == (range(0, 2), range(2, 5), range(5, 7))
    assert layout("Interleaved1F1B", 2, 0, 8).stages == (0, 2)
    assert layout("Interleaved1F1B", 2, 1, 12, stages_per_rank=3).stages == (1, 3, 5)
    assert layout("ZBVZeroBubble", 2, 0, 8).stages == (0, 3)  # V: the first and the last stage on rank 0
    assert layout("DualPipeV", 4, 1, 8).stages == (1, 6)


def test_the_bubble_of_each_schedule() -> None:
    from hf_backend.strategies.pipeline import bubble_fraction

    assert bubble_fraction("GPipe", 2, 4, 1) == bubble_fraction("1F1B", 2, 4, 1) == pytest.approx(1 / 5)
    assert bubble_fraction("1F1B", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("InterleavedZeroBubble", 2, 4, 2) == 0.0


def test_what_cannot_be_split_is_one_line() -> None:
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    from hf_backend.core.errors import ConfigError
    from hf_backend.strategies.pipeline import check_splittable, layout

    with pytest.raises(ConfigError, match="needs at least 8 decoder layers; the model has 4"):
        layout("Interleaved1F1B", 4, 0, 4)
    with pytest.raises(ConfigError, match="pp_schedule='2F2B' is not one of"):
        layout("2F2B", 2, 0, 4)
    with pytest.raises(ConfigError, match="BertModel has no base_model_pp_plan"):
        check_splittable(BertModel(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=8)))
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                                        num_attention_heads=2, tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="ties its embeddings to its head.*tie_word_embeddings=False"):
        check_splittable(tied)


# -- on the engine: an Accelerate loop with one changed line (tests/scripts/pp_accelerate.py) -------------------------
ENGINE = {"pp2-1F1B": (2, ["--schedule", "1F1B"]),
          "pp2xdp_shard2-Interleaved1F1B-accumulate2": (4, ["--dp-shard", "2", "--schedule", "Interleaved1F1B",
                                                            "--accumulate", "2", "--microbatches", "2"]),
          "pp2xtp2-1F1B": (4, ["--tp", "2", "--schedule", "1F1B"]),
          **{f"pp2xcp2-{schedule}-{model}": (4, ["--cp", "2", "--schedule", schedule, "--model", model])
             for model in ("llama", "qwen3") for schedule in ("GPipe", "1F1B", "Interleaved1F1B")},
          "pp2xsp2-1F1B": (4, ["--sp", "2", "--schedule", "1F1B"]),
          "pp2xdp_replicate2xdp_shard2-Interleaved1F1B": (8, ["--dp-replicate", "2", "--dp-shard", "2", "--schedule",
                                                              "Interleaved1F1B", "--microbatches", "2"]),
          # autocast per stage over fp32 masters, against one process under autocast
          "pp2-1F1B-bf16": (2, ["--schedule", "1F1B", "--mixed-precision", "bf16"])}
BF16 = 5e-3  # bf16's rounding of other matmul shapes (the microbatches') over 2 steps


@pytest.mark.parametrize("case", list(ENGINE))
def test_an_accelerate_loop_trains_on_pipeline_stages_as_one_process(case, tmp_path) -> None:
    nproc, args = ENGINE[case]
    run = run_report("pp_accelerate.py", tmp_path / "r.json", args, nproc=nproc, timeout=300)
    tolerance = BF16 if "bf16" in args else TOLERANCE
    assert len(run["losses"]) == len(run["reference"]) and len(run["norms"]) == 2
    assert max(abs(a - b) for a, b in zip(run["losses"], run["reference"])) <= tolerance, run
    assert max(abs(a - b) for a, b in zip(run["norms"], run["reference_norms"])) <= tolerance, run
    assert run["params"] <= tolerance and run["dtypes"] == ["torch.float32"]
    assert run["held"] < 0.55 * run["parameters"]  # rank 0 holds its stages only
    if any(flag in args for flag in ("--tp", "--dp-shard", "--cp", "--sp")):  # and of them its shards
        assert run["local"] < 0.6 * run["held"]
    assert run["eval_loss"] <= tolerance and run["eval_logits"] <= 2 * tolerance, run
    model_call, backward, shorter = run["refusals"]
    assert "loss = accelerator.forward_backward(model, batch) instead of model(**batch)" in model_call
    assert backward.startswith("accelerator.backward under pipeline parallelism")
    split = "context" if "--cp" in args else "sequence" if "--sp" in args else None
    if split:  # cut into slices first, the 11 tokens are refused there
        assert shorter.startswith(f"{split} parallelism: a sequence of 11 tokens does not split over"), shorter
    else:
        assert re.match(r"pipeline stages: a batch of (\d) x 11 tokens after batches of \1 x 12; every batch", shorter)


# -- checkpoints: a chain of runs, each resuming the one before on another layout (tests/scripts/pp_resume.py) ---------
# (grid, processes, what save_state writes); run i trains steps 2i+1 and 2i+2
CHAIN = [("single", 1, "full"), ("pp2", 2, "sharded"), ("fsdp2", 2, "sharded"), ("pp2", 2, "full"),
         ("single", 1, "full"), ("pp2xdp_shard2", 4, "sharded"), ("pp4", 4, "sharded")]
LINKS = [f"{a}-{state}->{b}" for (a, _, state), (b, _, _) in zip(CHAIN, CHAIN[1:])]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root, reports = tmp_path_factory.mktemp("pp-resume"), []
    for i, (grid, nproc, state) in enumerate(CHAIN):
        args = ["--grid", grid, "--trained", str(2 * i), "--save", str(root / str(i)), "--state", state]
        args += ["--load", str(root / str(i - 1))] if i else []
        args += ["--model-dir", str(root / "model")] if i == 1 else []
        reports.append(run_report("pp_resume.py", root / f"{i}.json", args, nproc=nproc, timeout=300))
    return root, reports


@pytest.mark.parametrize("link", LINKS)
def test_a_checkpoint_resumes_on_another_layout_as_one_process(chain, link) -> None:
    """AdamW's state, the scheduler's and the weights, full or sharded, from and into pipeline stages: the resumed
    steps' losses within 1e-5 of one process that never stopped."""
    run = chain[1][LINKS.index(link) + 1]
    assert len(run["losses"]) == 2
    assert max(abs(a - b) for a, b in zip(run["losses"], run["reference"])) <= TOLERANCE, run


def test_a_pipeline_checkpoint_consolidates_into_the_model_save_model_writes(chain) -> None:
    """pp 2's sharded checkpoint (each rank its stages' shards) consolidates into one whole model, the one
    `save_model` wrote from the same run (its stages gathered), which is one process's within 1e-5."""
    from safetensors.torch import load_file

    from hf_backend.checkpoint.consolidate import consolidate

    root, reports = chain
    assert reports[1]["saved"] and reports[1]["params"] <= TOLERANCE
    consolidate(root / "1", root / "whole")
    whole, saved = load_file(root / "whole" / "model.safetensors"), load_file(root / "model" / "model.safetensors")
    assert sorted(whole) == sorted(saved) and len(whole) == 75
    assert all(bool((whole[name] == saved[name]).all()) for name in whole)


# -- hf_backend.Trainer on pipeline stages (tests/scripts/llm_trainer.py) ----------------------------------------------
# 4 AdamW steps of 2 micro steps with clipping, padded rows of uneven lengths (width 24: one shape a run), then
# evaluate and predict on 16 held-out rows
TRAINER = ["--steps", "4", "--pad-multiple", "24", "--grad-accum", "2"]
TRAINER_GRIDS = {"pp2-1F1B": (2, ["--pp", "2", "--batch-size", "8", "--save-final", "--save-steps", "10", "--eval"]),
                 "pp2xdp_shard2-GPipe": (4, ["--pp", "2", "--grid", "1x2", "--schedule", "GPipe", "--batch-size", "4",
                                             "--save-steps", "2", "--eval"]),
                 # (no evaluation: gather_for_metrics is refused under cp, with or without pp)
                 "pp2xcp2-1F1B": (4, ["--pp", "2", "--grid", "1x1x1x2", "--batch-size", "8", "--save-steps", "10"]),
                 # no parallelism_config: what `hf-backend launch --parallelism_config_pp_size 2` sets
                 "launched-pp2": (2, ["--batch-size", "8", "--save-steps", "10"])}
LAUNCHED = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_PP_SIZE": "2"}


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-trainer")
    runs = {"one": run_report("llm_trainer.py", root / "one.json", ["--output-dir", str(root / "one"),
                                                                    "--batch-size", "8", "--save-steps", "10",
                                                                    "--eval", *TRAINER])}
    for name, (nproc, args) in TRAINER_GRIDS.items():
        runs[name] = run_report("llm_trainer.py", root / f"{name}.json", ["--output-dir", str(root / name), *args,
                                                                          *TRAINER], nproc=nproc, timeout=300,
                                env=LAUNCHED if name.startswith("launched") else None)
    return root, runs


@pytest.mark.parametrize("grid", list(TRAINER_GRIDS))
def test_the_trainer_trains_and_evaluates_on_pipeline_stages_as_one_process(trainers, grid) -> None:
    """hf_backend.Trainer with TrainingArguments(parallelism_config=ParallelismConfig(pp_size=2, ...)), unchanged:
    the logged losses and gradient norms, the parameters, the evaluation loss and predict's logits (padding
    included: the mask goes to every stage) within 1e-5 of one process on the same global batch."""
    one, many = trainers[1]["one"], trainers[1][grid]
    assert len(many["losses"]) == 4 and many["trainable"] == one["trainable"]
    for key in ("losses", "grad_norms"):
        assert max(abs(a - b) for a, b in zip(one[key], many[key], strict=True)) <= TOLERANCE, (key, one, many)
    assert max(abs(a - b) for a, b in zip(one["params"], many["params"], strict=True)) <= TOLERANCE
    if "eval_loss" not in many:
        return
    assert abs(one["eval_loss"] - many["eval_loss"]) <= TOLERANCE
    assert many["predictions"][0] == one["predictions"][0] == [16, 24, 48]
    assert max(abs(a - b) for a, b in zip(one["predictions"][1], many["predictions"][1], strict=True)) <= TOLERANCE


def test_the_trainers_pipeline_checkpoint_resumes_in_one_process_and_its_model_loads(trainers, tmp_path) -> None:
    """pp 2 x dp_shard 2's checkpoint-2 (each stage's shards) resumed by one process's Trainer: steps 3 and 4 as
    one process's; pp 2's `save_model` is a model directory from_pretrained loads, with one process's weights."""
    import torch
    from transformers import LlamaForCausalLM

    root, runs = trainers
    resumed = run_report("llm_trainer.py", tmp_path / "r.json", [
        "--output-dir", str(tmp_path / "r"), "--batch-size", "8", "--save-steps", "10", *TRAINER,
        "--resume", str(root / "pp2xdp_shard2-GPipe" / "checkpoint-2")])
    one = runs["one"]
    assert max(abs(a - b) for a, b in zip(resumed["losses"][2:], one["losses"][2:], strict=True)) <= TOLERANCE
    assert max(abs(a - b) for a, b in zip(resumed["params"], one["params"], strict=True)) <= TOLERANCE
    model = LlamaForCausalLM.from_pretrained(root / "pp2-1F1B" / "final")
    flat = torch.cat([p.detach().flatten() for _, p in sorted(model.named_parameters())])
    assert (flat - torch.tensor(one["params"])).abs().max() <= TOLERANCE


def test_what_the_trainer_cannot_run_through_stages_is_one_line() -> None:
    """A trainer with a loss of its own (TRL's trainers override compute_loss), compute_loss_func or label
    smoothing on pipeline stages: refused when the trainer is built (its check, on a stand-in for it)."""
    from types import SimpleNamespace

    from hf_backend import Trainer
    from hf_backend.core.errors import ConfigError
    from hf_backend.strategies.pipeline_strategy import PipelineStrategy

    class OwnLoss(Trainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    def built(cls, **args):
        trainer = object.__new__(cls)
        trainer.accelerator = SimpleNamespace(strategy=object.__new__(PipelineStrategy),
                                              parallelism_config=SimpleNamespace(pp_size=2))
        trainer.args = SimpleNamespace(**{"label_smoothing_factor": 0.0, "average_tokens_across_devices": True,
                                          **args})
        trainer.compute_loss_func = None
        return trainer

    built(Trainer).check_pipeline_fits()
    with pytest.raises(ConfigError, match="pp_size=2 with OwnLoss: it overrides compute_loss, which calls the model"):
        built(OwnLoss).check_pipeline_fits()
    with pytest.raises(ConfigError, match="pp_size=2 with Trainer: compute_loss_func and label_smoothing_factor"):
        built(Trainer, label_smoothing_factor=0.1).check_pipeline_fits()


def test_pipeline_settings_are_read_once_and_checked(monkeypatch) -> None:
    from hf_backend import ParallelismConfig
    from hf_backend.core.errors import ConfigError
    from hf_backend.parallel.dims import MeshShape

    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SCHEDULE", "GPipe")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_MICROBATCHES", "8")
    config = ParallelismConfig(dp_shard_size=2)
    assert (config.pp_size, config.pp_schedule, config.pp_microbatches, config.pp_enabled) == (2, "GPipe", 8, True)
    shape = config.shape(4)
    assert shape == MeshShape(dp_shard=2, pp=2, pp_schedule="GPipe", pp_microbatches=8)
    assert shape.describe() == "pp 2 x dp_shard 2" and shape.batch_replicas == 2 and shape.needs_mesh
    assert ParallelismConfig.of_shape(shape).to_json()["pp_size"] == 2
    with pytest.raises(ConfigError, match="pp_size 2 x dp_shard_size 2 makes 4 processes, but 2 run"):
        config.shape(2)
    with pytest.raises(ConfigError, match="pp_size=2 with ep_size=2: pipeline stages compose with dp_replicate_size, "
                                          "dp_shard_size, tp_size, cp_size and sp_size so far"):
        ParallelismConfig(dp_shard_size=2, ep_size=2)
    with pytest.raises(ConfigError, match="pp_schedule='2F2B': use one of GPipe, 1F1B"):
        ParallelismConfig(pp_schedule="2F2B")


def test_forward_backward_without_pipeline_stages_is_one_line() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_backend import Accelerator
    from hf_backend.core.errors import HfBackendError

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                                                             num_hidden_layers=1, num_attention_heads=2)))
    with pytest.raises(HfBackendError, match="forward_backward and forward_only run a pipeline schedule: they need "
                                             r"ParallelismConfig\(pp_size=...\) above 1"):
        accelerator.forward_backward(model, {"input_ids": torch.ones(1, 4, dtype=torch.long)})


def test_the_plan_prices_each_stage_and_holds_to_the_measured_bytes(chain) -> None:
    """`hf-backend plan` on pp 2: each rank's stages and bytes, the most loaded rank's figures; its parameters plus
    AdamW's state within 10% of the most any rank of the chain's pp 2 run held, which is at most 0.55x one
    process's (the chain's first run)."""
    import torch
    from pp_loop import tiny

    from hf_backend.cli.plan_cmd import parse_sizes
    from hf_backend.plan.memory import plan_memory

    with torch.device("meta"):
        model = tiny("llama")
    plan = plan_memory(model, "fsdp", 2, shape=parse_sizes("pp=2"))
    one = plan_memory(model, "no", 1)
    assert plan.notes[-1] == ("pp 2 (1F1B): rank 0 stages [0]: 38,656 parameters, 9.6 MiB; rank 1 stages [1]: "
                              "38,688 parameters, 5.3 MiB; the figures are the most loaded, rank 0's")
    measured, alone = chain[1][1]["bytes"], chain[1][0]["bytes"]
    assert measured <= 0.55 * alone and alone == one.parameter_bytes + one.optimizer_bytes
    assert abs(plan.parameter_bytes + plan.optimizer_bytes - measured) <= 0.1 * measured


def test_a_config_files_pp_keys_reach_every_process_as_one_value(monkeypatch) -> None:
    """`parallelism_config:` pp keys (also `hf-backend launch` flags) travel in PARALLELISM_CONFIG_PP_*, which
    ParallelismConfig reads; the launcher's 0 microbatches is the default, one per stage."""
    from hf_backend import ParallelismConfig
    from hf_backend.config import environment
    from hf_backend.config.loader import validate
    from hf_backend.core.errors import ConfigError

    config = validate({"distributed_type": "FSDP", "num_processes": 4, "use_cpu": True, "parallelism_config": {
        "parallelism_config_pp_size": 2, "parallelism_config_dp_shard_size": 2,
        "parallelism_config_pp_schedule": "Interleaved1F1B"}})
    with pytest.raises(ConfigError, match="parallelism_config_pp_schedule"):
        validate({"parallelism_config": {"parallelism_config_pp_schedule": "2F2B"}})
    variables = environment.to_environment(config)
    assert variables["PARALLELISM_CONFIG_PP_SIZE"] == "2"
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_MICROBATCHES", "0")
    read = ParallelismConfig()
    assert (read.pp_size, read.dp_shard_size, read.pp_schedule, read.pp_microbatches) == (2, 2, "Interleaved1F1B", None)
