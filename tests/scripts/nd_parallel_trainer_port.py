"""Accelerate's examples/torch_native_parallelism/nd_parallel_trainer.py on hf_backend (tests/test_nd_parallel_port.py):
its calls, copied here in order with the imports changed, under `hf-backend launch --config_file` with Accelerate's
configs/tp_hsdp.yaml or configs/cp.yaml (copies in tests/fixtures/nd_parallel, `use_cpu: true`). A tiny Llama saved by
the test, a packed synthetic dataset, a word-level tokenizer built here. What differs from the example, and why:
- tensor parallelism with data parallelism beside it: transformers 5.23 refuses `from_pretrained(tp_plan="auto",
  device_mesh=...)` unless the tensor-parallel size is the world size, so the model is loaded plain and hf_backend
  applies its tp_plan over the run's mesh when the Trainer prepares it (docs/parallelism.md) - `--as-written` loads it
  as the example does, to show what transformers says;
- `processing_class=` for the `tokenizer=` the Trainer no longer takes; 4 steps.
Rank 0 writes a JSON report: the logged losses, the grid and the saved files.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_backend import Trainer, TrainingArguments  # was: from transformers import Trainer, TrainingArguments
from hf_backend.utils import ParallelismConfig  # was: from accelerate.utils import ParallelismConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequence-length", type=int, default=16)
    parser.add_argument("--checkpoint-frequency", type=int, default=2)
    parser.add_argument("--model-name", type=str, required=True)
    parser.add_argument("--save-dir", type=str, required=True)
    parser.add_argument("--device-type", type=str, default="cpu")
    parser.add_argument("--as-written", action="store_true", help="from_pretrained(tp_plan='auto', device_mesh=...)")
    parser.add_argument("--batch-size", type=int, default=1, help="per device (the example's 1; the reference's more)")
    parser.add_argument("--fp32", action="store_true", help="bf16=False (the example trains in bf16)")
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def get_dataset(seq_len: int, vocab: int, rows: int = 64) -> Dataset:
    tokens = (torch.arange(rows * (seq_len + 1)) * 7 + 3) % vocab
    packed = [tokens[i * (seq_len + 1):(i + 1) * (seq_len + 1)].tolist() for i in range(rows)]
    return Dataset.from_dict({"input_ids": [p[:-1] for p in packed], "shift_labels": [p[1:] for p in packed],
                              "labels": [p[1:] for p in packed],
                              "position_ids": [list(range(seq_len)) for _ in packed]})


def main() -> None:
    pc = ParallelismConfig()  # from the PARALLELISM_CONFIG_* variables the launch config set
    args = parse_args()
    model_kwargs = {}
    if pc.tp_enabled and (args.as_written or pc.tp_size == pc.total_size):
        model_kwargs["tp_plan"] = "auto"
        model_kwargs["device_mesh"] = pc.build_device_mesh(args.device_type)
    vocab = {f"t{i}": i for i in range(48)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    model = AutoModelForCausalLM.from_pretrained(args.model_name, use_cache=False, **model_kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "t0"
    packed_dataset = get_dataset(args.sequence_length, model.config.vocab_size)
    training_args = TrainingArguments(
        output_dir=args.save_dir,
        parallelism_config=pc,
        num_train_epochs=1,
        max_steps=4,
        per_device_train_batch_size=args.batch_size,
        logging_steps=1,
        save_steps=args.checkpoint_frequency,
        learning_rate=args.learning_rate,
        remove_unused_columns=False,
        bf16=not args.fp32,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=packed_dataset)
    trainer.train()
    trainer.save_model()
    if trainer.accelerator.is_main_process:
        grid = trainer.accelerator.parallelism_config
        with open(args.out, "w") as f:
            json.dump({"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                       "grid": grid.to_json(), "world": trainer.accelerator.num_processes,
                       "saved": sorted(os.listdir(args.save_dir))}, f)


if __name__ == "__main__":
    main()
