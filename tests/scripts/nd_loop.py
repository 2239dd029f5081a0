"""A tiny Llama (or a tiny Qwen3-MoE or Mixtral: `--model`) trained by an Accelerator loop on one process grid
(tests/test_parallelism.py, tests/test_experts.py), saving a checkpoint along the way, or resumed from checkpoints
other grids (or strategies) wrote.

Every run sees the same global batch of 8 sequences per step (split_batches: the data-parallel ranks split it),
so one process is the reference for every grid. The labels are given already shifted (`shift_labels`), and the
model is called inside `maybe_context_parallel` on every grid, with no item count: under cp or sp the engine makes
its loss the mean over the whole sequences, however unevenly the targets fall into the slices (the padded and
packed layouts). Rank 0 writes a JSON report: each step's loss (the mean over the global batch) and clipped gradient
norm, the full trainable parameters at the end, the bytes of rank 0's parameter shards, and how a mixture of experts'
experts are held.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin, ParallelismConfig
from hf_backend.utils import set_seed

VOCAB, SEQ, GLOBAL_BATCH, CLIP = 48, 16, 8, 0.5


# --model: its classes, and its block (FSDP's unit)
MODELS = {"llama": (LlamaConfig, LlamaForCausalLM, "LlamaDecoderLayer"),
          "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, "Qwen3MoeDecoderLayer"),
          "mixtral": (MixtralConfig, MixtralForCausalLM, "MixtralDecoderLayer")}
MODEL, AUX_LOSS = "llama", False  # what main() was asked


def tiny_model(name: str = "llama", aux_loss: bool = False) -> torch.nn.Module:
    """`name` (a key of MODELS), tiny; the mixtures of experts have 8 experts, 2 per token (Qwen3-MoE's second layer
    a dense MLP), and add the router's load-balancing loss to theirs with `aux_loss`."""
    config_class, model_class, _ = MODELS[name]
    moe = {"num_local_experts": 8, "num_experts_per_tok": 2, "output_router_logits": aux_loss}
    sizes = {"qwen3_moe": {**moe, "moe_intermediate_size": 16, "mlp_only_layers": [1], "intermediate_size": 64},
             "mixtral": {**moe, "intermediate_size": 16}}.get(name, {"intermediate_size": 64})
    torch.manual_seed(0)
    return model_class(config_class(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        # without a cache, transformers reads packed position ids as separate sequences (with one, as one causal row)
        use_cache=False, **sizes))


def tiny_llama() -> torch.nn.Module:
    return tiny_model()


def experts_layout(model: torch.nn.Module) -> dict | None:
    """How the first MoE layer's experts are held: the mesh and placements of its `gate_up_proj`, how many experts
    each ep rank runs (the global rows over the ep ranks), and the rows of this rank's FSDP shard."""
    experts = next((m for m in model.modules() if type(m).__name__.endswith("Experts")), None)
    weight = getattr(experts, "gate_up_proj", None)
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or "ep" not in mesh.mesh_dim_names:
        return None
    held = weight.shape[0] // mesh.size(mesh.mesh_dim_names.index("ep"))
    return {"mesh": list(mesh.mesh_dim_names), "placements": [str(p) for p in weight.placements],
            "experts_per_rank": held, "local_rows": weight.to_local().shape[0]}


def rows(n: int, layout: str = "full") -> list[dict[str, torch.Tensor]]:
    """`layout`: "full" (every target real), "padded" / "left" (padded on the right / left, an attention mask,
    the first tokens' targets masked too: the slices hold uneven numbers of targets), "packed" (two to three
    sequences per row, position ids restarting, no mask)."""
    g = torch.Generator().manual_seed(3)
    starts, steps = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (starts + steps * torch.arange(SEQ + 1)) % VOCAB
    out = [{"input_ids": row[:-1], "labels": row[1:].clone(), "position_ids": torch.arange(SEQ)} for row in ids]
    for row in out:
        if layout in ("padded", "left"):
            length = int(torch.randint(5, SEQ + 1, (1,), generator=g))
            real = torch.arange(SEQ) < length
            row["labels"][~real | (torch.arange(SEQ) >= length - 1)] = -100
            row["labels"][:int(torch.randint(0, 4, (1,), generator=g))] = -100
            row["input_ids"] = torch.where(real, row["input_ids"], torch.zeros_like(row["input_ids"]))
            if layout == "left":
                real, row["input_ids"], row["labels"] = real.flip(0), row["input_ids"].roll(SEQ - length), \
                    row["labels"].roll(SEQ - length)
            row["attention_mask"] = real.long()
            row["position_ids"] = (real.long().cumsum(0) - 1).clamp(min=0)
        elif layout == "packed":
            cuts = sorted(torch.randperm(SEQ - 2, generator=g)[:int(torch.randint(1, 3, (1,), generator=g))] + 1)
            bounds = [0, *map(int, cuts), SEQ]
            row["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
            row["labels"][[b - 1 for b in bounds[1:]]] = -100  # no target across a sequence's end
    return out


def engine_arguments(grid: str) -> dict:
    """`grid`: "single", "ddp", "fsdp", "zero3", "launched" (the launcher's --parallelism_config_* flags), or the
    sizes dp_replicate x dp_shard x tp [x cp [x sp [x ep]]] ("1x2x2", "1x2x1x2", "1x1x1x1x2", "1x2x1x1x1x2")."""
    block = MODELS[MODEL][2]
    if grid == "fsdp":
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=[block],
                                                              state_dict_type="SHARDED_STATE_DICT")}
    if grid == "zero3":
        return {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=3, gradient_clipping=CLIP)}
    if grid in ("single", "ddp", "launched"):
        return {}
    replicate, shard, tp, cp, sp, ep = [*map(int, grid.split("x")), 1, 1, 1, 1][:6]
    return {"parallelism_config": ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp,
                                                    cp_size=cp, sp_size=sp, ep_size=ep),
            "fsdp_plugin": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=[block],
                                                          state_dict_type="SHARDED_STATE_DICT")}


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any,
               batch: dict) -> tuple[torch.Tensor, float]:
    """One optimizer step on `batch` (inside `maybe_context_parallel` on every grid, clipped to CLIP): this process's
    loss, detached, and the clipped gradient norm."""
    batch["shift_labels"] = batch["labels"]  # already shifted: the loss takes them as they are
    buffers = [batch[k] for k in ("input_ids", "labels", "position_ids", "attention_mask") if k in batch]
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
        loss = model(**batch).loss
        accelerator.backward(loss)
    norm = float(accelerator.clip_grad_norm_(model.parameters(), CLIP))
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach(), norm


def train(accelerator: Accelerator, optimizer_name: str, steps: int, save_at: int = 0,
          checkpoint: str | None = None, resume: str | None = None, layout: str = "full") -> dict:
    """One run on the accelerator's grid: from the start (saving into `checkpoint` after step `save_at`, and going
    on) or from `resume` (which a run saved after step `save_at`)."""
    set_seed(42)
    model = tiny_model(MODEL, AUX_LOSS)
    # AdamW moves an element by lr * g / (|g| + eps): where |g| is near eps, float32 noise dg of another reduction
    # order moves it by up to lr * dg / eps. eps 1e-6 bounds that by 1e-5 for dg ~ 1e-9 (at torch's 1e-8, one expert
    # element of 28096 differed by 1e-4 on an AMD EPYC, every other within 5e-5); SGD's 1e-6 checks the gradients.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5) if optimizer_name == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-6)
    loader = DataLoader(rows(GLOBAL_BATCH * steps, layout), batch_size=GLOBAL_BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    experts = experts_layout(model)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())
    if resume:
        accelerator.load_state(resume)
    losses, norms = [], []
    for step, batch in enumerate(loader, start=save_at + 1 if resume else 1):
        loss, norm = train_step(accelerator, model, optimizer, batch)
        losses.append(float(accelerator.reduce(loss, "mean")))  # the mean over the global batch
        norms.append(norm)
        if step == save_at and checkpoint and not resume:
            accelerator.save_state(checkpoint)
    state = accelerator.get_state_dict(model)
    accelerator.free_memory(model, optimizer, loader)
    return {"losses": losses, "norms": norms, "experts": experts, "parameter_bytes": held,
            "params": {name: tensor.float().flatten().tolist() for name, tensor in sorted(state.items())}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--grid", default="single")
    p.add_argument("--model", default="llama", choices=list(MODELS))
    p.add_argument("--aux-loss", action="store_true", help="a mixture of experts adds its router's load-balancing loss")
    p.add_argument("--optimizers", default="adamw", help="comma-separated: sgd, adamw; each trains a fresh model")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int, default=2, help="the AdamW run saves into --checkpoint after this step")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--resume", default="", help="comma-separated checkpoints, each resumed in turn (AdamW)")
    p.add_argument("--layouts", default="full", help="comma-separated: full, padded, left, packed; the AdamW "
                                                      "run is repeated on each layout but the first (adamw/LAYOUT)")
    args = p.parse_args()
    global MODEL, AUX_LOSS
    MODEL, AUX_LOSS = args.model, args.aux_loss

    accelerator = Accelerator(split_batches=True, **engine_arguments(args.grid))
    if args.resume:
        report = {source: train(accelerator, "adamw", args.steps, args.save_at, resume=source)
                  for source in args.resume.split(",")}
    else:
        first, *others = args.layouts.split(",")
        report = {name: train(accelerator, name, args.steps, args.save_at, args.checkpoint if name == "adamw" else None,
                              layout=first)
                  for name in args.optimizers.split(",")}
        report.update({f"adamw/{layout}": train(accelerator, "adamw", args.steps, layout=layout) for layout in others})
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            grid = accelerator.parallelism_config
            json.dump({"runs": report, "data_parallel": accelerator.strategy.data_shard.count,
                       "grid": grid.to_json() if grid is not None else None}, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
