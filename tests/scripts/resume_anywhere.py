"""The tiny BERT of bert_loop.py trained under one strategy: stopped and saved after some steps, or resumed from a
checkpoint another strategy (or world size) wrote (tests/test_resume_anywhere.py).

The global batch is 12 samples split over the processes (`split_batches`), so every world size steps on the same
samples in the same order; AdamW with a linearly decaying learning rate and clipping at 1.0. Rank 0 writes a JSON
report: the loss and learning rate of each optimizer step this run took, and the logits of a fixed batch at the end.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bert_loop import CONFIG, data
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification

from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin
from hf_backend.utils import set_seed

TOTAL = 12  # optimizer steps of an uninterrupted run: one and a half passes over the 96 samples


def plugins(strategy: str) -> dict:
    if strategy.startswith("zero"):  # "zero2_offload": the optimizer on the CPU, as DeepSpeed's CPU Adam
        offload = "cpu" if strategy.endswith("_offload") else None
        return {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=int(strategy[4]), gradient_clipping=1.0,
                                                    offload_optimizer_device=offload)}
    if strategy.startswith("fsdp"):
        kind = "FULL_STATE_DICT" if strategy == "fsdp_full" else "SHARDED_STATE_DICT"
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["BertLayer"],
                                                              state_dict_type=kind)}
    return {}  # "ddp" in several processes, "single" in one


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", required=True, help="single, ddp, fsdp, fsdp_full, zero0 ... zero3, "
                   "zero1_offload ... zero3_offload")
    p.add_argument("--mixed-precision", default=None)
    p.add_argument("--stop-after", type=int, default=0, help="save into --checkpoint after this step and stop")
    p.add_argument("--resume", default=None, help="load_state this checkpoint first")
    p.add_argument("--done", type=int, default=0, help="the optimizer steps the resumed checkpoint had taken")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--final", default=None, help="save_state here at the end (its weights: the fp32 masters)")
    p.add_argument("--native", default=None, help="DeepSpeed: also write the engine's own checkpoint here at the end "
                   "(tag global_step, as transformers.Trainer does under DeepSpeed), for consolidate to merge")
    args = p.parse_args()

    accelerator = Accelerator(split_batches=True, mixed_precision=args.mixed_precision,
                              **plugins(args.strategy))
    set_seed(42)
    model = BertForSequenceClassification(BertConfig(**{**CONFIG, "num_labels": 3}))  # a bias of 3: ZeRO-3 pads it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (2 * TOTAL))
    loader = DataLoader(data(96), batch_size=12, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if args.resume:
        accelerator.load_state(args.resume)
    report = {"distributed_type": accelerator.distributed_type.value, "losses": [], "lrs": []}
    done = args.done
    while done < TOTAL:
        for ids, labels in loader:
            loss = model(input_ids=ids, labels=labels).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            report["losses"].append(accelerator.reduce(loss.detach(), "mean").item())
            report["lrs"].append(scheduler.get_last_lr()[0])
            done += 1
            if done == args.stop_after:
                accelerator.save_state(args.checkpoint)
                break
            if done == TOTAL:
                break
        if done == args.stop_after:
            break
    if args.final:
        accelerator.save_state(args.final)
    if args.native:
        model.save_checkpoint(args.native, tag="global_step")
    model.eval()
    with torch.no_grad():
        report["logits"] = model(input_ids=data(4).tensors[0]).logits.float().tolist()
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(report, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
