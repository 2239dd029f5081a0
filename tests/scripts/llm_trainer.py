"""A tiny Llama (tied or untied embeddings, optionally with a LoRA adapter; or a tiny Qwen3-MoE: `--model`) fine-tuned
by hf_backend.Trainer under one process, DDP, FSDP2, DeepSpeed ZeRO or a ParallelismConfig grid, instrumented for
tests.

Rank 0 writes a JSON report: the per-step losses and gradient norms, the trainable parameters at the end (full,
flattened, sorted by name), the files of each checkpoint, and what the model looks like after training.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

VOCAB = 48


def rows(n: int, seed: int) -> Dataset:
    """Counting sequences (start, start+step, ...) mod VOCAB of 6-20 tokens: learnable, of uneven lengths."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        start, step, length = r.randrange(VOCAB), r.choice((1, 2, 3)), r.randint(6, 20)
        ids = [(start + i * step) % VOCAB for i in range(length)]
        out.append({"input_ids": ids, "labels": ids})
    return Dataset.from_list(out)


def pad(batch: list[dict], multiple: int = 1, positions: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded to the longest row, rounded up to `multiple`; with `positions`, position ids too (DeepSpeed's
    ALST adapter needs them)."""
    width = -(-max(len(row["input_ids"]) for row in batch) // multiple) * multiple  # rounded up to `multiple`
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, row in enumerate(batch):
        n = len(row["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(row["input_ids"]), torch.tensor(row["labels"]), 1
    out = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if positions:
        out["position_ids"] = torch.arange(width).expand(len(batch), -1).clone()
    return out


def tiny_llama(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied))


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def backend(args: argparse.Namespace) -> dict:
    if args.alst:  # DeepSpeed's own Ulysses over every process, on the --strategy's ZeRO stage
        from hf_backend import ParallelismConfig

        return {"parallelism_config": ParallelismConfig(sp_size=args.alst, sp_backend="deepspeed"),
                **backend(argparse.Namespace(**{**vars(args), "alst": 0}))}
    if args.grid or args.pp > 1:  # [pp x] dp_replicate x dp_shard x tp [x cp [x sp [x ep]]], on the FSDP options
        from hf_backend import ParallelismConfig

        replicate, shard, tp, cp, sp, ep = [*map(int, (args.grid or "1x1").split("x")), 1, 1, 1, 1][:6]
        pp = {"pp_size": args.pp, "pp_schedule": args.schedule} if args.pp > 1 else {}
        return {"parallelism_config": ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp,
                                                        cp_size=cp, sp_size=sp, ep_size=ep, **pp),
                **backend(argparse.Namespace(**{**vars(args), "grid": None, "pp": 1, "strategy": "fsdp_sharded"}))}
    if args.strategy.startswith("fsdp"):
        state_dict_type = "SHARDED_STATE_DICT" if args.strategy == "fsdp_sharded" else "FULL_STATE_DICT"
        block = "Qwen3MoeDecoderLayer" if args.model == "qwen3_moe" else "LlamaDecoderLayer"
        return {"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": [block],
                                                      "state_dict_type": state_dict_type}}
    if args.strategy.startswith("zero"):
        return {"deepspeed": {"zero_optimization": {"stage": int(args.strategy[-1])},
                              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "gradient_clipping": "auto"}}  # the Trainer's AdamW: no DeepSpeed op to build
    return {}


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This process's bytes of the quantized (bitsandbytes), other frozen and trainable parameters and of the
    optimizer state: shards where they are sharded (FSDP's DTensors, DeepSpeed ZeRO-3's partitions)."""
    from torch.distributed.tensor import DTensor

    def size(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else getattr(t, "ds_tensor", t)
        return t.numel() * t.element_size()

    out = {"quantized": 0, "frozen": 0, "trainable": 0, "optimizer": 0}
    for param in {id(p): p for p in model.parameters()}.values():
        kind = "trainable" if param.requires_grad else \
            "quantized" if type(param).__module__.startswith("bitsandbytes") else "frozen"
        out[kind] += size(param)
    inner = getattr(optimizer, "optimizer", optimizer)
    out["optimizer"] = sum(size(v) for state in inner.state.values() for v in state.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp", "fsdp_sharded", "zero2", "zero3"),
                   help="ddp: one process or DDP, by the number of processes")
    p.add_argument("--grid", default=None,
                   help="a ParallelismConfig: dp_replicate x dp_shard x tp [x cp [x sp]], e.g. 1x2x2")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (pp_size), with the --grid's sizes")
    p.add_argument("--schedule", default="1F1B", help="the pp_schedule")
    p.add_argument("--eval", action="store_true", help="evaluate and predict on 16 held-out rows at the end")
    p.add_argument("--pad-multiple", type=int, default=1, help="pad each batch to a multiple of this many tokens")
    p.add_argument("--model", default="llama", choices=("llama", "qwen3_moe"))
    p.add_argument("--alst", type=int, default=0, help="sp_size of DeepSpeed's ALST (with a zero --strategy)")
    p.add_argument("--positions", action="store_true", help="the collator adds position ids")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--qlora", type=int, default=0, choices=(0, 4, 8),
                   help="the base loaded in 4 bits (nf4) or 8 bits by bitsandbytes, as PEFT's QLoRA recipe does")
    p.add_argument("--tied", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--resume", default=None, help="a checkpoint directory")
    p.add_argument("--batch-size", type=int, default=4, help="per process")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--save-final", action="store_true",
                   help="trainer.save_model(output_dir/final) at the end; the logits of a fixed batch in the report")
    p.add_argument("--stock", action="store_true", help="transformers' own Trainer (on Accelerate), one process")
    p.add_argument("--full-logits", action="store_true", help="TrainingArguments(chunked_loss=False)")
    args = p.parse_args()

    if args.stock:
        from transformers import Trainer, TrainingArguments
    else:
        from hf_backend import Trainer, TrainingArguments

    gc.collect()
    gc.freeze()
    if args.qlora:
        import os

        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        base = Path(args.output_dir) / "base" / os.environ.get("RANK", "0")  # the adapter's base_model_name_or_path
        tiny_llama(args.tied).save_pretrained(base)
        bits = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.float32} \
            if args.qlora == 4 else {"load_in_8bit": True}
        model = LlamaForCausalLM.from_pretrained(base, quantization_config=BitsAndBytesConfig(**bits))
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    elif args.model == "qwen3_moe":
        from nd_loop import tiny_model

        model = tiny_model("qwen3_moe")
    else:
        model = tiny_llama(args.tied)
    if args.lora:
        model = with_lora(model)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, lr_scheduler_type="linear",
        warmup_steps=1, max_grad_norm=0.5, logging_steps=1, save_strategy="steps", save_steps=args.save_steps,
        per_device_eval_batch_size=2 * args.batch_size,  # the 16 held-out rows in one step of every grid here
        report_to="none", disable_tqdm=True, seed=0, gradient_checkpointing=args.gradient_checkpointing,
        **({} if args.stock else {"async_save": args.async_save, "chunked_loss": not args.full_logits}),
        **backend(args))
    trainer = Trainer(model=model, args=training_args, train_dataset=rows(96, 0),
                      eval_dataset=rows(16, 1) if args.eval else None,
                      data_collator=functools.partial(pad, multiple=args.pad_multiple,
                                                      positions=args.positions or bool(args.alst)))
    head = model.get_output_embeddings()
    chunked: list[bool] = []  # at each step: whether the head computes the loss by chunks (chunked_loss.py)
    trainer.add_callback(type("Chunked", (TrainerCallback,), {
        "on_step_end": lambda self, *a, **k: chunked.append("forward" in vars(head))}))
    trainer.train(resume_from_checkpoint=args.resume)
    logits = None
    pipelined = getattr(trainer, "pipeline", None) is not None  # the model is this rank's pipeline stages
    if args.save_final:
        trainer.save_model(str(Path(args.output_dir) / "final"))
    if args.save_final and not pipelined:
        with torch.no_grad():  # in training mode, as the adapter is checked after loading (no dropout here)
            logits = trainer.model_wrapped(input_ids=torch.arange(12).view(2, 6)).logits.float()
    evaluated = {}
    if args.eval:
        evaluated["eval_loss"] = trainer.evaluate()["eval_loss"]
        predictions = trainer.predict(rows(16, 1)).predictions
        evaluated["predictions"] = [list(predictions.shape), predictions.reshape(-1)[:: 97].tolist()]
    full = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    trainable = set(full) if pipelined else {n for n, q in unwrapped.named_parameters() if q.requires_grad}
    if trainer.is_world_process_zero():
        params = {n: v for n, v in full.items() if n in trainable}
        flat = torch.cat([v.detach().float().flatten() for _, v in sorted(params.items())]) if params else None
        embeddings = None if pipelined else unwrapped.get_input_embeddings().weight
        report = {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
            "trainable": sorted(trainable),
            "params": flat.tolist() if flat is not None else [],
            "checkpoints": {c.name: sorted(f.name for f in c.iterdir())
                            for c in sorted(Path(args.output_dir).glob("checkpoint-*"))},
            "tied": None if pipelined else unwrapped.get_output_embeddings().weight is embeddings,
            "world_size": training_args.world_size,
            "global_step": trainer.state.global_step,
            "logits": logits.flatten().tolist() if logits is not None else None,
            "bytes": local_bytes(trainer.model_wrapped, trainer.optimizer),
            "chunked": chunked,
            **evaluated,
        }
        Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
