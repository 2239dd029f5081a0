"""nd_loop.py's tiny Llama trained by an Accelerator loop eagerly, compiled whole or compiled by regions
(`TorchDynamoPlugin(use_regional_compilation=True)`: each decoder layer compiled once), on one grid; every
collective the loop's processes call is counted, step by step.

Rank 0 writes a JSON report: each step's loss and clipped gradient norm, the trainable parameters at the end, each
step's collective calls by name (torch.distributed's functions, wrapped here: FSDP2's all-gathers and reduce-scatters;
DDP's bucket all-reduces, through a communication hook), the number of graphs dynamo has built after each step, and
each step's seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from nd_loop import GLOBAL_BATCH, engine_arguments, rows, tiny_model, train_step
from torch.utils.data import DataLoader

from hf_backend import Accelerator
from hf_backend.utils import TorchDynamoPlugin, set_seed

COUNTED = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
           "all_reduce", "all_gather", "all_to_all_single", "broadcast")
calls: Counter = Counter()


def _counted(original, name: str):
    @functools.wraps(original)
    def counted(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)

    return counted


def count_collectives() -> None:
    """Wrap torch.distributed's collectives so that each call is counted (FSDP2 and DDP look them up at call time;
    the engine's overlapped reduce-scatter on the CPU holds its own reference)."""
    from hf_backend.strategies import fsdp_overlap

    for name in COUNTED:
        setattr(dist, name, _counted(getattr(dist, name), name))
    fsdp_overlap._reduce_scatter = _counted(fsdp_overlap._reduce_scatter, "reduce_scatter_single")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--grid", default="single", help="nd_loop.py's grids: single, ddp, fsdp, 1x1x2 (tp 2), ...")
    p.add_argument("--compile", default="eager", choices=("eager", "whole", "regional"))
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--gradient-checkpointing", action="store_true")
    args = p.parse_args()

    plugin = None if args.compile == "eager" else TorchDynamoPlugin(
        backend=args.backend, use_regional_compilation=args.compile == "regional")
    accelerator = Accelerator(split_batches=True, dynamo_plugin=plugin, **engine_arguments(args.grid))
    count_collectives()
    set_seed(42)
    model = tiny_model()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01) if args.optimizer == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(rows(GLOBAL_BATCH * args.steps), batch_size=GLOBAL_BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.grid == "ddp":  # DDP's reducer all-reduces its buckets in C++: a communication hook counts them
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp = model._orig_mod if hasattr(model, "_orig_mod") else model

        def counted_allreduce(state, bucket):
            calls["ddp_bucket_all_reduce"] += 1
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counted_allreduce)
    from torch._dynamo.utils import counters

    losses, norms, per_step, seconds, graphs = [], [], [], [], []
    for batch in loader:
        started = time.perf_counter()
        calls.clear()
        loss, norm = train_step(accelerator, model, optimizer, batch)
        per_step.append(dict(calls))
        seconds.append(time.perf_counter() - started)
        graphs.append(counters["stats"]["unique_graphs"])
        losses.append(float(accelerator.reduce(loss, "mean")))  # the report's, after the step's collectives
        norms.append(norm)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        report = {"losses": losses, "norms": norms, "collectives": per_step, "seconds": seconds,
                  "graphs": graphs,
                  "params": {name: t.float().flatten().tolist() for name, t in sorted(state.items())}}
        with open(args.out, "w") as f:
            json.dump(report, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
