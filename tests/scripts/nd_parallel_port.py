"""Accelerate's examples/torch_native_parallelism/nd_parallel.py on hf_backend (tests/test_nd_parallel_port.py): its
calls, copied here in order with the imports changed (not the file itself), on a tiny Llama saved by the test and a
packed synthetic dataset (TinyStories needs the Hub). What differs from the example, and why:
- `--dtype fp32` (the test's comparisons) as well as the example's bf16;
- dp x tp: transformers 5.23 refuses `from_pretrained(tp_plan="auto", tp_size=..., device_mesh=...)` unless the
  tensor-parallel size is the world size, so there the model is loaded plain and `prepare` applies its tp_plan over
  the run's mesh (docs/parallelism.md, "Loading a model for tensor parallelism");
- one process without torchrun has no process group, so the loss is averaged only where one exists;
- the loss is averaged as a sum and a division: gloo's `ReduceOp.AVG` (torch 2.13 on CPU, which implements it as a
  sum and a division itself) crashed a process with SIGSEGV now and then in this loop (3 of 31 runs of 150 steps on
  dp_shard 2 x cp 2; with SUM 0 of 17; a plain tensor alone, 0 crashes in 12,000 calls);
- no trackers, no performance tracker.
Rank 0 writes a JSON report: each step's averaged loss and the saved files.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_backend import Accelerator  # was: from accelerate import Accelerator
from hf_backend.parallelism_config import ParallelismConfig  # was: accelerate.parallelism_config
from hf_backend.utils import FullyShardedDataParallelPlugin, set_seed  # was: accelerate.utils


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=16)
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--save-dir", type=str, required=True)
    parser.add_argument("--checkpoint-frequency", type=int, default=2)
    parser.add_argument("--model-name", type=str, required=True)
    parser.add_argument("--batch-size", type=int, default=1, help="per data-parallel rank (the example's 1)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def packed_rows(n: int, seq_len: int, vocab: int) -> list[dict]:
    """The example's packed sequences (input_ids, shift_labels, labels), made from a fixed token stream."""
    tokens = (torch.arange(n * (seq_len + 1)) * 7 + 3) % vocab
    rows = []
    for i in range(n):
        full = tokens[i * (seq_len + 1):(i + 1) * (seq_len + 1)].tolist()
        rows.append({"input_ids": full[:-1], "shift_labels": full[1:], "labels": full[1:]})
    return rows


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
        if dist.is_initialized():  # the example's ReduceOp.AVG, as a sum and a division (see the docstring)
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=loss_reduce_grp)
            loss /= dist.get_world_size(loss_reduce_grp)
    return loss


def train(args: argparse.Namespace) -> dict:
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
    mixed_precision = "bf16" if args.dtype == "bf16" else "no"
    accelerator = Accelerator(
        mixed_precision=mixed_precision, parallelism_config=parallelism_config, fsdp_plugin=fsdp2_plugin
    )
    model_kwargs = (
        {"tp_size": args.tp_size, "tp_plan": "auto", "device_mesh": accelerator.torch_device_mesh}
        if args.tp_size > 1 and args.tp_size == accelerator.num_processes
        else {}
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name,
        dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
        use_cache=False,
        **model_kwargs,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data_parallel = parallelism_config.data_parallel_size
    dataset = packed_rows(args.num_steps * args.batch_size * data_parallel, args.sequence_length,
                          model.config.vocab_size)
    dataloader = DataLoader(dataset, batch_size=args.batch_size, collate_fn=create_collate_fn())
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    total_num_steps = min(args.num_steps, len(dataloader))
    losses = []
    for step, batch in enumerate(dataloader):
        if step >= total_num_steps:
            break
        loss = forward(model, batch, optimizer, accelerator)
        losses.append(loss.item())
        if step % args.checkpoint_frequency == 0 and step > 0 and parallelism_config.dp_shard_enabled:
            accelerator.save_state(args.save_dir + f"/checkpoint-{step}")
    # the example's `model.save_pretrained(dir)` writes the shards' DTensors, which safetensors cannot (the same under
    # Accelerate); Accelerate's documented form for sharded models gathers the weights first
    model.save_pretrained(args.save_dir + "/model", is_main_process=accelerator.is_main_process,
                          state_dict=accelerator.get_state_dict(model))
    mesh = accelerator.torch_device_mesh
    report = {"losses": losses, "world": accelerator.num_processes,
              "tokens_per_device": args.sequence_length / parallelism_config.non_data_parallel_size,
              "mesh": {name: mesh[name].size() for name in (*mesh.mesh_dim_names, "dp", "dp_shard_cp", "dp_cp")}
              if mesh is not None else None,
              "fsdp_dims": accelerator.parallelism_config.fsdp_dim_names,
              "saved": sorted(os.listdir(args.save_dir))}
    accelerator.end_training()
    return report


if __name__ == "__main__":
    set_seed(42)
    arguments = parse_args()
    result = train(arguments)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(arguments.out, "w") as f:
            json.dump(result, f)
