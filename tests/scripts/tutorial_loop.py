"""The Accelerate tutorial loop on hf_backend, instrumented for the tests.

Run in one process (`python tutorial_loop.py ...`) or under `torchrun --nproc_per_node 2`; writes a JSON report
(loss per optimizer step, final parameters, whether ranks agreed after every step, evaluation rows) from rank 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from hf_backend import Accelerator, ProjectConfiguration
from hf_backend.utils import set_seed


class Progress:
    """Optimizer steps taken so far; registered for checkpointing so a resumed run knows where it is."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    w = torch.randn(12, 3, generator=g)
    y = (x @ w + 0.1 * torch.randn(n, 3, generator=g)).argmax(-1)
    return TensorDataset(x, y)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--train-size", type=int, default=128)
    p.add_argument("--eval-size", type=int, default=37)
    p.add_argument("--eval-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--seed-per-rank", action="store_true", help="seed each rank differently")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--mixed-precision", default=None)
    p.add_argument("--split-batches", action="store_true")
    p.add_argument("--stop-after", type=int, default=0, help="save_state after this many optimizer steps and exit")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, mixed_precision=args.mixed_precision,
                              split_batches=args.split_batches,
                              project_config=ProjectConfiguration(project_dir=args.checkpoint))
    set_seed(args.seed + (accelerator.process_index * 1000 if args.seed_per_rank else 0))

    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(args.dropout),
                                torch.nn.Linear(32, 3))
    train_dl = DataLoader(make_data(args.train_size, 0), batch_size=args.batch_size, shuffle=True)
    eval_dl = DataLoader(make_data(args.eval_size, 1), batch_size=args.eval_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    total = len(train_dl) * args.epochs // args.grad_accum
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.checkpoint)

    report = {"losses": [], "ranks_agree": True, "world": accelerator.num_processes,
              "batches_per_epoch": len(train_dl)}
    micro_losses = []
    for _epoch in range(train_dl.epoch, args.epochs):
        model.train()
        for x, y in train_dl:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            micro_losses.append(accelerator.reduce(loss.detach(), "mean").item())
            if not accelerator.sync_gradients:
                continue
            report["losses"].append(sum(micro_losses) / len(micro_losses))
            micro_losses = []
            progress.steps += 1
            flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
            everyone = accelerator.gather(flat[None])
            report["ranks_agree"] &= bool((everyone == everyone[0]).all())
            if progress.steps == args.stop_after:
                accelerator.save_state(args.checkpoint)
                _write(accelerator, args.out, report, model)
                return 0

    model.eval()
    preds, labels = [], []
    for x, y in eval_dl:
        with torch.no_grad():
            logits = model(x)
        p_, y_ = accelerator.gather_for_metrics((logits.argmax(-1), y))
        preds.append(p_)
        labels.append(y_)
    report["eval_rows"] = int(torch.cat(preds).numel())
    report["eval_labels"] = torch.cat(labels).tolist()
    report["lr"] = scheduler.get_last_lr()[0]
    _write(accelerator, args.out, report, model)
    accelerator.end_training()
    return 0


def _write(accelerator: Accelerator, out: str, report: dict, model: torch.nn.Module) -> None:
    report["params"] = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).tolist()
    report["progress_steps"] = len(report["losses"])
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump(report, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    sys.exit(main())
