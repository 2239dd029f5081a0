"""Supervised fine-tuning of a causal language model on prompt/response pairs with hf_backend.Trainer.

    hf-backend launch --cpu --num_processes 2 recipes/causal_lm/run_sft.py     # 2 processes, the offline default
    python recipes/causal_lm/run_sft.py --model_name_or_path Qwen/Qwen2.5-0.5B --lora --data_file pairs.jsonl

Only the response (and the EOS that ends it) is learned: prompt tokens get the label -100. Batches are packed by
default (padding-free: one row per batch, position ids restarting at each example, no attention across examples;
`--no_packing` pads instead). Without `--model_name_or_path` it needs no hub: a small Llama built from a config
(random initialisation) with all-MiniLM-L6-v2's tokenizer, learning the tweet-sentiment instruction of sft_data.py.
Evaluates the held-out pairs before training, while training (`--eval_steps`) and after: the token-mean loss and its
exp, the perplexity. Then it greedily answers `--num_samples` held-out prompts (output_dir/samples.json), saves the
model (or with `--lora` the adapter) and tokenizer to output_dir/model and writes output_dir/results.json.
`--trainer transformers` runs the same recipe on transformers.Trainer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent / "glue"))  # common.py and glue_data.py, shared with GLUE

from common import Clock, write_results  # noqa: E402
from sft_data import DataError, collator, encode, load_pairs, load_tokenizer, prompt_ids, tiny_llama  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name_or_path", default=None,
                   help="any causal LM (AutoModelForCausalLM); default: a small Llama from a config, offline")
    p.add_argument("--num_layers", type=int, default=2, help="the default model's layers")
    p.add_argument("--hidden_size", type=int, default=128, help="the default model's width")
    p.add_argument("--data_file", default=None, help='JSON lines of {"prompt": ..., "response": ...} (the last '
                                                     "10%% held out); default: the offline tweet-sentiment pairs")
    p.add_argument("--packing", dest="packing", action="store_true", default=True,
                   help="padding-free batches: examples concatenated into one row (the default)")
    p.add_argument("--no_packing", dest="packing", action="store_false",
                   help="right-padded batches with an attention mask instead")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of every weight")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--lora_target_modules", default="q_proj,v_proj", help="comma-separated module names")
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--lr", type=float, default=None,
                   help="default: 2e-3 for the default model, 2e-4 with --lora, else 2e-5")
    p.add_argument("--batch_size", type=int, default=16, help="examples per process and step")
    p.add_argument("--max_length", type=int, default=128, help="longer examples are left out, not cut")
    p.add_argument("--warmup", type=float, default=0.05, help="warmup, as a fraction of the optimizer steps")
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), default="no")
    p.add_argument("--output_dir", default="sft_output")
    p.add_argument("--checkpointing_steps", default="no", help="'epoch', a number of steps, or 'no'")
    p.add_argument("--resume", nargs="?", const=True, default=None,
                   help="continue from the newest checkpoint in --output_dir, or from the one given")
    p.add_argument("--max_train_samples", type=int, default=None,
                   help="train on N pairs (a fixed random subset of the tweets; a --data_file's first N)")
    p.add_argument("--max_eval_samples", type=int, default=500, help="evaluate on N held-out pairs (chosen as above)")
    p.add_argument("--max_steps", type=int, default=-1, help="stop after this many optimizer steps")
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate every N optimizer steps too (0: per epoch)")
    p.add_argument("--num_samples", type=int, default=100, help="held-out prompts answered greedily at the end")
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--trainer", choices=("hf_backend", "transformers"), default="hf_backend",
                   help="transformers: the same recipe on the stock Trainer, for side-by-side runs")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 2e-3 if args.model_name_or_path is None else 2e-4 if args.lora else 2e-5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        pairs = load_pairs(args.data_file, args.max_train_samples, args.max_eval_samples)
        tokenizer = load_tokenizer(args.model_name_or_path)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    import torch
    from transformers import AutoModelForCausalLM, set_seed

    if args.trainer == "transformers":
        from transformers import Trainer, TrainingArguments
    else:
        from hf_backend import Trainer, TrainingArguments

    set_seed(args.seed)
    train, dropped = encode(tokenizer, pairs["train"], args.max_length)
    held_out, dropped_eval = encode(tokenizer, pairs["test"], args.max_length)
    by_steps = args.checkpointing_steps.isdigit()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size,
        # Packed, an evaluation batch is one example: each row is then one example, so the metrics below count every
        # held-out example once across processes (a packed row of several would not let the Trainer drop the
        # examples a short last batch repeats), and no padding is computed.
        per_device_eval_batch_size=1 if args.packing else args.batch_size,
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
        # Inside train(), once the model is wrapped: transformers.Trainer's evaluate() called before train() under
        # torchrun leaves train() without DDP (each process then trains a copy of its own). Resumed, the model is no
        # longer the one training started from, so not then.
        eval_on_start=args.resume is None,
        save_strategy="steps" if by_steps else args.checkpointing_steps,
        save_steps=int(args.checkpointing_steps) if by_steps else 500,
        logging_steps=args.logging_steps,
        logging_first_step=True,  # the curve starts where the random model does, about ln(vocabulary size)
        report_to="none",
        use_cpu=not torch.cuda.is_available(),  # as in run_glue.py: transformers.Trainer needs it for DDP on CPU
        ddp_find_unused_parameters=False,  # every weight is used in every forward: no search through the graph
    )
    if (dropped or dropped_eval) and training_args.process_index == 0:
        print(f"note: {dropped} training and {dropped_eval} held-out pairs are longer than --max_length "
              f"{args.max_length} tokens and were left out")
    if args.model_name_or_path is None:
        model = tiny_llama(tokenizer, args.num_layers, args.hidden_size, args.max_length)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    # With use_cache on (most configs' default), the forward builds a KV cache even in training, and transformers then
    # does not look for packed sequences in position_ids: packed examples would attend to each other. The Trainer
    # sets it from TrainingArguments.use_cache (False) too; generation below turns the cache on again.
    model.config.use_cache = False
    if args.lora:
        model = with_lora(model, args, training_args.process_index == 0)

    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
                      processing_class=tokenizer, data_collator=collator(args.packing, tokenizer.pad_token_id),
                      compute_metrics=token_metrics, preprocess_logits_for_metrics=token_losses)
    clock = Clock()
    result = trainer.train(resume_from_checkpoint=args.resume)
    seconds = clock.seconds()
    evals = [h for h in trainer.state.log_history if "eval_perplexity" in h]
    before = evals[0] if args.resume is None else None  # eval_on_start's, at step 0
    # The Trainer has evaluated after the last step already when that step ended an epoch or was a multiple of
    # eval_steps: no second pass over the held-out pairs then.
    after = evals[-1] if evals and evals[-1]["step"] == trainer.state.global_step else trainer.evaluate()
    trainer.model.config.use_cache = True  # saved as the model's default for inference
    trainer.save_model(str(Path(args.output_dir) / "model"))
    if not trainer.is_world_process_zero():
        return 0
    samples = answer(trainer.model, tokenizer, pairs["test"][: args.num_samples], args.max_new_tokens)
    (Path(args.output_dir) / "samples.json").write_text(json.dumps(samples, indent=2))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    seen = result.metrics["train_samples_per_second"] * result.metrics["train_runtime"]  # examples trained on
    mean_length = sum(len(e["input_ids"]) for e in train) / len(train)
    metrics = {
        **({"before training": summary(before)} if before else {}),
        "after training": {**summary(after), "answer_match": sum(s["match"] for s in samples) / max(1, len(samples))},
        "training": {"first_logged_loss": losses[0] if losses else None,
                     "last_logged_loss": losses[-1] if losses else None,
                     "tokens_per_second": seen * mean_length / seconds},
    }
    path = write_results(args, "tweet-sentiment" if args.data_file is None else Path(args.data_file).name, metrics,
                         int(seen), seconds, training_args.world_size, trainer.state.log_history,
                         flavour=f"{args.trainer}.Trainer, {'packed' if args.packing else 'padded'} batches"
                                 + (", LoRA" if args.lora else ""))
    print(f"results: {path}")
    for name in [name for name in ("before training", "after training") if name in metrics]:
        print(f"{name}: held-out loss {metrics[name]['loss']:.4f}, perplexity {metrics[name]['perplexity']:.2f}")
    print(f"answers matching the reference: {metrics['after training']['answer_match']:.1%} of {len(samples)}")
    for s in samples[:5]:
        print(f"--- prompt: {s['prompt']!r}\n    generated: {s['generated']!r}   reference: {s['reference']!r}")
    return 0


def with_lora(model: Any, args: argparse.Namespace, main_process: bool) -> Any:
    """The model wrapped with a LoRA adapter. A model built here from a config is first saved to
    output_dir/base_model, so that the adapter's config names a base that from_pretrained can find."""
    from peft import LoraConfig, get_peft_model

    if args.model_name_or_path is None:
        base = Path(args.output_dir) / "base_model"
        if main_process:
            model.save_pretrained(base)
        model.name_or_path = str(base.resolve())  # what peft records as the adapter's base
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=args.lora_target_modules.split(","), task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    if main_process:
        model.print_trainable_parameters()
    return model


def token_losses(logits: Any, labels: Any) -> Any:
    """Per row: (sum of the next-token losses over the learned tokens, their count). The Trainer gathers these
    instead of the logits; the labels are the unshifted ones the model gets."""
    import torch

    labels = labels[:, 1:]
    learned = labels != -100
    losses = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    losses[learned] = torch.nn.functional.cross_entropy(logits[:, :-1][learned].float(), labels[learned],
                                                        reduction="none")
    return torch.stack([losses.sum(-1), learned.sum(-1).to(losses.dtype)], dim=-1)


def token_metrics(prediction: Any) -> dict[str, float]:
    """The token-mean loss over every learned held-out token, and its exp. (The Trainer's own eval_loss is a mean
    of per-batch means, which weights a short response's tokens more.)"""
    sums = prediction.predictions
    loss = float(sums[:, 0].sum() / sums[:, 1].sum())
    return {"token_loss": loss, "perplexity": math.exp(min(loss, 700.0))}


def summary(evaluation: dict[str, float]) -> dict[str, float]:
    return {"loss": evaluation["eval_token_loss"], "perplexity": evaluation["eval_perplexity"],
            "trainer_eval_loss": evaluation["eval_loss"]}


def answer(model: Any, tokenizer: Any, pairs: list, max_new_tokens: int, batch_size: int = 32) -> list[dict]:
    """Greedy answers to the prompts (left-padded batches), with the reference and whether they match."""
    import torch

    model.eval()
    samples = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        prompts = prompt_ids(tokenizer, [p.prompt for p in chunk])
        width = max(map(len, prompts))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                                 max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for pair, row in zip(chunk, out[:, width:].tolist()):
            generated = tokenizer.decode(row, skip_special_tokens=True).strip()
            reference = tokenizer.decode(tokenizer(pair.response, add_special_tokens=False)["input_ids"],
                                         skip_special_tokens=True).strip()
            samples.append({"prompt": pair.prompt, "generated": generated, "reference": reference,
                            "match": generated == reference})
    return samples


if __name__ == "__main__":
    sys.exit(main())
