"""A tiny Llama loaded with `from_pretrained(..., tp_plan="auto")`, sharded by transformers over every process,
which is the run's tensor-parallel dimension when tp_size is the world size, then prepared as it is and trained 3
SGD steps on 8 sequences (tests/test_parallelism.py), by an Accelerator loop or (`--trainer`) by hf_backend.Trainer,
which takes the grid from the model; `--grid single` loads it whole in one process. Rank 0 writes the losses."""

from __future__ import annotations

import argparse
import json
import sys

import torch
from nd_loop import GLOBAL_BATCH, rows
from torch.utils.data import DataLoader, default_collate
from transformers import LlamaForCausalLM

from hf_backend import Accelerator, ParallelismConfig


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", required=True, help="a directory save_pretrained wrote")
    p.add_argument("--grid", default="single", help="single, or dp_shard x tp (e.g. 1x2)")
    p.add_argument("--trainer", action="store_true")
    args = p.parse_args()
    if args.trainer:
        return trainer(args)
    if args.grid == "single":
        accelerator = Accelerator(split_batches=True)
        model = LlamaForCausalLM.from_pretrained(args.model)
    else:
        shard, tp = map(int, args.grid.split("x"))
        accelerator = Accelerator(split_batches=True,
                                  parallelism_config=ParallelismConfig(dp_shard_size=shard, tp_size=tp))
        model = LlamaForCausalLM.from_pretrained(args.model, tp_plan="auto")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(rows(GLOBAL_BATCH * 3), batch_size=GLOBAL_BATCH, collate_fn=default_collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=batch["labels"]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"losses": losses}, f)
    accelerator.end_training()
    return 0


def trainer(args: argparse.Namespace) -> int:
    from hf_backend import Trainer, TrainingArguments

    model = LlamaForCausalLM.from_pretrained(args.model, **({} if args.grid == "single" else {"tp_plan": "auto"}))
    training_args = TrainingArguments(output_dir=args.out + ".d", max_steps=3, per_device_train_batch_size=GLOBAL_BATCH,
                                      learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
                                      save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=training_args, train_dataset=rows(GLOBAL_BATCH * 3),
                      data_collator=default_collate)
    trainer.train()
    if trainer.is_world_process_zero():
        with open(args.out, "w") as f:
            json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                       "tp_size": trainer.accelerator.parallelism_config.tp_size
                       if trainer.accelerator.parallelism_config else 1}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
