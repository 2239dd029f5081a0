"""Checkpoints kept from an earlier hf_backend, and the check that today's code still loads them.

`write` was run once, with hf_backend at commit 129f7ee (format_version 1, before checkpoint/ became a package), to
make the small fixtures in tests/fixtures/checkpoints_v1/:

    python tests/scripts/old_checkpoints.py write --kind single --dir tests/fixtures/checkpoints_v1/single
    torchrun --nproc_per_node 2 tests/scripts/old_checkpoints.py write --kind fsdp --dir .../fsdp
    torchrun --nproc_per_node 2 tests/scripts/old_checkpoints.py write --kind deepspeed --dir .../deepspeed

Each directory also holds `expected.json`: what a run that loads the checkpoint must see (the weights, the
optimizer's state, the scheduler, the next batch, a registered object, the next random number). `check` builds the
same objects with today's code, loads the checkpoint and writes what it sees to `--out` (tests/test_old_checkpoints.py
compares the two). FSDP's sharded checkpoint is checked in one process (it loads into an unsharded model), the
DeepSpeed one under DeepSpeed in 2 processes (its own format).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin


class Progress:
    def __init__(self) -> None:
        self.epoch, self.seen = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.seen = state["epoch"], state["seen"]


def build(kind: str) -> tuple:
    torch.manual_seed(0)
    plugins = {
        "single": {},
        "fsdp": {"fsdp_plugin": FullyShardedDataParallelPlugin(auto_wrap_policy="NO_WRAP",
                                                               state_dict_type="SHARDED_STATE_DICT")},
        "deepspeed": {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=2)},
    }[kind]
    accelerator = Accelerator(cpu=True, **plugins)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = TensorDataset(torch.arange(64, dtype=torch.float32).reshape(16, 4) / 64, torch.arange(16) % 2)
    loader = DataLoader(data, batch_size=2, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    return accelerator, model, optimizer, loader, scheduler, progress


def observe(accelerator, model, optimizer, loader, scheduler, progress) -> dict:
    """What a resumed run sees, but for the next batch; collective (the state dict is gathered)."""
    weights = accelerator.get_state_dict(model)
    inner = getattr(optimizer, "optimizer", optimizer)
    moments = sum(float(_full(s["exp_avg"]).abs().sum()) for s in inner.state.values() if "exp_avg" in s)
    seen = {
        "weights": {k: v.float().flatten().tolist() for k, v in sorted(weights.items())},
        "lr": scheduler.get_last_lr()[0],
        "progress": progress.state_dict(),
        "random": random.random(),
        "torch_random": float(torch.rand(1)),
    }
    if accelerator.distributed_type.value != "DEEPSPEED":  # DeepSpeed keeps its optimizer state partitioned
        seen["exp_avg_abs_sum"] = moments
    return seen


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def write(kind: str, directory: Path) -> None:
    accelerator, model, optimizer, loader, scheduler, progress = objects = build(kind)
    batches = iter(loader)
    for _ in range(3):
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.seen += len(y)
    accelerator.save_state(str(directory))
    seen = observe(*objects)
    seen["next_batch"] = next(batches)[1].tolist()  # the 4th batch of the epoch
    if accelerator.is_main_process:
        (directory / "expected.json").write_text(json.dumps(seen, indent=1) + "\n")
    accelerator.end_training()


def check(kind: str, directory: Path, out: Path) -> None:
    objects = build(kind)
    accelerator = objects[0]
    accelerator.load_state(str(directory))
    seen = observe(*objects)
    seen["next_batch"] = next(iter(objects[3]))[1].tolist()
    if accelerator.is_main_process:
        out.write_text(json.dumps(seen))
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["write", "check"])
    parser.add_argument("--kind", choices=["single", "fsdp", "deepspeed"], required=True)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mode == "write":
        write(args.kind, args.dir)
    else:
        check(args.kind, args.dir, args.out)


if __name__ == "__main__":
    main()
