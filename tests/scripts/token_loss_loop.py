"""An Accelerator loop that trains a causal LM on the exact token-level loss of each global batch: uneven padded
sequences (or packed, padding-free rows with position_ids) under any number of processes and accumulation steps.

The pattern (docs/llm.md, "Your own loop"): take the micro-batches of one optimizer step first and count the label
tokens the loss averages over in all of them, in every process (`accelerator.gather(...).sum()`); give the model
that count (`num_items_in_batch`: its loss is then a sum divided by it) and multiply by the number of processes,
which the gradient all-reduce divides by; accumulate with `no_sync` on all but the last micro-batch (not
`accumulate()`, which would sync early: taking the last batch ahead marks the end of the loader). One SGD step then
equals one process's step on the whole global batch. `use_cache=False`: with a cache, transformers (5.23) does not
build the packed-sequence mask, and packed sequences attend to each other. Rank 0 writes a JSON report: the loss of
each global batch and the final parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_backend import Accelerator

VOCAB = 40


def sequences(n: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, VOCAB) for _ in range(r.randint(3, 16))] for _ in range(n)]


def padded(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = labels[i, :len(row)] = torch.tensor(row)
    return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -100).long()}


def packed(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """One row, each sequence's positions from 0: attention stays within a sequence, and each sequence's first label
    is -100 so no token is predicted across a boundary."""
    ids = torch.tensor([t for row in rows for t in row])[None]
    labels = torch.tensor([-100 if i == 0 else t for row in rows for i, t in enumerate(row)])[None]
    positions = torch.tensor([i for row in rows for i in range(len(row))])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def label_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens a causal LM's loss averages over: labels shifted by one, -100 left out."""
    return batch["labels"][..., 1:].ne(-100).sum()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=8, help="per process and micro step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--packing", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    args = p.parse_args()

    plugin = None
    if args.fsdp:
        from hf_backend import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="LlamaDecoderLayer")
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = sequences(8 * args.steps, 0)
    collate = packed if args.packing else padded
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, micro_batches = [], iter(loader)
    for _ in range(args.steps):
        batches = [next(micro_batches) for _ in range(args.grad_accum)]
        tokens = accelerator.gather(sum(label_tokens(b) for b in batches).reshape(1)).sum()
        total = torch.zeros(())
        for i, batch in enumerate(batches):
            with accelerator.no_sync(model) if i < len(batches) - 1 else contextlib.nullcontext():
                loss = model(**batch, num_items_in_batch=tokens, use_cache=False).loss  # its sum / global tokens
                accelerator.backward(loss * accelerator.num_processes)
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(total, reduction="sum")))
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        flat = torch.cat([v.float().flatten() for _, v in sorted(state.items())])
        Path(args.out).write_text(json.dumps({"losses": losses, "params": flat.tolist()}))
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
