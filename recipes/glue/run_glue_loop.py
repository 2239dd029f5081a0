"""Fine-tune a sequence-classification model on a GLUE task with a hand-written loop on hf_backend.Accelerator
(the shape of Accelerate's nlp_example).

    hf-backend launch --cpu --num_processes 2 recipes/glue/run_glue_loop.py --task mrpc \
        --data_dir ../shared/data/glue/MRPC

Evaluates every epoch (predictions gathered exactly across processes), saves the training state every epoch or every
N steps (`--checkpointing_steps`) and resumes from the newest one (`--resume`) with the next batch of the same order.
Writes output_dir/model and output_dir/results.json.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from common import Clock, parse_args, write_results  # noqa: E402
from glue_data import DataError, default_model, fail, get_task, load, metric, tokenize  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from hf_backend import Accelerator, ProjectConfiguration  # noqa: E402
from hf_backend.utils import set_seed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        project_config=ProjectConfiguration(project_dir=args.output_dir, automatic_checkpoint_naming=True,
                                            total_limit=2),
    )
    return train(args, accelerator, SavedState(args.resume))


class Checkpoints(Protocol):
    """Where the loop's checkpoints go and come back from: `SavedState` here, Ray's in recipes/ray."""

    def restore(self, accelerator: Accelerator) -> None: ...

    def save(self, accelerator: Accelerator, metrics: dict[str, Any]) -> None: ...


class SavedState:
    """Checkpoints as `save_state` directories in output_dir (rotated, 2 kept); `--resume` loads the newest or the
    one given. recipes/ray swaps in checkpoints reported to Ray."""

    def __init__(self, resume: bool | str | None) -> None:
        self.resume = resume

    def restore(self, accelerator: Accelerator) -> None:
        if self.resume:
            accelerator.load_state(None if self.resume is True else self.resume)

    def save(self, accelerator: Accelerator, metrics: dict[str, Any]) -> None:
        accelerator.save_state()


class ExternalBatches(Protocol):
    """Training batches from elsewhere (Ray Data, already split per process): one iterable per epoch."""

    steps_per_epoch: int

    def __call__(self, epoch: int, collate: Callable) -> Iterable[dict[str, torch.Tensor]]: ...


def train(args: argparse.Namespace, accelerator: Accelerator, checkpoints: Checkpoints,
          external_batches: ExternalBatches | None = None) -> int:
    """The whole run in this process: data, model, training with evaluations and checkpoints, results."""
    try:
        task = get_task(args.task)
        model_path = args.model or default_model()
        with accelerator.main_process_first():  # the main process fills the datasets cache, the others read it
            data = load(task, args.data_dir, args.max_train_samples, args.max_eval_samples)
    except DataError as err:
        fail(err)

    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        get_linear_schedule_with_warmup,
    )

    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if external_batches is not None:
        data.pop("train")  # the training batches come from elsewhere, already tokenized
    encoded = tokenize(data, tokenizer, args.max_length).rename_column("label", "labels")
    encoded.set_format("torch")
    collate = DataCollatorWithPadding(tokenizer)
    eval_dls = [DataLoader(encoded[split], batch_size=args.batch_size, collate_fn=collate) for split in task.dev]
    labels = task.labels or ("score",)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=task.num_labels, id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)})
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=args.lr, fused=True)  # transformers.Trainer's default optimizer
    if external_batches is None:
        train_dl = DataLoader(encoded["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collate)
        model, optimizer, train_dl, *eval_dls = accelerator.prepare(model, adamw, train_dl, *eval_dls)
        steps_per_epoch = len(train_dl)
    else:  # evaluation keeps the engine's loaders: predictions are gathered exactly, no row dropped
        model, optimizer, *eval_dls = accelerator.prepare(model, adamw, *eval_dls)
        steps_per_epoch = external_batches.steps_per_epoch
    # The schedule is sized from the per-process batches, as transformers.Trainer sizes it, so that both flavours
    # take the same steps in any number of processes. A prepared scheduler advances once per process at each
    # optimizer step (Accelerate's rule), hence the factor.
    total = math.ceil(args.epochs * steps_per_epoch)
    if args.max_steps > 0:
        total = min(total, args.max_steps)
    ticks = accelerator.num_processes
    scheduler = accelerator.prepare(
        get_linear_schedule_with_warmup(adamw, math.ceil(args.warmup * total) * ticks, total * ticks))
    epochs = math.ceil(total / steps_per_epoch)
    scorer = metric(task)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    # Seeded again as training starts, as transformers.Trainer does: both flavours draw the same dropout masks (a
    # resumed run then gets the random state the checkpoint saved).
    set_seed(args.seed)
    checkpoints.restore(accelerator)  # a DataLoader continues by itself from the batch after the last one seen
    step = progress.step
    history: list[dict] = []
    metrics: dict[str, dict[str, float]] = {}
    clock, seen, running = Clock(), 0, 0.0
    first = train_dl.epoch if external_batches is None else step // steps_per_epoch
    for epoch in range(first, epochs):
        model.train()
        for batch in (train_dl if external_batches is None else external_batches(epoch, collate)):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step = progress.step = step + 1
            seen += batch["labels"].shape[0] * accelerator.num_processes
            running += loss.item()
            if step % args.logging_steps == 0:
                history.append({"step": step, "epoch": step / steps_per_epoch, "loss": running / args.logging_steps,
                                "learning_rate": scheduler.get_last_lr()[0]})
                accelerator.print(history[-1])
                running = 0.0
            if args.eval_steps and step % args.eval_steps == 0 and step < total:
                evaluate_all(accelerator, model, eval_dls, scorer, task, step, step / steps_per_epoch, history)
                model.train()
            if args.checkpointing_steps.isdigit() and step % int(args.checkpointing_steps) == 0:
                checkpoints.save(accelerator, {"step": step, "epoch": step / steps_per_epoch})
            if step >= total:
                break
        metrics = evaluate_all(accelerator, model, eval_dls, scorer, task, step, epoch + 1, history)
        if args.checkpointing_steps == "epoch":
            checkpoints.save(accelerator, {"step": step, "epoch": epoch + 1, **{
                f"{split}_{k}": v for split, values in metrics.items() for k, v in values.items()}})
        if step >= total:
            break
    seconds = clock.seconds()
    if not metrics:  # resumed after the last epoch: nothing left to train
        metrics = evaluate_all(accelerator, model, eval_dls, scorer, task, step, epochs, history)

    accelerator.wait_for_everyone()
    accelerator.save_model(model, Path(args.output_dir) / "model")
    if accelerator.is_main_process:
        tokenizer.save_pretrained(Path(args.output_dir) / "model")
        path = write_results(args, task.name, metrics, seen, seconds, accelerator.num_processes, history,
                             flavour="hf_backend.Accelerator loop")
        print(f"results: {path}")
    accelerator.end_training()
    return 0


class Progress:
    """The optimizer steps taken, saved with the training state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def evaluate_all(accelerator: Accelerator, model, loaders, scorer, task, step: int, epoch: float,
                 history: list[dict]) -> dict[str, dict[str, float]]:
    """Every evaluation split's metrics, also appended to `history` and printed."""
    metrics = {split: evaluate(accelerator, model, loader, scorer, task) for split, loader in zip(task.dev, loaders)}
    history.append({"step": step, "epoch": epoch, **{f"eval_{split}_{k}": v for split, m in metrics.items()
                                                     for k, v in m.items()}})
    accelerator.print(f"step {step}: {metrics}")
    return metrics


def evaluate(accelerator: Accelerator, model, loader, scorer, task) -> dict[str, float]:
    model.eval()
    for batch in loader:
        with torch.no_grad():
            logits = model(**batch).logits
        predicted = logits.squeeze(-1) if task.labels is None else logits.argmax(dim=-1)
        predicted, references = accelerator.gather_for_metrics((predicted, batch["labels"]))
        scorer.add_batch(predictions=predicted.cpu().numpy(), references=references.cpu().numpy())
    return scorer.compute()


if __name__ == "__main__":
    sys.exit(main())
