"""TRL's online trainers on the engine (issue 42): GRPOTrainer and RLOOTrainer through `hf_backend.on_engine`, which
sample completions with `generate` inside the training loop (from the sharded model where it is sharded), score them,
gather the rewards with `accelerate.utils.gather_object`, keep a reference model (beta > 0) prepared the way TRL
prepares it, and seed each rank with `set_seed(seed, device_specific=True)`. Against stock TRL (transformers' Trainer
on Accelerate) in one and two processes; under DDP, FSDP2 (full and sharded checkpoints), ZeRO-2 and ZeRO-3, with
LoRA; checkpoints resumed under another strategy; and TRL's vLLM weight sync (server mode) streaming the full, merged
weights into a stand-in receiver (tests/scripts/trl_grpo.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import difference_to_largest as relative
from helpers import run_script

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

SCRIPT = "trl_grpo.py"
KL = ["--beta", "0.1"]


def run(tmp: Path, name: str, args: list[str], nproc: int = 1, env: dict[str, str] | None = None) -> dict:
    out = tmp / f"{name}.json"
    run_script(SCRIPT, ["--out", str(out), "--output-dir", str(tmp / name), *args], nproc=nproc, env=env,
               timeout=300)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("grpo")
    stock_cpu = {"ACCELERATE_USE_CPU": "1"}  # stock Accelerate counts one process per rank on a CPU without it
    done = {
        "stock_1": run(tmp, "stock_1", ["--stock", *KL]),
        "engine_1": run(tmp, "engine_1", [*KL, "--sync-weights"]),
        "stock_2": run(tmp, "stock_2", ["--stock", *KL], nproc=2, env=stock_cpu),
        "ddp": run(tmp, "ddp", KL, nproc=2),
        "fsdp": run(tmp, "fsdp", [*KL, "--fsdp", "--sync-weights"], nproc=2),
        "fsdp_sharded": run(tmp, "fsdp_sharded", [*KL, "--fsdp", "--sharded", "--save-steps", "2"], nproc=2),
        "zero2": run(tmp, "zero2", [*KL, "--zero", "2"], nproc=2),
        "zero3": run(tmp, "zero3", [*KL, "--zero", "3", "--save-steps", "2", "--sync-weights"], nproc=2),
        "lora": run(tmp, "lora", [*KL, "--lora"], nproc=2),
        "zero3_lora": run(tmp, "zero3_lora", [*KL, "--zero", "3", "--lora", "--sync-weights"], nproc=2),
        "rloo_stock": run(tmp, "rloo_stock", ["--rloo", "--stock", *KL]),
        "rloo_engine": run(tmp, "rloo_engine", ["--rloo", *KL]),
        "rloo_zero3": run(tmp, "rloo_zero3", ["--rloo", "--zero", "3", *KL], nproc=2),
    }
    done["zero3_on_fsdp"] = run(tmp, "zero3_on_fsdp", [*KL, "--fsdp", "--resume", str(tmp / "zero3" / "checkpoint-2")],
                                nproc=2)
    done["fsdp_on_zero3"] = run(tmp, "fsdp_on_zero3", [*KL, "--zero", "3", "--resume",
                                                       str(tmp / "fsdp_sharded" / "checkpoint-2")], nproc=2)
    return done


def test_grpo_logs_stock_trls_rewards_and_losses_in_one_and_two_processes(runs) -> None:
    """The same seed gives the same completions, rewards, KL, losses and parameters as stock TRL: 1e-6 in one
    process, 1e-5 in two (rank 1 seeds with seed + 1, as under Accelerate)."""
    for stock, engine, tolerance in (("stock_1", "engine_1", 1e-6), ("stock_2", "ddp", 1e-5)):
        a, b = runs[stock], runs[engine]
        assert len(b["losses"]) == 4 and b["world_size"] == a["world_size"]
        for key in ("losses", "rewards", "kl", "lengths", "params"):
            assert relative(b[key], a[key]) < tolerance, (engine, key, a[key][:8], b[key][:8])
    assert runs["ddp"]["rewards"] != runs["engine_1"]["rewards"]  # two ranks sample differently from one


@pytest.mark.parametrize("name", ["fsdp", "fsdp_sharded", "zero2", "zero3"])
def test_grpo_trains_the_same_under_every_strategy(runs, name) -> None:
    """Generation from the sharded model (FSDP2 all-gathers in each forward, in step on every rank; ZeRO-3's
    parameters gathered by TRL's unwrap_model_for_generation), the reference model prepared by TRL's prepare_fsdp /
    prepare_deepspeed on the engine's state: DDP's rewards and losses."""
    ddp, other = runs["ddp"], runs[name]
    assert other["rewards"] == ddp["rewards"]
    for key in ("losses", "kl", "params"):
        assert relative(other[key], ddp[key]) < 1e-5, (name, key)


def test_grpo_with_lora_under_ddp_and_zero3(runs) -> None:
    """The reference is the policy with its adapter disabled; only the adapter trains. (AdamW on a fresh adapter
    magnifies the last bits of ZeRO-3's reduction order: 2e-5 of the largest value after 4 steps.)"""
    lora, zero3 = runs["lora"], runs["zero3_lora"]
    assert lora["trainable"] and all("lora_" in n for n in lora["trainable"])
    assert zero3["rewards"] == lora["rewards"] and relative(zero3["losses"], lora["losses"]) < 1e-6
    assert relative(zero3["params"], lora["params"]) < 5e-5
    assert lora["kl"][0] == 0.0 and lora["kl"][-1] > 0.0


@pytest.mark.parametrize(("resumed", "source"), [("zero3_on_fsdp", "zero3"), ("fsdp_on_zero3", "fsdp_sharded")])
def test_grpo_checkpoints_resume_exactly_under_another_strategy(runs, resumed, source) -> None:
    """Saved after step 2, resumed under the other strategy: steps 3 and 4 sample the same completions (each rank's
    RNG state is in the checkpoint) and end with the uninterrupted run's parameters."""
    a, b = runs[source], runs[resumed]
    assert b["rewards"] == a["rewards"]
    assert relative(b["losses"][2:], a["losses"][2:]) < 1e-5
    assert relative(b["params"], a["params"]) < 1e-5


@pytest.mark.parametrize("name", ["engine_1", "fsdp", "zero3", "zero3_lora"])
def test_vllm_weight_sync_streams_the_full_weights_under_vllms_names(runs, name) -> None:
    """TRL's server-mode sync on the engine: every rank takes part in the gathers, rank 0 announces then streams
    each tensor once, under the base model's names (what vLLM's loader reads), full (gathered from FSDP2's shards
    or ZeRO-3's partitions) and with a LoRA adapter merged; the prefix cache is reset once."""
    sync = runs[name]["sync"]
    assert sorted(sync["names"]) == sync["expected"] and len(set(sync["names"])) == len(sync["names"])
    assert [m[0] for m in sync["metadata"]] == sync["names"]
    assert not any("lora_" in n or "base_layer" in n for n in sync["names"])
    assert sync["largest_difference"] < 1e-6 and sync["reset"] == 1


def test_rloo_on_the_engine(runs) -> None:
    stock, engine, zero3 = runs["rloo_stock"], runs["rloo_engine"], runs["rloo_zero3"]
    assert engine["rewards"] == stock["rewards"] and relative(engine["params"], stock["params"]) < 1e-6
    assert zero3["rewards"] == runs["ddp"]["rewards"]  # the same sampling as GRPO's on 2 ranks
