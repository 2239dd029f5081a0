"""QLoRA on the engine: a tiny Llama loaded in 4 bits (bitsandbytes nf4, on the CPU) with a LoRA adapter, trained by
hf_backend.Trainer in one process (equal to transformers' own Trainer with PEFT), under DDP, FSDP2 and DeepSpeed
ZeRO-3, resumed across strategies and world sizes from checkpoints that hold the adapter alone
(tests/scripts/llm_trainer.py --qlora 4; hf_backend/strategies/quantized.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import difference_to_largest as relative
from test_llm import run

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

QLORA = ["--qlora", "4", "--lora"]
ONE = ["--batch-size", "8"]  # one process reads the global batch of 2 processes x 4


def four_bit(path: str | Path) -> torch.nn.Module:
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path), quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))


@pytest.fixture(scope="module")
def qlora(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """transformers' Trainer and ours in one process; DDP and ZeRO-3 from the start; FSDP (sharded checkpoints)
    resumed from DDP's step 2; FSDP (full checkpoints) in 2 processes resumed from the one process's step 4; DDP
    resumed from the sharded FSDP run's step 4."""
    tmp = tmp_path_factory.mktemp("qlora")
    runs = {"stock": run(tmp, "stock", [*QLORA, *ONE, "--stock"], nproc=1),
            "one": run(tmp, "one", [*QLORA, *ONE, "--save-final"], nproc=1),
            "ddp": run(tmp, "ddp", [*QLORA, "--save-final"]),
            "zero3": run(tmp, "zero3", [*QLORA, "--strategy", "zero3"])}
    runs["fsdp"] = run(tmp, "fsdp", [*QLORA, "--strategy", "fsdp_sharded", "--resume",
                                     str(tmp / "ddp" / "checkpoint-2")])
    runs["fsdp_from_one"] = run(tmp, "fsdp_from_one", [*QLORA, "--strategy", "fsdp", "--resume",
                                                       str(tmp / "one" / "checkpoint-4")])
    runs["ddp_from_fsdp"] = run(tmp, "ddp_from_fsdp", [*QLORA, "--resume", str(tmp / "fsdp" / "checkpoint-4")])
    return tmp, runs


def test_qlora_in_one_process_is_peft_on_stock_transformers(qlora) -> None:
    _, runs = qlora
    stock, ours = runs["stock"], runs["one"]
    assert ours["trainable"] == stock["trainable"] and all("lora_" in name for name in ours["trainable"])
    assert max(abs(a - b) for a, b in zip(ours["losses"], stock["losses"], strict=True)) < 1e-5
    assert relative(ours["params"], stock["params"]) < 1e-5
    assert ours["losses"][-1] < ours["losses"][0]


def test_qlora_trains_and_resumes_exactly_under_every_strategy(qlora) -> None:
    _, runs = qlora
    reference = runs["one"]
    for name in ("ddp", "fsdp", "zero3", "fsdp_from_one", "ddp_from_fsdp"):
        assert runs[name]["global_step"] == 6 and runs[name]["trainable"] == reference["trainable"], name
        assert relative(runs[name]["params"], reference["params"]) < 1e-5, name
        assert relative(runs[name]["losses"], reference["losses"]) < 1e-5, name
    for name in ("one", "ddp", "fsdp", "zero3", "fsdp_from_one", "ddp_from_fsdp"):
        for step, files in runs[name]["checkpoints"].items():
            assert "adapter_model.safetensors" in files, (name, step)
            assert not {"model.safetensors", "model_dcp", "pytorch_model.bin"} & set(files), (name, step, files)


def test_fsdp_keeps_the_4bit_base_whole_and_shards_the_adapter(qlora) -> None:
    """Bytes per process (rank 0): FSDP shards the adapter and its optimizer state over the 2 processes and keeps
    the packed 4-bit weights whole; ZeRO-3 partitions those too."""
    _, runs = qlora
    one, fsdp, zero3 = runs["one"]["bytes"], runs["fsdp"]["bytes"], runs["zero3"]["bytes"]
    print({"one": one, "fsdp": fsdp, "zero3": zero3})
    assert one["quantized"] > 0 and fsdp["quantized"] == one["quantized"]
    assert fsdp["trainable"] == one["trainable"] // 2 and fsdp["optimizer"] == one["optimizer"] // 2
    assert zero3["quantized"] <= one["quantized"] // 2 + 64


def test_the_saved_adapter_loads_onto_a_freshly_quantized_base(qlora) -> None:
    from peft import PeftModel

    tmp, runs = qlora
    for name in ("one", "ddp"):
        adapter = tmp / name / "final"
        base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
        model = PeftModel.from_pretrained(four_bit(base), str(adapter)).train()
        with torch.no_grad():  # training mode: bitsandbytes' CPU eval path repacks the weights (quantized.py)
            logits = model(input_ids=torch.arange(12).view(2, 6)).logits
        assert relative(logits.flatten().tolist(), runs[name]["logits"]) < 1e-4, name


def test_consolidate_merges_the_adapter_onto_the_dequantized_base(qlora, tmp_path) -> None:
    """A base saved in 4 bits is dequantized before the adapter is merged: the merged float model computes what the
    trained one did."""
    from transformers import LlamaForCausalLM

    from hf_backend.checkpoint.consolidate import consolidate

    tmp, runs = qlora
    base = json.loads((tmp / "one" / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    four_bit(base).save_pretrained(tmp_path / "base4")
    consolidate(tmp / "one" / "checkpoint-6", tmp_path / "merged", base=tmp_path / "base4")
    merged = LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert getattr(merged.config, "quantization_config", None) is None
    with torch.no_grad():
        logits = merged(input_ids=torch.arange(12).view(2, 6)).logits
    assert relative(logits.flatten().tolist(), runs["one"]["logits"]) < 1e-4


def test_what_is_not_run_is_one_line(tmp_path) -> None:
    from llm_trainer import tiny_llama, with_lora
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    from hf_backend import Accelerator, HfBackendError
    from hf_backend.parallel.dims import MeshShape
    from hf_backend.strategies import quantized

    tiny_llama(tied=False).save_pretrained(tmp_path / "base")
    eight = LlamaForCausalLM.from_pretrained(str(tmp_path / "base"),
                                             quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(HfBackendError, match=r"the base was loaded in 8 bits \(load_in_8bit\); .* load it in 4 bits"):
        Accelerator(cpu=True).prepare(with_lora(eight))
    model = four_bit(tmp_path / "base")
    with pytest.raises(HfBackendError, match=r"a bitsandbytes-quantized base under tp=2, cp=2 has not been run"):
        quantized.prepare([model], MeshShape(dp_shard=1, tp=2, cp=2))
    gptq = tiny_llama(tied=False)
    gptq.hf_quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="gptq"))
    with pytest.raises(HfBackendError, match=r"loaded quantized with gptq; hf_backend trains bitsandbytes 4-bit"):
        Accelerator(cpu=True).prepare(with_lora(gptq))


def test_evaluating_does_not_stop_training(tmp_path) -> None:
    """bitsandbytes' CPU 4-bit layers would repack their weights on an eval-mode forward without gradients, after
    which the adapter stops learning; a prepared model keeps the training layout."""
    from llm_trainer import tiny_llama, with_lora

    from hf_backend import Accelerator

    tiny_llama(tied=False).save_pretrained(tmp_path / "base")
    accelerator = Accelerator(cpu=True)
    model = with_lora(four_bit(tmp_path / "base"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.arange(32).view(2, 16) % 48
    losses = []
    for step in range(4):
        if step == 2:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids, labels=ids)
            model.train()
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[3] < losses[2] < losses[1] < losses[0], losses
