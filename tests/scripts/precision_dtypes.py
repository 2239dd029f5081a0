"""What dtype the optimizer steps, keeps its state in and receives gradients in, for a tiny Llama loaded in bf16 (or
the same weights in fp32 or fp16), trained a few AdamW steps through the engine under each strategy given; rank 0
writes a JSON report. One run per (strategy, loaded dtype), in the job's processes (1 for "single", 2 for the
others).

Usage: precision_dtypes.py OUT --strategies ddp,fsdp,zero2,zero3 [--mixed-precision bf16] [--loaded bf16,fp32]
       [--steps 3] [--lr 1e-5] [--save DIR] (save_state of each strategy's first run into DIR/<strategy>)
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_backend.core.notes
from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)


def tiny_llama(loaded: str) -> LlamaForCausalLM:
    """The same weights every time: initialised in fp32 from seed 0, rounded to bf16; `loaded="fp32"` holds those
    bf16 values in fp32 (exactly), so a difference between the two runs is what training does, not the load."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, dtype=torch.bfloat16)).to(torch.bfloat16)
    return model.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[loaded])


def accelerator_for(strategy: str, mixed_precision: str) -> Accelerator:
    if strategy == "fsdp":
        plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")  # DCP checkpoints
        return Accelerator(mixed_precision=mixed_precision, fsdp_plugin=plugin)
    if strategy.startswith("zero"):
        return Accelerator(mixed_precision=mixed_precision,
                           deepspeed_plugin=DeepSpeedPlugin(zero_stage=int(strategy[4:]), gradient_clipping=1.0))
    return Accelerator(mixed_precision=mixed_precision)  # one process, or DDP under torchrun


def dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).replace("torch.", "") for t in tensors if t is not None})


def train(strategy: str, loaded: str, mixed_precision: str, steps: int, lr: float, save: str | None) -> dict:
    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())  # type: ignore[method-assign]
    hf_backend.core.notes.logger.addHandler(handler)
    hf_backend.core.notes._said.clear()  # each run's notes, even where an earlier run said the same
    accelerator = accelerator_for(strategy, mixed_precision)
    model = tiny_llama(loaded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # over the loaded parameters, before prepare
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, CONFIG["vocab_size"], (4, 16), generator=g) for _ in range(steps)]
    # a loader is what DeepSpeed reads the micro batch size from
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(batches)), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    inner = optimizer.optimizer  # what steps: torch's AdamW (under DeepSpeed, over the engine's flat partitions)
    seen: dict[str, list[str]] = {}

    def record(opt, args, kwargs):
        params = [p for group in opt.param_groups for p in group["params"]]
        seen["stepped_params"] = dtypes(params)
        seen["stepped_grads"] = dtypes(p.grad for p in params)

    hook = inner.register_step_pre_hook(record)
    module_grads: list[str] = []
    losses = []
    for (ids,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if strategy.startswith("zero"):
                module_grads = ["(reduced into the engine's partitions)"]
            else:
                module_grads = dtypes(p.grad for p in model.parameters())
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach().float(), "mean").item())
    hook.remove()
    state = [v for s in inner.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    full = accelerator.get_state_dict(model)  # collective: full weights on rank 0
    changed = sum(int((full[n].float() != before[n]).sum()) for n in before if n in full)
    report = {
        "strategy": strategy, "loaded": loaded, "mixed_precision": mixed_precision,
        "distributed_type": accelerator.distributed_type.value,
        "module_params": dtypes(accelerator.unwrap_model(model).parameters()),
        "stepped_params": seen.get("stepped_params"), "stepped_grads": seen.get("stepped_grads"),
        "module_grads": module_grads, "optimizer_state": dtypes(state),
        "state_dict": dtypes(full.values()), "losses": losses,
        "weights_changed": changed / sum(t.numel() for t in before.values()),
        "notes": notes,
    }
    if save:
        accelerator.save_state(save)
    accelerator.free_memory(model, optimizer, loader)
    hf_backend.core.notes.logger.removeHandler(handler)
    return report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategies", default="single")
    p.add_argument("--mixed-precision", default="bf16")
    p.add_argument("--loaded", default="bf16,fp32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--save", default=None)
    args = p.parse_args()
    runs = []
    for strategy in args.strategies.split(","):
        for i, loaded in enumerate(args.loaded.split(",")):
            save = f"{args.save}/{strategy}" if args.save and i == 0 else None
            runs.append(train(strategy, loaded, args.mixed_precision, args.steps, args.lr, save))
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
