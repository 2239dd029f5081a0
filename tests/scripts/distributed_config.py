"""A model transformers sharded itself, `from_pretrained(dir, distributed_config=DistributedConfig(...))`, trained on
the engine (tests/test_distributed_config.py): by an Accelerator loop whose ParallelismConfig is the model's grid
(saving after step 2 with `save_state`, or resuming from such a checkpoint), or by hf_backend.Trainer, which takes the
grid from the model. `--grid R,F,T`: dp_replicate, fsdp and tp sizes of the DistributedConfig; `whole` loads the model
whole (the one-process reference). The loop's run ends with `save_pretrained(distributed_checkpoint=True)` and loads
that back with `from_pretrained` on the same grid. Rank 0 writes a JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_backend import Accelerator, ParallelismConfig

VOCAB, SEQ = 48, 16


def rows(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    starts, steps = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (starts + steps * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def load(model_dir: str, grid: str) -> torch.nn.Module:
    if grid == "whole":
        return AutoModelForCausalLM.from_pretrained(model_dir)
    from transformers.distributed import DistributedConfig

    replicate, fsdp, tp = map(int, grid.split(","))
    return AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(
        dp_replicate_size=replicate, fsdp_size=fsdp, tp_size=tp))


def full_params(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, list[float]]:
    state = accelerator.get_state_dict(model)
    return {name: tensor.float().flatten().tolist() for name, tensor in sorted(state.items())}


def loop(args: argparse.Namespace) -> dict:
    grid = None if args.grid == "whole" else dict(zip(("dp_replicate_size", "dp_shard_size", "tp_size"),
                                                     map(int, args.grid.split(","))))
    given = ParallelismConfig(**grid) if grid and not args.no_grid else None
    accelerator = Accelerator(split_batches=True, parallelism_config=given)
    torch.manual_seed(0)
    model = load(args.model_dir, args.grid)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(rows(8 * args.steps), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.resume:
        accelerator.load_state(args.resume)
    losses = []
    for step, batch in enumerate(loader, start=args.save_at + 1 if args.resume else 1):
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
        if step == args.save_at and args.checkpoint and not args.resume:
            accelerator.save_state(args.checkpoint)
    report = {"losses": losses, "params": full_params(accelerator, model),
              "data_parallel": accelerator.strategy.data_shard.count}
    if args.saved and grid:  # transformers' own sharded save, and its load on the same grid
        model.save_pretrained(args.saved, distributed_checkpoint=True)
        again = load(args.saved, args.grid)
        report["reloaded"] = {name: tensor.float().flatten().tolist() for name, tensor in
                              sorted(again.config.distributed_config and _gathered(again).items())}
    accelerator.end_training()
    return report


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def trainer(args: argparse.Namespace) -> dict:
    from hf_backend import Trainer, TrainingArguments

    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8 // args.data_parallel,
        learning_rate=1e-2, max_grad_norm=1.0, logging_steps=1, save_strategy="steps" if args.checkpoint else "no",
        save_steps=args.save_at, report_to="none", disable_tqdm=True, seed=0)
    torch.manual_seed(0)
    model = load(args.model_dir, args.grid)
    run = Trainer(model=model, args=training, train_dataset=rows(8 * args.steps))
    run.train(resume_from_checkpoint=args.resume)
    report = {"losses": [h["loss"] for h in run.state.log_history if "loss" in h],
              "params": full_params(run.accelerator, run.model_wrapped),
              "grid": run.accelerator.parallelism_config.to_json() if run.accelerator.parallelism_config else None}
    if args.saved:  # save_model, read back whole
        run.save_model(args.saved)
        run.accelerator.wait_for_everyone()
        again = AutoModelForCausalLM.from_pretrained(args.saved)
        report["reloaded"] = {name: t.float().flatten().tolist() for name, t in sorted(again.state_dict().items())}
    return report


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--grid", default="whole", help="R,F,T: DistributedConfig's dp_replicate, fsdp, tp; or whole")
    p.add_argument("--trainer", action="store_true")
    p.add_argument("--data-parallel", type=int, default=1, help="the Trainer: dp_replicate x fsdp (batch 8 / it)")
    p.add_argument("--output-dir", default="out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--saved", default=None, help="save_pretrained(distributed_checkpoint=True) here at the end")
    p.add_argument("--no-grid", action="store_true", help="the loop's Accelerator without the model's grid")
    args = p.parse_args()
    report = trainer(args) if args.trainer else loop(args)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
