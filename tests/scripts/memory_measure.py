"""The memory a real training step takes per process, by phase, to check `hf-backend plan` against: a tiny Llama
(fp32) prepared under one strategy, then one forward and backward (batch 1, 16 tokens: activations are a few MB) and
one AdamW step. Resident memory is read after each phase with glibc returning freed memory at once (its mmap
threshold fixed at 64 KiB, `mallopt`), so each difference is what the phase added and kept:

    prepared  = after prepare - before the model was built      (parameters, and what the wrapper allocates)
    backward  = after backward - prepared                       (gradients, and gradient buffers)
    step      = after the optimizer step - backward             (optimizer state)

Writes one JSON object per process (`--out DIR`: DIR/rank{R}.json), with the model's config for the planner."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
from pathlib import Path

import psutil
import torch

CONFIG = dict(vocab_size=16000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64, tie_word_embeddings=False)


def return_freed_memory() -> None:
    """glibc: every block of 64 KiB or more its own mapping, given back to the system when freed (M_MMAP_THRESHOLD,
    which also stops glibc from raising the threshold as it goes), so resident memory follows live tensors."""
    libc = ctypes.CDLL("libc.so.6")
    if not libc.mallopt(-3, 64 * 1024):  # -3: M_MMAP_THRESHOLD
        raise SystemExit("mallopt(M_MMAP_THRESHOLD) failed")


def write_report(out: str, rank: int, report: dict) -> None:
    """This process's figures as `out`/rank{rank}.json."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def build_model(lora: int):
    """The tiny Llama, with a LoRA adapter of rank `lora` on q_proj and v_proj when `lora`, and its AdamW."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    if lora:
        model = get_peft_model(model, LoraConfig(r=lora, target_modules=["q_proj", "v_proj"]))
    return model, torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)


def _warm_up(accelerator, lora: int) -> None:
    """What the first step allocates once and keeps (kernels' lazy set-up and workspaces, the first DeepSpeed
    engine's own buffers: about 50 MB here), done on the same model (its LoRA adapter too: without it ZeRO-3 kept
    5 to 8.5 MiB more in the measured run), prepared and trained one step, before the baseline, then freed; its
    large tensors go back to the system at once (`return_freed_memory`)."""
    torch.manual_seed(1)
    model, optimizer = accelerator.prepare(*build_model(lora))
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 16))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    accelerator.free_memory(model, optimizer)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True, choices=("no", "ddp", "fsdp", "zero1", "zero2", "zero3"))
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on q_proj and v_proj (0: none)")
    p.add_argument("--hidden", type=int, default=CONFIG["hidden_size"], help="width (the MLP 2.6875 times it)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    return_freed_memory()
    CONFIG.update(hidden_size=args.hidden, intermediate_size=args.hidden * 43 // 16)

    from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin

    fsdp = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"]) \
        if args.strategy == "fsdp" else None
    zero = DeepSpeedPlugin(zero_stage=int(args.strategy[-1]), hf_ds_config={"train_micro_batch_size_per_gpu": 1}) \
        if args.strategy.startswith("zero") else None
    accelerator = Accelerator(cpu=True, fsdp_plugin=fsdp, deepspeed_plugin=zero)
    if zero is not None:
        import deepspeed  # noqa: F401 - imported before the baseline, as everything else is
    _warm_up(accelerator, args.lora)
    torch.manual_seed(0)
    before = rss()
    model, optimizer = build_model(args.lora)
    model, optimizer = accelerator.prepare(model, optimizer)
    prepared = rss()
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 16))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    backward = rss()
    optimizer.step()
    stepped = rss()
    report = {"strategy": args.strategy, "num_processes": accelerator.num_processes, "lora": args.lora,
              "config": CONFIG, "prepared": prepared - before, "backward": backward - prepared,
              "step": stepped - backward, "total": stepped - before}
    write_report(args.out, accelerator.process_index, report)
    accelerator.end_training()


if __name__ == "__main__":
    main()
