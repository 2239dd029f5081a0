"""Pipeline parallelism's stages and schedules against one process (tests/test_pipeline.py): the processes are a pp x
dp_replicate x dp_shard x tp grid (`--dp-replicate`, `--dp-shard`, `--tp`, default 1), each stage split by the model's
tp plan over the tp ranks (which read the same rows) and sharded by FSDP2 over the dp_shard ranks (per block, then the
stage; HSDP with dp_replicate), the data-parallel ranks splitting each global batch's rows. For each model (a tiny Llama
and a tiny dense Qwen3 from configs, two decoder layers a stage: 2 x pp) and each schedule asked, every rank first
trains the whole model alone (the one-process reference, on the same global batch of 8 sequences with some targets
masked), then its stages of a fresh copy of the same weights through the schedule (hf_backend/strategies/pipeline.py): 2
SGD steps with clipping at 0.5. Rank 0 writes a JSON report: per model and schedule, the largest differences over the
ranks of each step's loss, the clipped norm and the parameters at the end from one process's, and each rank's stages.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_backend.strategies.pipeline import Pipeline
from hf_backend.strategies.tensor_parallel import apply_tensor_parallel

VOCAB, SEQ, GLOBAL_BATCH, STEPS, CLIP, LR = 48, 12, 8, 2, 0.5, 0.5
MODELS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def tiny(name: str, layers: int = 8) -> torch.nn.Module:
    config_class, model_class = MODELS[name]
    torch.manual_seed(0)
    return model_class(config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=64, tie_word_embeddings=False, use_cache=False))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt
        labels[torch.rand(labels.shape, generator=generator) < 0.2] = -100
        out.append((ids, labels))
    return out


def one_process(name: str, layers: int) -> dict:
    model = tiny(name, layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for ids, labels in batches():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def pipelined(name: str, schedule: str, microbatches: int, mesh: DeviceMesh, dp: DeviceMesh) -> tuple[dict, Pipeline]:
    """`dp`: every rank with other rows (dp_replicate x dp_shard, flattened)."""
    tp = mesh["tp"]
    fsdp = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]  # HSDP, FSDP

    def shard(stage: torch.nn.Module) -> None:
        if tp.size() > 1:  # the model's tp plan, by its names
            apply_tensor_parallel(stage, tp)
        if dp.size() > 1:
            for block in stage.part.layers.values():
                fully_shard(block, mesh=fsdp)
            fully_shard(stage, mesh=fsdp)

    sharded = dp.size() > 1
    pipeline = Pipeline(tiny(name, 2 * mesh["pp"].size()), mesh["pp"].get_group(), schedule, microbatches,
                        data_parallel=dp.get_group() if sharded else None,
                        parallelize=shard if sharded or tp.size() > 1 else None)
    optimizer = torch.optim.SGD(list(pipeline.parameters()), lr=LR)
    losses, norms = [], []
    rows = GLOBAL_BATCH // dp.size()
    mine = slice(dp.get_local_rank() * rows, (dp.get_local_rank() + 1) * rows)
    for ids, labels in batches():
        losses.append(float(pipeline.step(ids[mine], labels[mine])))
        norms.append(float(pipeline.clip_grad_norm_(CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in pipeline.named_parameters().items()}
    return {"losses": losses, "norms": norms, "params": params}, pipeline


def largest(values: list[float]) -> float:
    worst = torch.tensor(max(values, default=0.0))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="llama,qwen3")
    parser.add_argument("--schedules", default="GPipe,1F1B,Interleaved1F1B")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    per_pp_rank = args.dp_replicate * args.dp_shard * args.tp  # the ranks holding one pp rank's stages
    pp = dist.get_world_size() // per_pp_rank
    mesh = init_device_mesh("cpu", (pp, args.dp_replicate, args.dp_shard, args.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    # two blocks a stage, so that the schedules with two stages a rank (interleaved, V) split the model too
    report: dict = {"pp": pp, "per_pp_rank": per_pp_rank, "layers": 2 * pp, "runs": {}}
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    for name in args.models.split(","):
        reference = one_process(name, 2 * pp)
        for schedule in args.schedules.split(","):
            run, pipeline = pipelined(name, schedule, args.microbatches, mesh, dp)
            held = run["params"]
            params = [float((p.detach() - reference["params"][n]).abs().max()) for n, p in held.items()]
            # the other shards hold the same stages
            first_shard = all(mesh[dim].get_local_rank() == 0 for dim in ("dp_replicate", "dp_shard", "tp"))
            counted = torch.tensor(sum(p.numel() for p in held.values()) if first_shard else 0)
            dist.all_reduce(counted)
            layouts = [None] * dist.get_world_size()
            dist.all_gather_object(layouts, pipeline.describe())
            report["runs"][f"{name}/{schedule}"] = {
                "loss": largest([abs(a - b) for a, b in zip(run["losses"], reference["losses"])]),
                "norm": largest([abs(a - b) for a, b in zip(run["norms"], reference["norms"])]),
                "params": largest(params),
                "losses": run["losses"], "reference": reference["losses"],
                "parameters_held": int(counted),
                "parameters": sum(p.numel() for p in reference["params"].values()), "ranks": layouts}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()



if __name__ == "__main__":
    main()
