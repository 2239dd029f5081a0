"""DDP with find_unused_parameters=None (found once, on the first synchronized step) against True (searched on every
step), in the same processes: the Accelerator loop on three models (every parameter used; one never used; one used
only on rank 0) with gradient accumulation, and hf_backend.Trainer at its defaults on a tiny BERT classifier.
Writes, from rank 0, each case's largest parameter difference and the search DDP kept."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from hf_backend import Accelerator
from hf_backend.config.options import DistributedDataParallelKwargs


class Net(torch.nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.a, self.b, self.spare = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.case == "rank0_only" and torch.distributed.get_rank() == 0:
            h = self.spare(h)
        return self.b(h).squeeze(-1)


def loop(case: str, find_unused: bool | None, steps: int = 6,
         accumulation: int = 2) -> tuple[torch.Tensor, bool, bool]:
    accelerator = Accelerator(gradient_accumulation_steps=accumulation,
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused)])
    torch.manual_seed(0)
    model = Net(case)
    if case == "all_used":
        model.spare.requires_grad_(False)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(steps * accumulation):
        with accelerator.accumulate(model):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    return flat, torch.equal(*accelerator.gather(flat[None])), model.find_unused_parameters


def trainer(find_unused: bool | None, workdir: str) -> tuple[torch.Tensor, list[float], bool]:
    from transformers import BertConfig, BertForSequenceClassification

    from hf_backend import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=2))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(5, 64, (12,), generator=g), "labels": int(i % 2)} for i in range(64)]
    args = TrainingArguments(output_dir=workdir, per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                             ddp_find_unused_parameters=find_unused)
    t = Trainer(model=model, args=args, train_dataset=rows)
    t.train()
    losses = [entry["loss"] for entry in t.state.log_history if "loss" in entry]
    flat = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
    return flat, losses, bool(t.model_wrapped.find_unused_parameters)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    out = Path(p.parse_args().out)
    report = {}
    for case in ("all_used", "never_used", "rank0_only"):
        once, agree, searching = loop(case, None)
        every, _, _ = loop(case, True)
        report[case] = {"difference": (once - every).abs().max().item(), "ranks_agree": agree,
                        "searching": searching}
    with tempfile.TemporaryDirectory() as tmp:
        once, losses_once, searching_once = trainer(None, tmp)
        every, losses_every, _ = trainer(True, tmp)
    report["trainer"] = {"difference": (once - every).abs().max().item(), "searching": searching_once,
                         "loss_difference": max(abs(a - b) for a, b in zip(losses_once, losses_every)),
                         "steps": len(losses_once)}
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(report))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
