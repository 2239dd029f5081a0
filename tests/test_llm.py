"""Causal LMs on the engine: a tiny Llama with a LoRA adapter (peft) and with tied embeddings, trained by
hf_backend.Trainer under one process, DDP, FSDP2 (full and sharded checkpoints) and DeepSpeed ZeRO-3; checkpoints
that hold the adapter only and resume exactly across strategies and world sizes (tests/scripts/llm_trainer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import difference_to_largest as relative
from helpers import run_script

pytest.importorskip("peft")

SCRIPT = "llm_trainer.py"
TRAIN = ["--steps", "6", "--save-steps", "2"]


def run(tmp: Path, name: str, args: list[str], nproc: int = 2) -> dict:
    out = tmp / f"{name}.json"
    run_script(SCRIPT, ["--out", str(out), "--output-dir", str(tmp / name), *TRAIN, *args], nproc=nproc, timeout=300)
    return json.loads(out.read_text())



@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """LoRA under FSDP (full checkpoints); resumed from its step 2 under FSDP with sharded checkpoints; that run's
    step-4 checkpoint resumed in one process (the same global batch); ZeRO-3 and DDP with gradient checkpointing from
    the start; ZeRO-2 and ZeRO-3 resumed from DDP's step 2; ZeRO-3's step 4 (saved with async_save) resumed in one
    process."""
    tmp = tmp_path_factory.mktemp("lora")
    runs = {"fsdp": run(tmp, "fsdp", ["--lora", "--strategy", "fsdp", "--save-final"])}
    runs["fsdp_sharded"] = run(tmp, "fsdp_sharded", ["--lora", "--strategy", "fsdp_sharded",
                                                     "--resume", str(tmp / "fsdp" / "checkpoint-2")])
    runs["one"] = run(tmp, "one", ["--lora", "--batch-size", "8", "--resume",
                                   str(tmp / "fsdp_sharded" / "checkpoint-4")], nproc=1)
    runs["zero3"] = run(tmp, "zero3", ["--lora", "--strategy", "zero3", "--save-final", "--async-save"])
    runs["ddp_gc"] = run(tmp, "ddp_gc", ["--lora", "--gradient-checkpointing"])
    runs["zero2"] = run(tmp, "zero2", ["--lora", "--strategy", "zero2", "--resume",
                                       str(tmp / "ddp_gc" / "checkpoint-2")])
    runs["zero3_from_ddp"] = run(tmp, "zero3_from_ddp", ["--lora", "--strategy", "zero3", "--resume",
                                                         str(tmp / "ddp_gc" / "checkpoint-2")])
    runs["one_from_zero3"] = run(tmp, "one_from_zero3", ["--lora", "--batch-size", "8", "--resume",
                                                         str(tmp / "zero3" / "checkpoint-4")], nproc=1)
    return tmp, runs


def test_lora_trains_the_same_adapter_under_every_strategy(lora) -> None:
    _, runs = lora
    reference = runs["fsdp"]
    assert reference["trainable"] and all("lora_" in name for name in reference["trainable"])
    assert reference["losses"][-1] < reference["losses"][0]
    for name in ("zero3", "zero2", "ddp_gc"):
        assert runs[name]["trainable"] == reference["trainable"]
        assert relative(runs[name]["params"], reference["params"]) < 1e-5, name
        assert relative(runs[name]["grad_norms"], reference["grad_norms"]) < 1e-5, name  # trainable gradients only


def test_lora_resumes_exactly_across_strategies_and_world_sizes(lora) -> None:
    _, runs = lora
    reference = runs["fsdp"]
    # FSDP full -> FSDP sharded -> one process; DDP -> ZeRO-2 and ZeRO-3 (two param groups, one of them empty,
    # into DeepSpeed's one); ZeRO-3 -> one process
    for name in ("fsdp_sharded", "one", "zero2", "zero3_from_ddp", "one_from_zero3"):
        assert runs[name]["global_step"] == 6
        assert relative(runs[name]["params"], reference["params"]) < 1e-5, name


def test_lora_checkpoints_hold_the_adapter_not_the_frozen_base(lora) -> None:
    _, runs = lora
    for name in ("fsdp", "fsdp_sharded", "one", "zero3", "zero2", "ddp_gc", "zero3_from_ddp", "one_from_zero3"):
        for step, files in runs[name]["checkpoints"].items():
            assert "adapter_model.safetensors" in files, (name, step)
            assert not {"model.safetensors", "model_dcp", "pytorch_model.bin"} & set(files), (name, step, files)


SHARDED_FORM = {"optimizer_dcp": "optimizer.pt", "model_dcp": "model.safetensors"}  # FSDP's SHARDED_STATE_DICT


def _layouts(runs: dict[str, dict]) -> dict[tuple[str, ...], list[str]]:
    """Each distinct set of file names in the runs' checkpoints (each process's RNG file left out, shards named as
    the full file they stand for), and where."""
    found: dict[tuple[str, ...], list[str]] = {}
    for name, report in runs.items():
        for step, files in report["checkpoints"].items():
            names = tuple(sorted(SHARDED_FORM.get(f, f) for f in files if not f.startswith("rng_state")))
            found.setdefault(names, []).append(f"{name}/{step}")
    return found


def test_one_checkpoint_layout_under_every_strategy(lora, tied) -> None:
    """One process, DDP, FSDP (full and sharded) and ZeRO-2/3 write the same files: the weights (or the adapter),
    transformers' optimizer.pt (FSDP's shards under SHARDED_STATE_DICT) and scheduler.pt, the loader position and
    the manifest."""
    engine = {"optimizer.pt", "scheduler.pt", "dataloader.bin", "hf_backend_checkpoint.json", "trainer_state.json"}
    for runs, weights in ((lora[1], "adapter_model.safetensors"), (tied[1], "model.safetensors")):
        layouts = _layouts(runs)
        assert len(layouts) == 1, {files: where[:3] for files, where in layouts.items()}
        files = set(next(iter(layouts)))
        assert engine | {weights} <= files and not any(f.startswith("global_step") for f in files), files
    assert "optimizer_dcp" in lora[1]["fsdp_sharded"]["checkpoints"]["checkpoint-4"]
    from hf_backend.checkpoint.inspect import inspect_checkpoint

    for run_dir, name in ((lora[0], "zero3"), (lora[0], "fsdp_sharded"), (tied[0], "fsdp"), (tied[0], "zero3")):
        report = inspect_checkpoint(run_dir / name / "checkpoint-4")  # `hf-backend checkpoint inspect`
        assert report["verified"] and report["written_by"] == "hf_backend.Trainer", report["problem"]
        assert report["progress"]["scheduler_last_epoch"] == 4 and "exp_avg" in str(report["dtypes"]["optimizer"])
    from hf_backend import HfBackendError
    from hf_backend.checkpoint.consolidate import convert

    with pytest.raises(HfBackendError, match="is a Trainer checkpoint, which resumes in either form as it is"):
        convert(tied[0] / "fsdp" / "checkpoint-4", tied[0] / "converted", "sharded")


def test_lora_save_model_loads_in_peft(lora) -> None:
    from llm_trainer import tiny_llama
    from peft import PeftModel

    tmp, runs = lora
    for name in ("fsdp", "zero3"):
        model = PeftModel.from_pretrained(tiny_llama(tied=False), str(tmp / name / "final"))
        adapter = {n: p for n, p in model.named_parameters() if "lora_" in n}
        assert sorted(adapter) == runs[name]["trainable"]
        flat = torch.cat([p.detach().flatten() for _, p in sorted(adapter.items())]).tolist()
        assert relative(flat, runs[name]["params"]) < 1e-6, name


def test_consolidate_merges_the_adapter_into_its_base(lora, tmp_path, capsys) -> None:
    """`hf-backend checkpoint consolidate CHECKPOINT OUT --base BASE`: one model that from_pretrained loads, computing
    what the base with the adapter computes."""
    from llm_trainer import tiny_llama
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from hf_backend.cli.main import main

    run_dir, _ = lora
    tiny_llama(tied=False).save_pretrained(tmp_path / "base")  # the base the runs built, seeded alike
    checkpoint = run_dir / "fsdp_sharded" / "checkpoint-6"
    assert main(["checkpoint", "consolidate", str(checkpoint), str(tmp_path / "merged"), "--base",
                 str(tmp_path / "base")]) == 0
    assert "merged into" in capsys.readouterr().out
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    with_adapter = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "base"), str(checkpoint))
    ids = torch.arange(12)[None] % 48
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, with_adapter(ids).logits, atol=1e-5)
        assert not torch.allclose(merged(ids).logits, LlamaForCausalLM.from_pretrained(tmp_path / "base")(ids).logits,
                                  atol=1e-3)  # the adapter changed something
    assert main(["checkpoint", "consolidate", str(checkpoint), str(tmp_path / "again")]) == 2  # no base named
    assert "base model is not named in its adapter_config.json; pass --base" in capsys.readouterr().err


def test_an_adapter_that_does_not_fit_is_one_line(tmp_path) -> None:
    from llm_trainer import tiny_llama, with_lora

    from hf_backend import HfBackendError
    from hf_backend.checkpoint.adapters import to_model_names

    model = with_lora(tiny_llama(tied=False))
    saved = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)}
    assert list(to_model_names(model, saved, tmp_path)) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    with pytest.raises(HfBackendError, match=r"k_proj\.lora_A\.weight, which adapter 'default' of this model has no"):
        to_model_names(model, {"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 32)},
                       tmp_path)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """tie_word_embeddings=True under FSDP (resumed under DDP from its step 2) and ZeRO-3 (async_save)."""
    tmp = tmp_path_factory.mktemp("tied")
    runs = {"fsdp": run(tmp, "fsdp", ["--tied", "--strategy", "fsdp", "--save-final"])}
    runs["ddp"] = run(tmp, "ddp", ["--tied", "--resume", str(tmp / "fsdp" / "checkpoint-2")])
    runs["zero3"] = run(tmp, "zero3", ["--tied", "--strategy", "zero3", "--save-final", "--async-save"])
    runs["accumulated"] = run(tmp, "accumulated", ["--tied", "--batch-size", "2", "--grad-accum", "2"])
    return tmp, runs


def test_tied_embeddings_stay_tied_and_resume(tied) -> None:
    from transformers import LlamaForCausalLM

    tmp, runs = tied
    reference = runs["fsdp"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.2
    for name in ("fsdp", "ddp", "zero3", "accumulated"):  # accumulated: 2 processes x 2 micro-batches of 2
        assert runs[name]["tied"], name
        assert relative(runs[name]["params"], reference["params"]) < 1e-5, name
    from hf_backend.checkpoint.consolidate import consolidate

    consolidate(tmp / "fsdp" / "checkpoint-6", tmp / "consolidated")  # the step-6 checkpoint as one model
    for name, directory in (("fsdp", "fsdp/final"), ("zero3", "zero3/final"), ("fsdp", "consolidated")):
        model = LlamaForCausalLM.from_pretrained(str(tmp / directory))
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), directory
        flat = torch.cat([p.detach().float().flatten() for _, p in sorted(model.named_parameters())]).tolist()
        assert relative(flat, runs[name]["params"]) < 1e-6, directory


def test_token_level_loss_is_exact_in_an_accelerator_loop(tmp_path) -> None:
    """docs/llm.md's loop: uneven sequences, padded or packed padding-free, over 2 processes x 2 accumulation steps
    (DDP and FSDP) and 2 x 4, take the SGD steps of one process on the whole global batch."""
    def losses_and_params(name: str, args: list[str], nproc: int) -> tuple[list[float], list[float]]:
        out = tmp_path / f"{name}.json"
        run_script("token_loss_loop.py", ["--out", str(out), *args], nproc=nproc)
        report = json.loads(out.read_text())
        return report["losses"], report["params"]

    reference = losses_and_params("one", [], 1)
    for name, args in {"packed": ["--packing", "--batch-size", "2", "--grad-accum", "2"],
                       "fsdp": ["--fsdp", "--batch-size", "2", "--grad-accum", "2"],
                       "four_steps": ["--batch-size", "1", "--grad-accum", "4"]}.items():
        losses, params = losses_and_params(name, args, 2)
        assert relative(losses, reference[0]) < 1e-6, name
        assert relative(params, reference[1]) < 1e-6, name
