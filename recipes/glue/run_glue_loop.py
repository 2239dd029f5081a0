"""Fine-tune a sequence-classification model on a GLUE task with a hand-written loop on hf_backend.Accelerator
(the shape of Accelerate's nlp_example).

    hf-backend launch --cpu --num_processes 2 recipes/glue/run_glue_loop.py --task mrpc \
        --data_dir ../shared/data/glue/MRPC

Evaluates every epoch (predictions gathered exactly across processes), saves the training state every epoch or every
N steps (`--checkpointing_steps`) and resumes from the newest one (`--resume`) with the next batch of the same order.
Writes output_dir/model and output_dir/results.json.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from common import Clock, parse_args, write_results  # noqa: E402
from glue_data import DataError, default_model, fail, get_task, load, metric, tokenize  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from hf_backend import Accelerator, ProjectConfiguration  # noqa: E402
from hf_backend.utils import set_seed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    try:
        task = get_task(args.task)
        model_path = args.model or default_model()
    except DataError as err:
        fail(err)
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        project_config=ProjectConfiguration(project_dir=args.output_dir, automatic_checkpoint_naming=True,
                                            total_limit=2),
    )
    try:
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
    encoded = tokenize(data, tokenizer, args.max_length).rename_column("label", "labels")
    encoded.set_format("torch")
    collate = DataCollatorWithPadding(tokenizer)
    train_dl = DataLoader(encoded["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collate)
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
    optimizer = torch.optim.AdamW(groups, lr=args.lr, fused=True)  # transformers.Trainer's default optimizer
    # As in Accelerate: the schedule counts batches of the loader as given; the prepared scheduler advances one such
    # batch per process at each optimizer step.
    batches = math.ceil(args.epochs * len(train_dl))
    if args.max_steps > 0:
        batches = min(batches, args.max_steps * accelerator.num_processes)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup * batches), batches)
    model, optimizer, train_dl, scheduler, *eval_dls = accelerator.prepare(model, optimizer, train_dl, scheduler,
                                                                          *eval_dls)
    steps_per_epoch, total = len(train_dl), math.ceil(batches / accelerator.num_processes)
    epochs = math.ceil(total / steps_per_epoch)
    scorer = metric(task)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    # Seeded again as training starts, as transformers.Trainer does: both flavours draw the same dropout masks (a
    # resumed run then gets the random state the checkpoint saved).
    set_seed(args.seed)
    if args.resume:
        accelerator.load_state(None if args.resume is True else args.resume)  # the dataloader continues by itself
    step = progress.step
    history: list[dict] = []
    metrics: dict[str, dict[str, float]] = {}
    clock, seen, running = Clock(), 0, 0.0
    for epoch in range(train_dl.epoch, epochs):
        model.train()
        for batch in train_dl:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
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
                accelerator.save_state()
            if step >= total:
                break
        metrics = evaluate_all(accelerator, model, eval_dls, scorer, task, step, epoch + 1, history)
        if args.checkpointing_steps == "epoch":
            accelerator.save_state()
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
