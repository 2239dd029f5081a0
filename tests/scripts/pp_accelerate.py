"""An Accelerate loop on pipeline stages (tests/test_pipeline.py): `Accelerator(parallelism_config=
ParallelismConfig(pp_size=..., dp_shard_size=..., pp_schedule=...))`, the model, an SGD optimizer and a DataLoader of
the global batches prepared together, and the loop's one change: `loss = accelerator.forward_backward(model, batch)`
in place of `model(**batch).loss` and `accelerator.backward(loss)`; clipping at 0.5 with `accelerator.clip_grad_norm_`.
`--accumulate 2` steps every second micro batch inside `accelerator.accumulate(model)`. The one-process reference
(the same model and batches in a plain loop, with the same accumulation) runs first in every process. Rank 0 writes
each step's loss and clipped norm, the reference's, the largest parameter difference over the ranks, how far
`accelerator.forward_only` (loss and logits of 8 held-out rows padded on the left) is from the reference's, and the
refusals of what the loop may not call.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from pp_loop import CLIP, LR, batches, tiny
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from hf_backend import Accelerator, ParallelismConfig
from hf_backend.core.errors import HfBackendError


def rows() -> list[dict]:
    """The global batches as dataset rows, in order."""
    return [{"input_ids": ids[i], "labels": labels[i]} for ids, labels in batches() for i in range(len(ids))]


def one_process(accumulate: int, name: str, layers: int, bf16: bool = False) -> dict:
    model = tiny(name, layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    micro = DataLoader(rows(), batch_size=8 // accumulate)
    for step, batch in enumerate(micro, 1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        (loss / accumulate).backward()
        losses.append(float(loss.detach()))
        if step % accumulate == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        evaluated = model(**held_out())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "eval": evaluated}


def held_out() -> dict:
    """8 rows, padded on the left by 0 to 5 tokens (the mask goes to every stage); neither the padding nor the first
    real token (predicted from padding, which cp's and transformers' masks treat differently) is a target."""
    ids, labels = batches()[0]
    mask = torch.ones_like(ids)
    for row in range(len(ids)):
        mask[row, : row % 6] = 0
        labels[row, : row % 6 + 1] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def refusals(accelerator: Accelerator, model: torch.nn.Module, batch: dict) -> list[str]:
    said = []
    shorter = {k: v[:, :-1] for k, v in batch.items()}
    for call in (lambda: model(**batch), lambda: accelerator.backward(torch.ones((), requires_grad=True)),
                 lambda: accelerator.forward_backward(model, shorter)):
        try:
            call()
        except HfBackendError as refused:
            said.append(str(refused))
    return said


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--model", default="llama", choices=("llama", "qwen3"))
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16"))
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--microbatches", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = 2 * args.pp  # two blocks a stage (pp_loop.py)
    reference = one_process(args.accumulate, args.model, layers, args.mixed_precision == "bf16")
    config = ParallelismConfig(pp_size=args.pp, dp_shard_size=args.dp_shard, dp_replicate_size=args.dp_replicate,
                               tp_size=args.tp, cp_size=args.cp, sp_size=args.sp, pp_schedule=args.schedule,
                               pp_microbatches=args.microbatches)
    accelerator = Accelerator(parallelism_config=config, split_batches=True, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.accumulate)
    model = tiny(args.model, layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(rows(), batch_size=8 // args.accumulate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = accelerator.forward_backward(model, batch)
            norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss))
        if norm is not None:
            norms.append(float(norm))
    worst = torch.tensor(max(float(((p.full_tensor() if isinstance(p, DTensor) else p).detach()
                                    - reference["params"][name]).abs().max())
                             for name, p in model.named_parameters()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    said = refusals(accelerator, model, next(iter(loader)))
    sliced = args.cp > 1 or args.sp > 1  # each rank would hold a slice of the logits: the loss only
    evaluated = accelerator.forward_only(model, held_out(), logits=not sliced)
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "reference": reference["losses"], "norms": norms,
                       "reference_norms": reference["norms"], "params": float(worst), "refusals": said,
                       "eval_loss": abs(float(evaluated.loss - reference["eval"].loss)),
                       "eval_logits": 0.0 if sliced else
                       float((evaluated.logits - reference["eval"].logits).abs().max()),
                       "held": sum(p.numel() for p in model.parameters()),
                       "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                       "local": sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                                    for p in model.parameters()),
                       "parameters": sum(p.numel() for p in reference["params"].values())}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
