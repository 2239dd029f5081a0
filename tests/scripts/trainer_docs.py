"""The Trainer example of the Transformers docs, on a tiny BERT and a made-up sentiment set, instrumented for tests.

`--stock` runs transformers' own Trainer (the reference); otherwise hf_backend's. Rank 0 writes a JSON report: the
log history, the final parameters (flattened, rounded) and the checkpoint directories.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    DataCollatorWithPadding,
    EarlyStoppingCallback,
    TrainerCallback,
)

WORDS = ["good", "great", "fine", "nice", "bad", "awful", "poor", "sad",
         "the", "a", "movie", "film", "plot", "was", "is", "very", "quite"]
POSITIVE, NEGATIVE = set(WORDS[:4]), set(WORDS[4:8])


def tokenizer(directory: Path) -> BertTokenizerFast:
    directory.mkdir(parents=True, exist_ok=True)
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    return BertTokenizerFast(vocab_file=str(vocab))


def sentences(n: int, seed: int) -> Dataset:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [r.choice(WORDS) for _ in range(r.randint(3, 12))]
        pos, neg = sum(w in POSITIVE for w in words), sum(w in NEGATIVE for w in words)
        rows.append({"text": " ".join(words), "label": int(pos >= neg)})
    return Dataset.from_list(rows)


def compute_metrics(prediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}


class KillAfterSave(TrainerCallback):
    """SIGKILL this process `steps` optimizer steps after checkpoint `after` was saved (mid-epoch)."""

    def __init__(self, after: int, steps: int) -> None:
        self.after, self.steps, self.saved_at = after, steps, None

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.after:
            self.saved_at = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.saved_at is not None and state.global_step == self.saved_at + self.steps:
            os.kill(os.getpid(), signal.SIGKILL)


class SlowAfter(TrainerCallback):
    """From step `step` on, write `<output_dir>/reached` and sleep 0.3 s a step: room for a test to send SIGTERM.
    With `sigterm_rank`, that rank sends SIGTERM to itself at step `step` (a preemption notice to one process)."""

    def __init__(self, step: int, sigterm_rank: int | None) -> None:
        self.step, self.sigterm_rank = step, sigterm_rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == self.sigterm_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        if state.global_step >= self.step:
            if state.is_world_process_zero:
                Path(args.output_dir, "reached").write_text(str(state.global_step))
            time.sleep(0.3)


def forbid_accelerate_state() -> None:
    """hf_backend's Trainer must never build Accelerate's Accelerator or its process state: make that fail loudly."""
    import accelerate
    import accelerate.state

    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"accelerate's {type(self).__name__} was constructed")

    for cls in (accelerate.Accelerator, accelerate.state.AcceleratorState, accelerate.state.PartialState):
        cls.__init__ = refuse


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--stock", action="store_true", help="transformers.Trainer (the reference)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--train-rows", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--fsdp-config", default=None, help="a path, or 'plugin' for a plugin object")
    p.add_argument("--state-dict-type", default="FULL_STATE_DICT", help="with --fsdp-config plugin")
    p.add_argument("--deepspeed", default=None, help="a DeepSpeed JSON path")
    p.add_argument("--save-steps", type=int, default=0, help="save by steps (else by epoch)")
    p.add_argument("--kill-after-checkpoint", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--jit-checkpoint", action="store_true", help="enable_jit_checkpoint=True")
    p.add_argument("--torch-compile", default=None, help="torch_compile_backend (torch_compile=True)")
    p.add_argument("--ignore-data-skip", action="store_true")
    p.add_argument("--tokens-seen", default="no", help="include_num_input_tokens_seen")
    p.add_argument("--slow-after", type=int, default=0, help="see SlowAfter")
    p.add_argument("--sigterm-rank", type=int, default=None, help="see SlowAfter")
    p.add_argument("--report-to", default="none")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--early-stopping", type=int, default=0, help="EarlyStoppingCallback with this patience")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--save-only-model", action="store_true")
    p.add_argument("--save-final", action="store_true", help="trainer.save_model(output_dir/final) at the end")
    p.add_argument("--evaluate-first", action="store_true", help="trainer.evaluate() before train() (prepares the "
                   "model for evaluation, then again for training)")
    args = p.parse_args()

    from hf_backend.trainer.transformers_compat import ACTIVATION_CHECKPOINTING_ARGUMENT

    if args.stock:
        from transformers import Trainer, TrainingArguments
    else:
        forbid_accelerate_state()
        from hf_backend import Trainer, TrainingArguments
    # What the imports made lives until exit: out of the collector's sight (as in tests/warm_processes.py's forks),
    # the engine's gc.collect() calls (two at process-group teardown) walk only what the run makes, not the whole heap
    # of torch, transformers and datasets; that took about 1.6 s of every launched process.
    gc.collect()
    gc.freeze()

    tok = tokenizer(Path(args.output_dir) / "tokenizer")
    train = sentences(args.train_rows, 0).map(lambda b: tok(b["text"], truncation=True), batched=True)
    evaluation = sentences(72, 1).map(lambda b: tok(b["text"], truncation=True), batched=True)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=2, hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout))

    backend: dict = {}
    if args.fsdp_config == "plugin":
        from hf_backend import FullyShardedDataParallelPlugin

        backend = {"fsdp": "full_shard", "fsdp_config": FullyShardedDataParallelPlugin(
            transformer_cls_names_to_wrap="BertLayer", state_dict_type=args.state_dict_type)}
    elif args.fsdp_config:
        backend = {"fsdp": "full_shard", "fsdp_config": args.fsdp_config}
    elif args.deepspeed:
        backend = {"deepspeed": args.deepspeed}
    # The docs' arguments; --save-steps switches saving and evaluation from every epoch to every N steps.
    schedule = {"eval_strategy": "epoch", "save_strategy": "epoch"}
    if args.save_steps:
        schedule = {"eval_strategy": "steps", "eval_steps": args.save_steps, "save_strategy": "steps",
                    "save_steps": args.save_steps, "save_total_limit": 3}
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        num_train_epochs=args.epochs,
        weight_decay=0.01,
        load_best_model_at_end=True,
        gradient_accumulation_steps=args.grad_accum,
        **{ACTIVATION_CHECKPOINTING_ARGUMENT: args.activation_checkpointing},  # its name depends on the version
        bf16=args.precision == "bf16",
        # transformers refuses bf16 on a CPU-only machine without use_cpu, and under torchrun it trains unsynchronized
        # copies (each process all the data, writing the same checkpoint files) without it
        use_cpu=args.stock and (args.precision == "bf16" or int(os.environ.get("WORLD_SIZE", "1")) > 1),
        fp16=args.precision == "fp16",
        metric_for_best_model="eval_loss" if args.early_stopping else None,
        logging_steps=2,
        report_to=args.report_to,
        disable_tqdm=True,
        enable_jit_checkpoint=args.jit_checkpoint,
        torch_compile_backend=args.torch_compile,
        ignore_data_skip=args.ignore_data_skip,
        include_num_input_tokens_seen=args.tokens_seen,
        save_only_model=args.save_only_model,
        **schedule,
        **backend,
    )
    callbacks = [KillAfterSave(args.kill_after_checkpoint, 2)] if args.kill_after_checkpoint else []
    if args.slow_after:
        callbacks.append(SlowAfter(args.slow_after, args.sigterm_rank))
    if args.early_stopping:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=args.early_stopping))
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tok,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=compute_metrics,
        callbacks=callbacks,
    )
    if args.evaluate_first:
        trainer.evaluate()
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    if args.save_final:
        trainer.save_model(str(Path(args.output_dir) / "final"))
    params = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    optimizer_state = {} if trainer.is_deepspeed_enabled else trainer.optimizer.state_dict()["state"]
    if trainer.is_world_process_zero():
        flat = torch.cat([v.detach().float().flatten() for _, v in sorted(params.items())])
        report = {
            "log_history": trainer.state.log_history,
            "final_eval": metrics,
            "params": flat.tolist(),
            "checkpoints": sorted(p.name for p in Path(args.output_dir).glob("checkpoint-*")),
            "best": trainer.state.best_model_checkpoint,
            "world_size": training_args.world_size,
            "distributed_type": str(trainer.accelerator.distributed_type.value),
            "model_wrapped": type(trainer.model_wrapped).__name__,
            "compiled": isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
            or bool(getattr(trainer.model_wrapped, "is_compiled", False)),  # DeepSpeed's engine compiles in place
            # Adam's step count: the optimizer steps taken since the first, resumed runs included
            "global_step": trainer.state.global_step,
            "adam_steps": max((int(s["step"]) for s in optimizer_state.values() if "step" in s), default=0),
        }
        Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
