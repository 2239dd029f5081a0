"""A user's TRL SFT script as issue 54 measured it (tests/test_trl.py): a causal LM and its tokenizer loaded from a
directory before the config is built, a `text` column, full fine-tuning under DeepSpeed ZeRO (the stage given) with
"auto" batch values and bf16 off, a checkpoint every 2 steps, optionally resumed. Rank 0 writes the logged losses."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import hf_backend

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "slow", "red", "blue", "big", "small", "bird",
         "sang", "sun", "rose"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a directory holding the model and its tokenizer")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    r = random.Random(0)
    dataset = Dataset.from_dict({"text": [" ".join(r.choice(WORDS) for _ in range(r.randint(4, 12)))
                                          for _ in range(64)]})
    Trainer, Config = hf_backend.on_engine(SFTTrainer, SFTConfig)
    config = Config(
        output_dir=args.output_dir, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
        report_to="none", save_strategy="steps", save_steps=2, bf16=False, max_length=32, disable_tqdm=True,
        deepspeed={"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "zero_optimization": {"stage": args.stage}, "bf16": {"enabled": False}})
    trainer = Trainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=args.resume)
    if trainer.is_world_process_zero():
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        saved = sorted(p.name for p in Path(args.output_dir).glob("checkpoint-*"))
        Path(args.out).write_text(json.dumps({"losses": losses, "saved": saved, "world": config.world_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
