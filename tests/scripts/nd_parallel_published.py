"""Accelerate's examples/torch_native_parallelism/nd_parallel.py as published, its imports changed
(tests/test_nd_parallel_port.py): the same calls in the same order, its own copy here rather than the file. What is
not the example's, and why:
- the data: utils.get_dataset's steps (tokenize, labels, pack into sequence length + 1, shuffle with seed 42) on a
  fixed local text instead of TinyStories, which needs the Hub;
- no `log_with=["wandb"]` (wandb is not installed here: hf_backend refuses a tracker it cannot import, in one line)
  and no PerformanceTracker (it reads GPU memory statistics);
- `--batch-size` (the example's 1) for the one-process reference on the same global batch, and `--out`: rank 0
  writes each step's loss, the run's mesh and how far the run got;
- `--gathered-save` (off by default): the example's final `model.save_pretrained(dir)` may fail (an FSDP-sharded
  model: safetensors cannot write its DTensors, on Accelerate too) and the run goes on to save in the form
  docs/parallelism.md gives, `save_pretrained(dir, is_main_process=..., state_dict=accelerator.get_state_dict(model))`,
  into save-dir/gathered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_backend import Accelerator  # was: from accelerate import Accelerator
from hf_backend.parallelism_config import ParallelismConfig  # was: from accelerate.parallelism_config
from hf_backend.utils import FullyShardedDataParallelPlugin, set_seed  # was: from accelerate.utils

TEXT = ("once upon a time a small cat sat on the mat and the big dog ran to the park where the sun was warm and the "
        "birds sang a song for the children who played in the green grass until the night came")
STORY = TEXT.split()


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--save-dir", type=str, default="./outputs")
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--model-name", type=str, required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gathered-save", action="store_true")
    return parser.parse_args()


def setup_tokenizer(model_id):
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def get_dataset(tokenizer, seq_len, accelerator=None):
    """utils.get_dataset's steps on 200 short stories made from STORY."""
    processing_ctx = accelerator.main_process_first
    raw_dataset = Dataset.from_dict({"text": [" ".join(STORY[i % 7:] + STORY[:i % 7]) for i in range(200)]})

    def tokenize_function(examples):
        tokenized_batch = tokenizer(examples["text"], padding=False, truncation=True, max_length=seq_len,
                                    return_tensors=None)
        tokenized_batch["labels"] = tokenized_batch["input_ids"].copy()
        return tokenized_batch

    with processing_ctx():
        tokenized_dataset = raw_dataset.map(tokenize_function, batched=True, remove_columns=["text"])

    def create_packed_sequences(examples):
        all_tokens = [token for input_ids in examples["input_ids"] for token in input_ids]
        num_sequences = len(all_tokens) // (seq_len + 1)
        packed_input_ids, packed_labels, packed_position_ids = [], [], []
        for i in range(num_sequences):
            full_sequence = all_tokens[i * (seq_len + 1):(i + 1) * (seq_len + 1)]
            packed_input_ids.append(full_sequence[:-1])
            packed_labels.append(full_sequence[1:])
            packed_position_ids.append(torch.arange(0, seq_len))
        return {"input_ids": packed_input_ids, "shift_labels": packed_labels, "position_ids": packed_position_ids,
                "labels": packed_labels}

    with processing_ctx():
        packed_dataset = tokenized_dataset.map(create_packed_sequences, batched=True,
                                               remove_columns=tokenized_dataset.column_names, batch_size=1000)
    return packed_dataset.shuffle(seed=42)


def create_collate_fn():
    def collate_fn(batch):
        input_ids = torch.tensor([item["input_ids"] for item in batch], dtype=torch.long)
        shift_labels = torch.tensor([item["shift_labels"] for item in batch], dtype=torch.long)
        return {"input_ids": input_ids, "shift_labels": shift_labels, "labels": shift_labels}

    return collate_fn


def forward(model, batch, optimizer, accelerator: Accelerator):
    batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1), device=batch["input_ids"].device).unsqueeze(0)
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        loss_reduce_grp = (
            accelerator.torch_device_mesh["dp_cp"].get_group()
            if accelerator.parallelism_config.dp_cp_dim_names
            else None
        )
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=loss_reduce_grp)
    return loss


def train(args, report):
    parallelism_config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
    )
    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )
    accelerator = Accelerator(mixed_precision="bf16", parallelism_config=parallelism_config, fsdp_plugin=fsdp2_plugin)
    accelerator.init_trackers("nd_parallel_training")
    report["world"] = accelerator.num_processes

    model_kwargs = (
        {"tp_size": args.tp_size, "tp_plan": "auto", "device_mesh": accelerator.torch_device_mesh}
        if args.tp_size > 1
        else {}
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name,
        torch_dtype=torch.bfloat16,
        use_cache=False,
        **model_kwargs,
    )
    tokenizer = setup_tokenizer(args.model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    dataset = get_dataset(tokenizer, args.sequence_length, accelerator)
    dataloader = DataLoader(dataset, batch_size=args.batch_size, collate_fn=create_collate_fn())

    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    report["stage"] = "prepared"
    mesh = accelerator.torch_device_mesh
    report["mesh"] = {name: mesh[name].size() for name in (*mesh.mesh_dim_names, "dp", "dp_shard_cp", "dp_cp")} \
        if mesh is not None else None
    report["fsdp_dims"] = accelerator.parallelism_config.fsdp_dim_names

    total_num_steps = min(args.num_steps, len(dataloader))
    accelerator.print("Starting training...")
    for step, batch in enumerate(dataloader):
        if step >= total_num_steps:
            break
        loss = forward(model, batch, optimizer, accelerator)
        report["losses"].append(loss.item())
        accelerator.print(f"Step {step}/{total_num_steps}, Loss: {loss.item():.4f}")
        if step % args.checkpoint_frequency == 0 and step > 0 and parallelism_config.dp_shard_enabled:
            accelerator.print(f"Saving checkpoint at step {step}...")
            accelerator.save_state(args.save_dir + f"/checkpoint-{step}")
        accelerator.log({"loss": loss.item()})
    accelerator.print("Training completed!")
    report["stage"] = "trained"

    try:
        model.save_pretrained(args.save_dir + f"/{args.model_name}")
    except RuntimeError as err:
        if not args.gathered_save:
            raise
        report["save_error"] = str(err)
    if args.gathered_save:  # on every rank (the failure above is rank 0's alone)
        model.save_pretrained(args.save_dir + "/gathered", is_main_process=accelerator.is_main_process,
                              state_dict=accelerator.get_state_dict(model))
    accelerator.print(f"Model saved to {args.save_dir}/{args.model_name}")
    report["stage"] = "saved"
    accelerator.end_training()


if __name__ == "__main__":
    set_seed(42)
    args = parse_args()
    report = {"losses": [], "stage": "started"}
    try:
        train(args, report)
    except Exception as err:  # how far it got, and the failure's last frame, for the test's assertions
        report["error"] = f"{type(err).__name__}: {err}"
        report["where"] = traceback.extract_tb(err.__traceback__)[-1].filename
        raise
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            report["saved"] = sorted(os.listdir(args.save_dir)) if os.path.isdir(args.save_dir) else []
            with open(args.out, "w") as f:
                json.dump(report, f)
    sys.exit(0)
