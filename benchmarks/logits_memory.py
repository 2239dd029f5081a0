"""Host memory of one Trainer step on a large vocabulary (issue 57): a 1-layer Llama (hidden 128) from a config, fp32,
AdamW, `--steps` (2) steps of one batch of 1 x `--tokens` tokens, the Trainer's defaults otherwise; stock
transformers.Trainer, then hf_backend.Trainer with `chunked_loss=False` (the model's own loss, the whole logits) and
at its default (the loss by chunks: hf_backend/training/chunked_loss.py).

Each variant runs in a process of its own: the model and the batches are built, then `trainer.train()` runs the
steps while a thread of this script samples the process's private memory (`RssAnon`) every 2 ms; the figure is the
peak above what the process held just before `train()` (the steps' activations, the logits and their gradient, the
gradients and AdamW's state). glibc's mmap threshold is fixed (`mallopt`) so that freed memory is returned at once.
Each step's logged loss and the parameters at the end are compared with the whole-logits run's
(`chunked_loss=False`): the variants train the same numbers.

    .venv/bin/python benchmarks/logits_memory.py [--vocab 131072] [--tokens 4096] [--steps 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
WHOLE = "hf_backend chunked_loss=False"
VARIANTS = ["transformers", WHOLE, "hf_backend"]


def measure(variant: str, vocab: int, tokens: int, steps: int, params_file: str) -> dict:
    import ctypes
    import threading
    import time

    if not ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024):  # M_MMAP_THRESHOLD: large frees return at once
        raise SystemExit("mallopt(M_MMAP_THRESHOLD) failed")
    import torch
    import transformers
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_backend

    def private_mib() -> float:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(fields["RssAnon"].split()[0]) / 1024

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=tokens,
                                         tie_word_embeddings=False, use_cache=False))
    ids = torch.randint(0, vocab, (steps, tokens), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    stock = variant == "transformers"
    module = transformers if stock else hf_backend
    extra = {} if stock else {"chunked_loss": variant == "hf_backend"}
    with tempfile.TemporaryDirectory() as out:
        args = module.TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=steps, report_to=[],
                                        save_strategy="no", logging_steps=1, use_cpu=True, **extra)
        trainer = module.Trainer(model=model, args=args, train_dataset=data)
        peak = {"mib": private_mib()}

        def sample() -> None:  # a daemon thread of this measuring script
            while True:
                peak["mib"] = max(peak["mib"], private_mib())
                time.sleep(0.002)

        before = peak["mib"] = private_mib()
        threading.Thread(target=sample, daemon=True).start()
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        time.sleep(0.01)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), params_file)
    return {"step_mib": peak["mib"] - before, "seconds": seconds, "losses": losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one variant here, print its JSON
    parser.add_argument("--params", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.vocab, args.tokens, args.steps, args.params)))
        return 0
    import torch

    results, params = {}, {}
    with tempfile.TemporaryDirectory() as work:
        for i, variant in enumerate(args.variants.split(",")):
            path = str(Path(work) / f"{i}.pt")
            proc = subprocess.run([sys.executable, str(HERE), "--one", variant, "--vocab", str(args.vocab),
                                   "--tokens", str(args.tokens), "--steps", str(args.steps), "--params", path],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            params[variant] = torch.load(path)
    stock = results.get("transformers", {}).get("step_mib")
    whole = WHOLE if WHOLE in results else None
    print(f"| variant (vocabulary {args.vocab}, {args.steps} steps of {args.tokens} tokens) | peak memory (MiB) | "
          "x transformers | train() (s) | losses | largest loss / parameter difference from chunked_loss=False |\n"
          "|---|---|---|---|---|---|")
    for variant, run in results.items():
        ratio = f"{run['step_mib'] / stock:.3f}" if stock else "-"
        if whole:
            run["loss_difference"] = max(abs(a - b) for a, b in zip(run["losses"], results[whole]["losses"]))
            run["parameter_difference"] = float((params[variant] - params[whole]).abs().max())
        apart = f"{run['loss_difference']:.1e} / {run['parameter_difference']:.1e}" if whole else "-"
        losses = ", ".join(f"{loss:.6f}" for loss in run["losses"])
        print(f"| {variant} | {run['step_mib']:.0f} | {ratio} | {run['seconds']:.2f} | {losses} | {apart} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"vocab": args.vocab, "tokens": args.tokens, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
