"""An async save_state under 2 processes, checked against a synchronous one (tests/test_async_save.py).

`async_save.py --mode ddp|sharded|zero2 --root DIR --out F`: DDP writes full files, FSDP with SHARDED_STATE_DICT writes
DCP shards on the writer thread, DeepSpeed ZeRO-2 writes full files gathered from its partitions. Each process
writes its report to `F.rank{rank}.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=("ddp", "sharded", "zero2"), required=True)
parser.add_argument("--root", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
root = Path(args.root)

plugins = {"ddp": {}, "zero2": {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=2)},
           "sharded": {"fsdp_plugin": FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT",
                                                                     transformer_cls_names_to_wrap=["Linear"])}}
acc = Accelerator(cpu=True, **plugins[args.mode])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(16, 16)), batch_size=8)  # DeepSpeed's
model, optimizer, _ = acc.prepare(model, optimizer, loader)  # batch size comes from the training loader


def step(seed: int) -> None:
    g = torch.Generator().manual_seed(seed + acc.process_index)
    acc.backward(model(torch.randn(8, 16, generator=g)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def weights() -> dict[str, list]:
    """This process's part of the weights (its shards under FSDP)."""
    return {k: getattr(v, "to_local", lambda v=v: v)().tolist() for k, v in model.state_dict().items()}


step(0)
acc.save_state(root / "sync")
saved = weights()
acc.save_state(root / "async", async_save=True)
staged_only = (root / "async.incomplete").is_dir() and not (root / "async").exists()
step(1)  # changes the live state while the async save may still be writing
live = weights()
acc.wait_for_checkpoint()

results = {}
for name in ("sync", "async"):
    acc.load_state(root / name)
    loaded = weights()
    step(2)  # depends on the optimizer's restored moments too
    results[name] = {"loaded": loaded, "stepped": weights()}

acc.save_state(root / "last", async_save=True)
acc.end_training()  # waits for the save, on every process
report = {"staged_only": staged_only, "equal": results["sync"] == results["async"],
          "saved_is_loaded": results["async"]["loaded"] == saved, "live_differs": live != saved,
          "last_complete": (root / "last" / "hf_backend_checkpoint.json").is_file(),
          "leftovers": sorted(p.name for p in root.iterdir() if p.name.endswith(".incomplete")),
          "files": sorted(str(p.relative_to(root / "async")) for p in (root / "async").rglob("*") if p.is_file())}
Path(f"{args.out}.rank{acc.process_index}.json").write_text(json.dumps(report))
