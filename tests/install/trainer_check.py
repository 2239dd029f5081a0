"""The install check's Trainer script (tests/install/check.py): hf_backend.Trainer on a tiny BERT built from its
config, trained 6 steps with a checkpoint at step 3 and evaluated, then a second run resumed from that checkpoint;
both must end with the same weights. Runs in one process or under `hf-backend launch` (`--fsdp`: FSDP2, one shard per
process); exits non-zero on a failure."""

from __future__ import annotations

import sys

import torch
from transformers import BertConfig, BertForSequenceClassification

from hf_backend import Trainer, TrainingArguments


def model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=32, num_labels=2))


def data(n: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(4, 64, (8,), generator=generator)
        rows.append({"input_ids": ids, "labels": int(ids[0] < 34)})
    return rows


def train(output_dir: str, fsdp: bool, resume: str | None = None) -> Trainer:
    sharding = {"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": ["BertLayer"]}} if fsdp else {}
    args = TrainingArguments(output_dir=output_dir, max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
                             save_steps=3, logging_steps=1, eval_strategy="steps", eval_steps=3, report_to="none",
                             disable_tqdm=True, seed=0, **sharding)
    trainer = Trainer(model=model(), args=args, train_dataset=data(64), eval_dataset=data(16))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def main() -> int:
    output_dir, fsdp = sys.argv[1], "--fsdp" in sys.argv[2:]
    whole = train(output_dir, fsdp)
    resumed = train(output_dir + "-resumed", fsdp, resume=f"{output_dir}/checkpoint-3")
    state = whole.accelerator.state
    weights = [whole.accelerator.get_state_dict(t.model_wrapped) for t in (whole, resumed)]
    losses = [entry["eval_loss"] for entry in whole.state.log_history if "eval_loss" in entry]
    if state.is_main_process:
        same = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
        print(f"trainer: {state.num_processes} process(es), {state.distributed_type.value}, eval losses {losses}, "
              f"resumed run equal: {same}")
        if not same or len(losses) != 2:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
