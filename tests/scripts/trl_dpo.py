"""TRL's DPOTrainer on hf_backend's engine (`hf_backend.on_engine`), or stock (`--stock`), on the tiny Llama and
word-level tokenizer of trl_sft.py: preference pairs (the completion that answers the prompt is chosen, another
answer rejected), the reference model a copy TRL makes of the policy (prepared the way TRL prepares it: DeepSpeed's
inference engine under ZeRO), or the adapter disabled with LoRA. Checkpoints every `--save-steps`; `--resume`
continues from one. Rank 0 writes a JSON report."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaForCausalLM
from trl_grpo import initial_model
from trl_sft import WORDS, tokenizer

ANSWERS = {"color": ["red", "green", "blue"], "animal": ["cat", "dog", "bird"], "number": ["one", "two", "three"]}


def preferences(n: int, seed: int) -> Dataset:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        kind = r.choice(list(ANSWERS))
        size, thing = r.choice(["big", "small"]), r.choice(ANSWERS["animal"])
        right = (WORDS.index(thing) + (size == "big")) % 3
        wrong = (right + r.choice([1, 2])) % 3
        rows.append({"prompt": f"what {kind} is the {size} {thing} ? answer :",
                     "chosen": f" {ANSWERS[kind][right]}", "rejected": f" {ANSWERS[kind][wrong]}"})
    return Dataset.from_list(rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--stock", action="store_true", help="TRL's DPOTrainer on transformers and Accelerate")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--zero", type=int, default=0, help="DeepSpeed ZeRO stage (2 or 3)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (the reference model sharded by TRL's prepare_fsdp)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--resume", default=None, help="a checkpoint directory")
    p.add_argument("--batch-size", type=int, default=4, help="per process")
    args = p.parse_args()

    from trl import DPOConfig, DPOTrainer

    if not args.stock:
        import hf_backend

        DPOTrainer, DPOConfig = hf_backend.on_engine(DPOTrainer, DPOConfig)
    backend = {}
    if args.fsdp:
        backend = {"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    if args.zero:
        backend = {"deepspeed": {"zero_optimization": {"stage": args.zero}, "train_micro_batch_size_per_gpu": "auto",
                                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}}
    config = DPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=5e-3, logging_steps=1, save_strategy="steps", save_steps=args.save_steps, report_to="none",
        disable_tqdm=True, seed=0, bf16=False, max_length=32, beta=0.1, dataloader_drop_last=True, **backend)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    tok = tokenizer()
    saved = initial_model(tok, Path(args.output_dir) / "initial", barrier=config.world_size > 1)
    model = LlamaForCausalLM.from_pretrained(saved)
    trainer = DPOTrainer(model=model, args=config, train_dataset=preferences(64, 0), processing_class=tok,
                         peft_config=peft_config)
    trainer.train(resume_from_checkpoint=args.resume)
    params = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    trainable = sorted(n for n, q in unwrapped.named_parameters() if q.requires_grad)
    if trainer.is_world_process_zero():
        flat = torch.cat([params[n].detach().float().flatten() for n in trainable])
        history = trainer.state.log_history
        report = {
            "losses": [h["loss"] for h in history if "loss" in h],
            "margins": [h["rewards/margins"] for h in history if "rewards/margins" in h],
            "params": flat.tolist(),
            "trainable": trainable,
            "world_size": config.world_size,
        }
        Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
