"""A damaged 2-process FSDP checkpoint (SHARDED_STATE_DICT: each process's shards in model_dcp/ and optimizer_dcp/)
is refused on every process in one line naming the file, and nothing is loaded (tests/test_checkpoint_trust.py).

Run with 2 processes: `damaged_shards.py --out F --root DIR`. For each kind of damage: save_state, rank 0 damages one
file, both ranks call load_state; rank 0 writes {kind: [each rank's error, whether its model and optimizer are
unchanged]} to F.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_backend import Accelerator, FullyShardedDataParallelPlugin, HfBackendError


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "model_dcp/__1_0.distcp": ("flipped bytes", flip),
    "optimizer_dcp/.metadata": ("truncated", lambda p: p.write_bytes(p.read_bytes()[:-9])),
    "model_dcp/__0_0.distcp": ("deleted", lambda p: p.unlink()),
    "rng_state_1.pt": ("deleted", lambda p: p.unlink()),
}


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    return tensors + [v.clone() for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--root", type=Path, required=True)
    args = parser.parse_args()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT",
                                                                             transformer_cls_names_to_wrap=["Linear"]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step() -> None:
        accelerator.backward(model(torch.ones(2, 8)).square().sum())
        optimizer.step()
        optimizer.zero_grad()

    report = {}
    for name, (kind, damage) in DAMAGE.items():
        step()
        directory = args.root / name.replace("/", "_")
        accelerator.save_state(directory)
        if accelerator.is_main_process:
            damage(directory / name)
        accelerator.wait_for_everyone()
        step()
        before = state(model, optimizer)
        try:
            accelerator.load_state(directory)
            error = None
        except HfBackendError as err:
            error = str(err)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, state(model, optimizer)))
        report[f"{name} {kind}"] = {"path": str(directory / name), "seen": accelerator.gather_for_metrics(
            [[error, unchanged]], use_gather_object=True)}
    if accelerator.is_main_process:
        args.out.write_text(json.dumps(report, indent=1))
    accelerator.end_training()


if __name__ == "__main__":
    main()
