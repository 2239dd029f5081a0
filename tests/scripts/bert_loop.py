"""A small BERT-shaped transformers model trained through the engine (DDP or FSDP), instrumented for the tests.

Writes from rank 0 a JSON report: loss per optimizer step, per-rank bytes of parameters / gradients / optimizer state
(measured from the local shards), the logits of a fixed batch, and whether `free_memory` let the model go.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import weakref

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin
from hf_backend.utils import DummyOptim, DummyScheduler, gather_object, set_seed

CONFIG = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def data(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (n, 16), generator=g)
    return TensorDataset(ids, (ids[:, 0] > 50).long())


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _defer_reduce_scatter() -> dict[str, int]:
    """Every reduce-scatter the FSDP strategy issues completes only when waited for (its output NaN until then), so
    anything reading an output early reads NaN; counts those the strategy left running past the call."""
    from hf_backend.strategies import fsdp_overlap

    counts = {"issued": 0, "left_running": 0}
    real, call = fsdp_overlap._reduce_scatter, fsdp_overlap._OverlappedReduceScatter.__call__

    class Deferred:
        def __init__(self, output: torch.Tensor, result: torch.Tensor) -> None:
            self.output, self.result = output, result

        def wait(self) -> None:
            self.output.copy_(self.result)

    def reduce_scatter(output, input, op, group, async_op):
        result = torch.empty_like(output)
        real(result, input, op=op, group=group)
        output.fill_(float("nan"))
        counts["issued"] += 1
        return Deferred(output, result)

    def counted_call(self, *args, **kwargs):
        call(self, *args, **kwargs)
        counts["left_running"] += self.in_flight.work is not None

    fsdp_overlap._reduce_scatter = reduce_scatter
    fsdp_overlap._OverlappedReduceScatter.__call__ = counted_call
    return counts


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fsdp", default=None, help="sharding strategy; DDP when not given")
    p.add_argument("--zero", type=int, default=None, help="DeepSpeed ZeRO stage; DDP when not given")
    p.add_argument("--ds-config", default=None, help="a DeepSpeed config JSON (with --zero)")
    p.add_argument("--mixed-precision", default=None)
    p.add_argument("--zero3-init", action="store_true", help="zero3_init_flag: partition while building")
    p.add_argument("--ds-optimizer", choices=("optimizer", "optimizer+scheduler"), default=None,
                   help="DeepSpeed builds the optimizer (and scheduler) from config sections, through placeholders")
    p.add_argument("--docs-plugin", action="store_true", help="the docs' plugin with Full*StateDictConfig objects")
    p.add_argument("--state-dict-type", default="SHARDED_STATE_DICT")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--stop-after", type=int, default=0)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--save-model", default=None)
    p.add_argument("--from-pretrained", default=None, help="load the model from this directory")
    p.add_argument("--seed-per-rank", action="store_true", help="seed each rank's model differently")
    p.add_argument("--meta-elsewhere", action="store_true",
                   help="cpu_ram_efficient_loading: ranks other than 0 build the model on the meta device")
    p.add_argument("--deferred-reduce-scatter", action="store_true",
                   help="FSDP on the CPU: a reduce-scatter's output is NaN until it is waited for")
    args = p.parse_args()
    deferred = _defer_reduce_scatter() if args.deferred_reduce_scatter else None

    plugin = None
    if args.docs_plugin:
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

        plugin = FullyShardedDataParallelPlugin(
            state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
            optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False))
    elif args.fsdp:
        plugin = FullyShardedDataParallelPlugin(sharding_strategy=args.fsdp, state_dict_type=args.state_dict_type,
                                                transformer_cls_names_to_wrap=["BertLayer"],
                                                cpu_ram_efficient_loading=args.meta_elsewhere)
    ds_plugin = None
    if args.zero is not None:
        ds_config = json.loads(args.ds_config) if args.ds_config else {}
        if args.ds_optimizer:
            auto = dict.fromkeys(("lr", "weight_decay", "betas", "eps"), "auto")
            # torch_adam: DeepSpeed builds torch's AdamW rather than compiling its FusedAdam op for the CPU (~80 s here)
            ds_config["optimizer"] = {"type": "AdamW", "params": {**auto, "torch_adam": True}}
        if args.ds_optimizer == "optimizer+scheduler":
            ds_config["scheduler"] = {"type": "WarmupLR", "params": dict.fromkeys(
                ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps"), "auto")}
        ds_plugin = DeepSpeedPlugin(hf_ds_config=ds_config or None,
                                    zero_stage=args.zero, gradient_clipping=1.0, zero3_init_flag=args.zero3_init)
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, fsdp_plugin=plugin,
                              deepspeed_plugin=ds_plugin, mixed_precision=args.mixed_precision)
    set_seed(42 + (1000 * accelerator.process_index if args.seed_per_rank else 0))
    if args.from_pretrained:
        model = BertForSequenceClassification.from_pretrained(args.from_pretrained)
    elif args.meta_elsewhere and not accelerator.is_main_process:
        with torch.device("meta"):
            model = BertForSequenceClassification(BertConfig(**CONFIG))
    else:
        model = BertForSequenceClassification(BertConfig(**CONFIG))
    report_meta = {"param_bytes_before_prepare": 0 if next(model.parameters()).is_meta
                   else local_bytes(model.parameters()),
                   "partitioned_before_prepare": all(hasattr(q, "ds_id") for q in model.parameters())}
    loader = DataLoader(data(), batch_size=args.batch_size, shuffle=True)
    scheduler = None
    if args.ds_optimizer:
        optimizer = DummyOptim(model.parameters(), lr=1e-3, weight_decay=0.01)
        if args.ds_optimizer == "optimizer+scheduler":
            scheduler = DummyScheduler(optimizer, warmup_num_steps=4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if scheduler is not None:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.resume:
        accelerator.load_state(args.checkpoint)

    report = {"losses": [], "distributed_type": accelerator.distributed_type.value, **report_meta}
    micro, steps = [], 0
    for _ in range(loader.epoch, args.epochs):
        for ids, labels in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=labels).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    report["grad_norm"] = accelerator.clip_grad_norm_(model.parameters(), 1.0).item()
                    report["bytes_grads"] = local_bytes(q.grad for q in model.parameters())
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
            micro.append(accelerator.reduce(loss.detach(), "mean").item())
            if accelerator.sync_gradients:
                report["losses"].append(sum(micro) / len(micro))
                if scheduler is not None:
                    report.setdefault("lrs", []).append(scheduler.get_last_lr()[0])
                micro, steps = [], steps + 1
                if steps == args.stop_after:
                    accelerator.save_state(args.checkpoint)
                    break
        if steps == args.stop_after:
            break

    if deferred is not None:
        report["reduce_scatters"] = deferred
    report["bytes_params"] = local_bytes(model.parameters())
    report["bytes_optim"] = local_bytes(v for s in optimizer.state.values() for v in s.values()
                                        if isinstance(v, torch.Tensor) and v.ndim > 0)
    per_rank = gather_object([{k: report.get(k) for k in ("bytes_params", "bytes_grads", "bytes_optim",
                                                          "param_bytes_before_prepare")}])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=data(4).tensors[0]).logits.float()
    report["logits"] = logits.tolist()
    if args.save_model:
        accelerator.save_model(model, args.save_model)
    probe = weakref.ref(accelerator.unwrap_model(model))
    model, optimizer, loader, scheduler = accelerator.free_memory(model, optimizer, loader, scheduler)
    del loss  # the script's own reference: the last loss's autograd graph reaches the model through FSDP's hooks
    gc.collect()
    report["model_freed"] = probe() is None  # nothing of the engine's (or DeepSpeed's) still holds the model
    if accelerator.is_main_process:
        report["per_rank"] = per_rank
        with open(args.out, "w") as f:
            json.dump(report, f)
    accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
