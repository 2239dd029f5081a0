"""TRL's RewardTrainer and KTOTrainer on hf_backend's engine (`hf_backend.on_engine`), or stock (`--stock`), on the tiny
Llama and word-level tokenizer of trl_sft.py and the preference pairs of trl_dpo.py. The reward model is that Llama
with a one-label score head (`LlamaForSequenceClassification.from_pretrained`, the head seeded); KTO gets the pairs
unpaired (the chosen answer desirable, the rejected one not) and its reference model loaded explicitly, as TRL's
examples/scripts/kto.py does. Rank 0 writes a JSON report: the logged losses and the trained parameters."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaForCausalLM, LlamaForSequenceClassification
from trl_dpo import preferences
from trl_grpo import initial_model
from trl_sft import tokenizer


def unpaired(pairs: Dataset) -> Dataset:
    rows = []
    for row in pairs:
        rows.append({"prompt": row["prompt"], "completion": row["chosen"], "label": True})
        rows.append({"prompt": row["prompt"], "completion": row["rejected"], "label": False})
    return Dataset.from_list(rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--trainer", choices=("reward", "kto"), required=True)
    p.add_argument("--stock", action="store_true", help="TRL's trainer on transformers and Accelerate")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (KTO's reference model sharded by TRL's prepare_fsdp)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4, help="per process")
    args = p.parse_args()

    import trl

    trainer_class, config_class = (trl.RewardTrainer, trl.RewardConfig) if args.trainer == "reward" else \
        (trl.KTOTrainer, trl.KTOConfig)
    if not args.stock:
        import hf_backend

        trainer_class, config_class = hf_backend.on_engine(trainer_class, config_class)
    backend = {}
    if args.fsdp:
        backend = {"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    config = config_class(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        bf16=False, max_length=32, dataloader_drop_last=True, adam_epsilon=1e-6, **backend)
    tok = tokenizer()
    saved = initial_model(tok, Path(args.output_dir) / "initial", barrier=config.world_size > 1)
    pairs = preferences(64, 0)
    if args.trainer == "reward":
        torch.manual_seed(0)  # the score head is new: the same on every rank and in every run
        model = LlamaForSequenceClassification.from_pretrained(saved, num_labels=1)
        trainer = trainer_class(model=model, args=config, train_dataset=pairs, processing_class=tok)
    else:
        model, ref_model = LlamaForCausalLM.from_pretrained(saved), LlamaForCausalLM.from_pretrained(saved)
        trainer = trainer_class(model=model, ref_model=ref_model, args=config, train_dataset=unpaired(pairs),
                                processing_class=tok)
    trainer.train()
    params = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    trainable = sorted(n for n, q in unwrapped.named_parameters() if q.requires_grad)
    if trainer.is_world_process_zero():
        flat = torch.cat([params[n].detach().float().flatten() for n in trainable])
        report = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "params": flat.tolist(),
                  "world_size": config.world_size}
        Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
