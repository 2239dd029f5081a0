"""DeepSpeed's own Ulysses (ALST) from an Accelerator loop, as Accelerate's ALST example writes it
(tests/test_deepspeed_ulysses.py): `ParallelismConfig(sp_size=S, sp_backend="deepspeed")` with a DeepSpeedPlugin,
the loader prepared with the model (DeepSpeed's adapter: each step, every rank of a group holds its slice of one of
the group's batches, labels shifted), the loss over the slices combined by their target counts.

`--grid single` is the reference: one process trains, step by step, the rows an ALST run of `--world` processes and
`--sp` ranks per sequence trains (each rank reads its own batches of 4; step t of group g is the batch its rank
g*S + t%S read at t//S; the D = W/S groups' batches average). Rank 0 writes a JSON report: the per-step losses and
gradient norms, the full parameters at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from deepspeed.utils import groups
from nd_loop import rows, tiny_model
from torch.utils.data import DataLoader

from hf_backend import Accelerator, DeepSpeedPlugin, ParallelismConfig
from hf_backend.utils import set_seed

BATCH, STEPS = 4, 4
CLIP, OPTIMIZER = 0.5, "adamw"  # main() may change them


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5) if OPTIMIZER == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batches(world: int, sp: int) -> list[dict[str, torch.Tensor]]:
    """The rows of every rank's batches, in the order the loader deals them (batch b to rank b % world), labels
    unshifted (DeepSpeed's adapter shifts them)."""
    data = rows(BATCH * STEPS * world // sp)
    return [{**row, "labels": row["input_ids"].clone()} for row in data]


def reference(world: int, sp: int) -> dict:
    set_seed(42)
    model = tiny_model()
    optimizer = optimizer_of(model)
    data = batches(world, sp)
    losses, norms = [], []
    for step in range(STEPS):
        picked = [(step // sp) * world + group * sp + step % sp for group in range(world // sp)]
        chosen = [row for b in picked for row in data[b * BATCH:(b + 1) * BATCH]]
        batch = {key: torch.stack([row[key] for row in chosen]) for key in chosen[0]}
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms,
            "params": {name: p.detach().flatten().tolist() for name, p in sorted(model.state_dict().items())}}


class _Gathered(torch.autograd.Function):
    """`torch.distributed.nn.functional.all_gather` of a scalar: the recipe's differentiable gather, whose
    backward on gloo (torch 2.13) scatters from group ranks taken as global ones and fails in any group
    without global rank 0; here its backward sums the gradients over the group with an all-reduce."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        parts = [torch.empty_like(value) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, value.contiguous(), group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        summed = torch.stack(grads)
        torch.distributed.all_reduce(summed, group=ctx.group)
        return summed[torch.distributed.get_rank(ctx.group)], None


def alst(sp: int, zero: int) -> tuple[Accelerator, dict]:
    data_parallel = int(os.environ["WORLD_SIZE"]) // sp  # DeepSpeed's: every sp group
    config = {"zero_optimization": {"stage": zero}, "gradient_clipping": CLIP, "zero_allow_untested_optimizer": True,
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}  # SGD too
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                              parallelism_config=ParallelismConfig(dp_shard_size=data_parallel, sp_size=sp,
                                                                   sp_backend="deepspeed"))
    world = accelerator.num_processes
    set_seed(42)
    model = tiny_model()
    optimizer = optimizer_of(model)
    loader = DataLoader(batches(world, sp), batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    group = groups._get_sequence_parallel_group()  # DeepSpeed's, as transformers' Trainer finds it
    losses, norms = [], []
    for batch in loader:
        batch["labels"] = batch["shift_labels"]  # already shifted by the adapter: the loss takes them as they are
        loss = model(**batch).loss
        # the slices' losses, weighed by their targets (a slice may hold none)
        counts = _Gathered.apply((batch["shift_labels"] != -100).sum(), group)
        parts = _Gathered.apply(loss, group)
        loss = sum(torch.nan_to_num(part) * count for part, count in zip(parts, counts)) / max(sum(counts), 1)
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))  # the mean over the groups' batches
    state = accelerator.get_state_dict(model)
    grid = accelerator.parallelism_config
    return accelerator, {"losses": losses, "norms": norms, "grid": grid.to_json(),
                         "params": {name: t.float().flatten().tolist() for name, t in sorted(state.items())}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--grid", default="alst", choices=("single", "alst"))
    p.add_argument("--world", type=int, default=2, help="for --grid single: the processes of the run it stands for")
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--clip", type=float, default=0.5)
    args = p.parse_args()
    global CLIP, OPTIMIZER
    CLIP, OPTIMIZER = args.clip, args.optimizer
    if args.grid == "single":
        with open(args.out, "w") as f:
            json.dump(reference(args.world, args.sp), f)
        return 0
    accelerator, report = alst(args.sp, args.zero)
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(report, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
