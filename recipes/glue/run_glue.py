"""Fine-tune a sequence-classification model on a GLUE task with hf_backend.Trainer.

    hf-backend launch --cpu --num_processes 2 recipes/glue/run_glue.py --task mrpc \
        --data_dir ../shared/data/glue/MRPC
    python recipes/glue/run_glue.py                 # one process, the offline default (tweets, all-MiniLM-L6-v2)

Evaluates every epoch on the dev split(s), checkpoints (`--checkpointing_steps`), resumes (`--resume`), saves the
final model to output_dir/model and writes output_dir/results.json. `--trainer transformers` runs the same recipe on
transformers.Trainer, for side-by-side comparisons.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import Clock, parse_args, write_results  # noqa: E402
from glue_data import DataError, default_model, fail, get_task, load, metric, tokenize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv, more_options=_trainer_options)
    trainer_choice = args.trainer
    try:
        task = get_task(args.task)
        data = load(task, args.data_dir, args.max_train_samples, args.max_eval_samples)
        model_path = args.model or default_model()
    except DataError as err:
        fail(err)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, set_seed

    if trainer_choice == "transformers":
        from transformers import Trainer, TrainingArguments
    else:
        from hf_backend import Trainer, TrainingArguments

    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    encoded = tokenize(data, tokenizer, args.max_length)
    labels = task.labels or ("score",)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=task.num_labels, id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)})
    scorer = metric(task)

    def compute_metrics(prediction) -> dict[str, float]:
        logits = prediction.predictions
        predicted = logits.squeeze(-1) if task.labels is None else np.argmax(logits, axis=-1)
        return scorer.compute(predictions=predicted, references=prediction.label_ids)

    by_steps = args.checkpointing_steps.isdigit()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        bf16=args.mixed_precision == "bf16",
        fp16=args.mixed_precision == "fp16",
        eval_strategy="steps" if args.eval_steps else "epoch",
        eval_steps=args.eval_steps or None,
        save_strategy="steps" if by_steps else args.checkpointing_steps,
        save_steps=int(args.checkpointing_steps) if by_steps else 500,
        logging_steps=args.logging_steps,
        report_to="none",
        # Without it transformers.Trainer on a GPU-less machine neither wraps the model in DDP nor shards the data
        # under a launcher: each process would train its own copy (hf_backend's Trainer does not need it).
        use_cpu=not torch.cuda.is_available(),
        average_tokens_across_devices=args.average_tokens_across_devices == "true",
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=encoded["train"],
                      eval_dataset=encoded[task.dev[0]], processing_class=tokenizer,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=compute_metrics)
    clock = Clock()
    result = trainer.train(resume_from_checkpoint=args.resume)
    seconds = clock.seconds()
    metrics = {split: {k.removeprefix("eval_"): v for k, v in trainer.evaluate(encoded[split]).items()
                       if k.removeprefix("eval_") in _METRIC_NAMES} for split in task.dev}
    trainer.save_model(str(Path(args.output_dir) / "model"))
    if trainer.is_world_process_zero():
        samples = result.metrics["train_samples_per_second"] * result.metrics["train_runtime"]
        path = write_results(args, task.name, metrics, int(samples), seconds, training_args.world_size,
                             trainer.state.log_history, flavour=f"{trainer_choice}.Trainer")
        print(f"results: {path}")
        for split, values in metrics.items():
            print(f"{split}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
    return 0


def _trainer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trainer", choices=("hf_backend", "transformers"), default="hf_backend",
                        help="transformers: the same recipe on the stock Trainer, for side-by-side runs")
    parser.add_argument("--average_tokens_across_devices", choices=("true", "false"), default="true",
                        help="TrainingArguments' option. transformers.Trainer multiplies a model's loss by the number "
                             "of processes when it is true (its default), even for a loss that is a mean per batch "
                             "(docs/results.md); hf_backend.Trainer checks what the loss does")


_METRIC_NAMES = ("accuracy", "f1", "macro_f1", "matthews_correlation", "pearson", "spearmanr", "loss")

if __name__ == "__main__":
    sys.exit(main())
