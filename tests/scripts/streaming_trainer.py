"""hf_backend.Trainer on a `datasets` stream of JSON lines (tests/test_streaming.py): a linear model on hashed
character counts, `max_steps` steps, a checkpoint every `--save-steps`; `--resume` continues from the newest one.
Rank 0 writes `--out`: the training loss of every step, and the ids each process trained on."""

from __future__ import annotations

import argparse
import json
import os
import zlib
from pathlib import Path

import datasets
import torch

from hf_backend import Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--files", nargs="+", required=True)
parser.add_argument("--output-dir", required=True)
parser.add_argument("--max-steps", type=int, default=16)
parser.add_argument("--save-steps", type=int, default=8)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()
FEATURES = 16
seen: list[list[int]] = []


def featurize(example: dict) -> dict:
    counts = [0.0] * FEATURES
    for ch in example["text"]:
        counts[zlib.crc32(ch.encode()) % FEATURES] += 1.0
    return {"id": example["id"], "x": counts, "labels": example["label"]}


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(FEATURES, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, id: torch.Tensor) -> dict:  # noqa: A002 - a column
        if self.training:
            seen.append(id.tolist())
        logits = self.linear(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def collate(examples: list[dict]) -> dict:
    return {"x": torch.tensor([e["x"] for e in examples]), "labels": torch.tensor([e["labels"] for e in examples]),
            "id": torch.tensor([e["id"] for e in examples])}


torch.manual_seed(0)
stream = datasets.load_dataset("json", data_files=args.files, split="train", streaming=True).map(featurize)
training = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=8, max_steps=args.max_steps,
                             save_steps=args.save_steps, logging_steps=1, learning_rate=0.01, report_to=[],
                             remove_unused_columns=False, use_cpu=True, save_only_model=False)
trainer = Trainer(model=Linear(), args=training, train_dataset=stream, data_collator=collate)
trainer.train(resume_from_checkpoint=True if args.resume else None)
losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
everyone = trainer.accelerator.gather_for_metrics([seen], use_gather_object=True)
if int(os.environ.get("RANK", "0")) == 0:
    Path(args.out).write_text(json.dumps({"losses": losses, "seen": everyone}))
