"""A stream of JSON lines (tests/test_streaming.py) trained on for 2 epochs, then gathered for metrics, in 1 or 2
processes: a linear model on hashed character counts of each tweet, DDP in 2 processes.

`--kind datasets`: `datasets.load_dataset("json", streaming=True)`; `--kind plain`: a torch IterableDataset reading
the files in order. `--save-at K`: save_state after K steps (the run goes on); `--resume DIR`: load_state, then the
rest. Rank 0 writes `--out`: every rank's steps (epoch, ids, loss), the ids each rank's dataset read in each
pass (datasets only), and the ids `gather_for_metrics` returned over a pass.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from hf_backend import Accelerator
from hf_backend.utils import gather_object

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--kind", choices=["datasets", "plain"], required=True)
parser.add_argument("--files", nargs="+", required=True)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--save-at", type=int, default=-1)
parser.add_argument("--save-dir")
parser.add_argument("--resume")
args = parser.parse_args()
FEATURES, EPOCHS = 16, 2
read: dict[int, list[int]] = {}  # epoch: the ids this process's dataset produced in that pass


class JsonLines(IterableDataset):
    """A plain stream: every line of every file, in order."""

    def __iter__(self):
        for name in args.files:
            with open(name, encoding="utf-8") as f:
                for line in f:
                    yield json.loads(line)


def featurize(example: dict) -> dict:
    read.setdefault(loader.epoch, []).append(example["id"])
    counts = [0.0] * FEATURES
    for ch in example["text"]:
        counts[zlib.crc32(ch.encode()) % FEATURES] += 1.0
    return {"id": example["id"], "x": counts, "label": example["label"]}


def collate(examples: list[dict]) -> dict:
    if args.kind == "plain":
        examples = [featurize(e) for e in examples]
    return {"id": torch.tensor([e["id"] for e in examples]), "x": torch.tensor([e["x"] for e in examples]),
            "label": torch.tensor([e["label"] for e in examples])}


accelerator = Accelerator()
torch.manual_seed(0)
if args.kind == "datasets":
    import datasets

    dataset = datasets.load_dataset("json", data_files=args.files, split="train", streaming=True).map(featurize)
else:
    dataset = JsonLines()
model = torch.nn.Linear(FEATURES, 3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=args.batch_size,
                                                                            collate_fn=collate))
if args.resume:
    accelerator.load_state(args.resume)

steps, done = [], 0
while loader.epoch < EPOCHS:
    epoch = loader.epoch
    for batch in loader:
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["label"])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"epoch": epoch, "ids": batch["id"].tolist(), "loss": loss.item()})
        done += 1
        if done == args.save_at:
            accelerator.save_state(args.save_dir)

gathered = []
with torch.no_grad():
    for batch in loader:
        gathered += accelerator.gather_for_metrics(batch["id"]).tolist()

all_steps = gather_object([steps])
all_read = gather_object([{epoch: sorted(set(ids)) for epoch, ids in read.items()}])
if accelerator.is_main_process:
    Path(args.out).write_text(json.dumps({"steps": all_steps, "read": all_read, "gathered": gathered,
                                          "epoch_after": loader.epoch}))
accelerator.wait_for_everyone()
