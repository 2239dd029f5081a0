"""`hf-backend plan`: memory per process of a training run, before launching it (hf_backend/plan/memory.py).

    hf-backend plan MODEL_DIR_OR_CONFIG --strategy fsdp --num_processes 8 [--mixed_precision bf16]
        [--lora 16 [--lora_targets q_proj v_proj]] [--parallelism dp_shard=4,tp=2 | dp_shard=8,ep=4 | pp=2,dp_shard=4
        [--pp_schedule 1F1B] [--pp_microbatches 8]] [--batch_size 4]
        [--sequence_length 2048] [--activation_checkpointing] [--dtype bfloat16] [--json]

Nothing is downloaded and no process group is made: the model is built on the meta device from its
config.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..core.errors import HfBackendError


def add_parser(sub: Any) -> None:
    from ..plan.memory import STRATEGIES

    p = sub.add_parser("plan", help="memory per process of a training run (parameters, gradients, optimizer state, "
                                    "activations), from the model's config alone")
    p.add_argument("model", help="a model directory holding config.json, or the config.json file")
    p.add_argument("--strategy", required=True, choices=STRATEGIES,
                   help="no (one process), ddp, fsdp (FSDP2), zero1 / zero2 / zero3 (DeepSpeed)")
    p.add_argument("--num_processes", type=int, default=1, help="processes in the run (default 1)")
    p.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default="no",
                   help="autocast: changes the activations, not the "
                        "fp32 weights, gradients or optimizer state")
    p.add_argument("--dtype", default=None, help="the weights' dtype (default: the config's, else float32)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="a LoRA adapter of this rank (peft)")
    p.add_argument("--lora_targets", nargs="+", default=None, help="its target modules (default: q_proj v_proj)")
    p.add_argument("--parallelism", default=None, metavar="SIZES",
                   help="ParallelismConfig sizes for fsdp, e.g. "
                        "dp_shard=4,tp=2 (pp, dp_replicate, dp_shard, cp, sp, tp; and ep, within dp_shard x cp x "
                        "sp)")
    p.add_argument("--pp_schedule", default="1F1B", help="with pp: the schedule (GPipe, 1F1B, Interleaved1F1B, ...)")
    p.add_argument("--pp_microbatches", type=int, default=None, help="with pp: microbatches (default one per stage)")
    p.add_argument("--batch_size", type=int, default=1, help="per process, for the activation estimate")
    p.add_argument("--sequence_length", type=int, default=512, help="for the activation estimate")
    p.add_argument("--activation_checkpointing", action="store_true",
                   help="activations: keep only each layer's input (the estimate), as with "
                        "activation checkpointing")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(func=run)


def parse_sizes(text: str | None, pp_schedule: str = "1F1B", pp_microbatches: int | None = None) -> Any:
    """`dp_shard=4,tp=2` as a MeshShape (sizes left out are 1), checked as a ParallelismConfig is; with pp, its
    schedule and microbatches."""
    from ..parallel.config import ParallelismConfig
    from ..parallel.dims import MeshShape

    if not text:
        return None
    sizes: dict[str, Any] = {}  # keyword arguments of MeshShape (ints)
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip().removesuffix("_size")
        if key not in (*MeshShape.DIMS, "ep") or not value.strip().isdigit() or int(value) < 1:
            raise HfBackendError(f"plan: --parallelism item {item!r}: write NAME=SIZE with NAME "
                                 f"one of {', '.join(MeshShape.DIMS)}, ep and SIZE a whole number, "
                                 "e.g. dp_shard=4,tp=2")
        sizes[key] = int(value)
    pipeline: dict[str, Any] = {"pp_schedule": pp_schedule, "pp_microbatches": pp_microbatches} \
        if sizes.get("pp", 1) > 1 else {}
    # one line for ep that cannot split, a schedule that is not one
    ParallelismConfig(**{f"{key}_size": size for key, size in sizes.items()}, **pipeline)
    return MeshShape(**sizes, **pipeline)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def run(args: argparse.Namespace) -> int:
    from ..plan.memory import build_on_meta, plan_memory

    model = build_on_meta(args.model, args.lora, args.lora_targets, args.dtype)
    plan = plan_memory(model, args.strategy, args.num_processes, mixed_precision=args.mixed_precision,
                       shape=parse_sizes(args.parallelism, args.pp_schedule, args.pp_microbatches),
                       batch_size=args.batch_size,
                       sequence_length=args.sequence_length, activation_checkpointing=args.activation_checkpointing)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return 0
    grid = plan.shape.describe()
    print(f"{type(model).__name__}: {plan.parameters:,} parameters, {plan.trainable:,} trained; "
          f"{plan.strategy} on {args.num_processes} process(es) ({grid}); per process:")
    rows = [("parameters", plan.parameter_bytes), ("gradients", plan.gradient_bytes),
            ("optimizer state (AdamW)", plan.optimizer_bytes),
            (f"activations (estimate: batch {args.batch_size} x "
             f"{args.sequence_length} tokens)", plan.activation_bytes),
            ("total", plan.total_bytes)]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {_gib(value):>11}")
    if plan.experts_per_rank:
        print(f"  experts run per process: {plan.experts_per_rank} of each mixture-of-experts layer's")
    for note in plan.notes:
        print(f"  note: {note}")
    return 0
