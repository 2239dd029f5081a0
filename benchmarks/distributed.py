"""DDP against FSDP2 and DeepSpeed ZeRO on the same BERT-shaped model and data, side by side in one 2-process run:
median step time and per-rank bytes of parameters, gradients and optimizer state (measured from each rank's local
shards; DeepSpeed keeps gradients in its own buffers, so that column shows "-" for it).

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/distributed.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin
from hf_backend.utils import gather_object, set_seed

CONFIG = BertConfig(vocab_size=2000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    intermediate_size=1024, max_position_embeddings=128, num_labels=2)


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is not None:
            t = getattr(t, "ds_tensor", None) if hasattr(t, "ds_tensor") else t  # a ZeRO-3 partition
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def measure(accelerator: Accelerator, steps: int) -> dict[str, float]:
    set_seed(0)
    model = BertForSequenceClassification(CONFIG)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2000, (steps * 16 + 64, 64), generator=g)
    loader = DataLoader(TensorDataset(ids, ids[:, 0] % 2), batch_size=8, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    times, grads = [], 0
    for i, (x, y) in enumerate(loader):
        start = time.perf_counter()
        loss = model(input_ids=x, labels=y).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        grads = local_bytes(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        if i == steps + 4:
            break
    state = local_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim)
    result = {"step_s": statistics.median(times[5:]), "params": local_bytes(model.parameters()), "grads": grads,
              "optim": state}
    accelerator.free_memory()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    variants = {
        "DDP": {},
        "FSDP FULL_SHARD": {"fsdp_plugin": FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD")},
        "FSDP SHARD_GRAD_OP": {"fsdp_plugin": FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP")},
        "DeepSpeed ZeRO-2": {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0)},
        "DeepSpeed ZeRO-3": {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0)},
    }
    results = {}
    for name, plugin in variants.items():
        accelerator = Accelerator(**plugin)  # the process group is set up once and shared
        results[name] = gather_object([measure(accelerator, args.steps)])
    if accelerator.is_main_process:
        base = results["DDP"][0]
        print(f"BERT {CONFIG.num_hidden_layers}x{CONFIG.hidden_size}, seq 64, micro-batch 8 per rank, 2 gloo "
              f"processes, median of {args.steps} steps")
        print("| variant | step time (s) | vs DDP | params / rank (MB) | grads / rank (MB) | optimizer / rank (MB) |"
              "\n|---|---|---|---|---|---|")
        for name, per_rank in results.items():
            r = per_rank[0]
            grads = f"{r['grads'] / 1e6:.2f}" if r["grads"] else "-"
            print(f"| {name} | {r['step_s']:.4f} | {r['step_s'] / base['step_s']:.2f}x | {r['params'] / 1e6:.2f} | "
                  f"{grads} | {r['optim'] / 1e6:.2f} |")
    accelerator.end_training()


if __name__ == "__main__":
    main()
