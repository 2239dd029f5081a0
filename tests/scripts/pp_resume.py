"""A checkpoint of a run on pipeline stages resumed on another layout (tests/test_pipeline.py): `--grid` single, fsdp2
(dp_shard 2), pp2, pp2xdp_shard2 or pp4; `--load DIR` resumes the `save_state` checkpoint DIR written by a run on any
grid, `--trained S` says how many steps it had trained; the run then trains `--steps` more steps and `save_state`s into
`--save` (`--state sharded`: each process's shards, DCP; `full`: gathered files). The loop is an Accelerate loop with
AdamW, a linear learning-rate decay and clipping at 0.5 (on pp stages `accelerator.forward_backward`), every global
batch 8 rows with the same targets per row, so that a rank's mean loss is the global batch's. Rank 0 writes each
step's loss beside one uninterrupted process's (run first, in every process), the most bytes of parameters and
optimizer state a process holds, and, with `--model-dir`, the model
written there by `save_model` and its largest difference from one process's parameters after the same steps.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from pp_loop import CLIP, SEQ, VOCAB, tiny
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from hf_backend import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

TOTAL, ROWS, LR = 14, 8, 1e-2
GRIDS = {"single": {}, "fsdp2": {"dp_shard_size": 2}, "pp2": {"pp_size": 2},
         "pp2xdp_shard2": {"pp_size": 2, "dp_shard_size": 2}, "pp4": {"pp_size": 4}}


def rows() -> list[dict]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (TOTAL * ROWS, SEQ), generator=generator)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt: the same number of targets in every row
    return [{"input_ids": i, "labels": t} for i, t in zip(ids, labels)]


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (2 * TOTAL))


def one_process(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = tiny("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = schedule(optimizer)
    losses = []
    for batch in list(DataLoader(rows(), batch_size=ROWS))[:steps]:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def held_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """This process's bytes of parameters and optimizer state (its shards of DTensors; AdamW's step counts left
    out)."""
    def size(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    inner = getattr(optimizer, "optimizer", optimizer)
    state = sum(size(v) for entry in inner.state.values() for v in entry.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return sum(size(p) for p in model.parameters()) + state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--grid", choices=GRIDS, required=True)
    parser.add_argument("--load")
    parser.add_argument("--trained", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--save", required=True)
    parser.add_argument("--state", choices=("sharded", "full"), default="sharded")
    parser.add_argument("--model-dir")
    args = parser.parse_args()
    torch.set_num_threads(1)
    end = args.trained + args.steps
    reference, reference_params = one_process(end)
    sizes = GRIDS[args.grid]
    plugin = FullyShardedDataParallelPlugin(
        state_dict_type="SHARDED_STATE_DICT" if args.state == "sharded" else "FULL_STATE_DICT")
    accelerator = Accelerator(split_batches=True, **({"parallelism_config": ParallelismConfig(**sizes),
                                                      "fsdp_plugin": plugin} if sizes else {}))
    pipelined = sizes.get("pp_size", 1) > 1
    model = tiny("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(rows(), batch_size=ROWS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, schedule(optimizer))
    if args.load:
        accelerator.load_state(args.load)
    losses = []
    for batch in accelerator.skip_first_batches(loader, args.trained):
        if pipelined:
            loss = accelerator.forward_backward(model, batch)
        else:
            loss = model(**batch).loss
            accelerator.backward(loss)
            loss = accelerator.reduce(loss.detach(), "mean")
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if len(losses) == args.steps:
            break
    accelerator.save_state(args.save)
    mine = torch.tensor(float(held_bytes(model, optimizer)))
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX) if accelerator.num_processes > 1 else None
    report = {"losses": losses, "reference": reference[args.trained:end], "lr": scheduler.get_last_lr()[0],
              "bytes": int(mine)}
    if args.model_dir:
        accelerator.save_model(model, args.model_dir)
        state = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            report["saved"] = sorted(state) == sorted(reference_params)
            report["params"] = max(float((state[n] - p).abs().max()) for n, p in reference_params.items())
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(report, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
