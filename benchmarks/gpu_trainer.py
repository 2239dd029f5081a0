"""On one GPU: hf_backend.Trainer against transformers.Trainer and a bare PyTorch loop, side by side in one run.

Same recipe for each: a BERT-base-sized BertForSequenceClassification built from a config (12 layers, hidden 768,
12 heads, intermediate 3072, vocabulary 30522; nothing is downloaded), made-up token ids of length 128 (fixed, no
padding), bf16 autocast with fp32 weights, AdamW (fused, the Trainer's default) with linear decay, clipping at 1.0,
no evaluation or checkpoints. Each variant runs in a fresh process, in turns, repeat after repeat. Reported, median
over repeats:
- samples/s: steady state, optimizer steps 10..end, batch / step time (the GPU synchronized at each stamp);
- time to first step: from building the loader and optimizer (the Trainers: TrainingArguments) to the end of the
  first optimizer step, the model already built on the CPU;
- peak memory: torch.cuda.max_memory_allocated over the run, the model's move to the GPU included.

The batch: --batch N, or by default the largest power of two (from 8, up to --max-batch) with which every variant
runs 3 steps without running out of memory, so all three train the same batch.

    python benchmarks/gpu_trainer.py [--repeats 3] [--steps 60] [--batch N] [--json out.json]   # or make bench-gpu

`--smoke`: the same three variants on the CPU with a 2-layer, 64-wide BERT (no peak memory, no figures worth
keeping), so that the suite runs this script's code where no GPU is (tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("bare", "transformers", "hf_backend")
SEQ = 128
VOCAB = 30522


def _model(smoke: bool):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if smoke else \
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    config = BertConfig(vocab_size=VOCAB, max_position_embeddings=512, num_labels=2, **size)
    return BertForSequenceClassification(config)


class _Synthetic:
    """`n` rows of random token ids (length SEQ) with a binary label; deterministic."""

    def __init__(self, n: int) -> None:
        import torch

        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, VOCAB, (n, SEQ), generator=generator)
        self.labels = torch.randint(0, 2, (n,), generator=generator)
        self.mask = torch.ones(SEQ, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask, "labels": self.labels[i]}


def _worker(variant: str, steps: int, batch: int, out: Path, smoke: bool) -> None:
    import torch

    model = _model(smoke)
    data = _Synthetic(batch * steps)
    stamps: list[float] = []
    gpu = not smoke

    def stamp() -> None:
        if gpu:
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    start = time.perf_counter()
    try:
        if variant == "bare":
            _bare_loop(model, data, steps, batch, stamp, gpu)
        else:
            _trainer(variant, model, data, steps, batch, stamp, gpu)
    except torch.OutOfMemoryError:
        out.write_text(json.dumps({"oom": True}))
        return
    warm = min(10, len(stamps) - 1)
    steady = (len(stamps) - 1 - warm) * batch / (stamps[-1] - stamps[warm]) if len(stamps) - 1 > warm else None
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
    out.write_text(json.dumps({"oom": False, "first_step_s": stamps[0] - start, "samples_per_s": steady,
                               "peak_gib": peak, "steps": len(stamps)}))


def _bare_loop(model, data, steps, batch, stamp, gpu) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    model.to(device).train()
    loader = DataLoader(data, batch_size=batch, shuffle=True, pin_memory=gpu, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0, fused=True)
    sched = get_linear_schedule_with_warmup(opt, 0, steps)
    for done, inputs in enumerate(loader, 1):
        inputs = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        stamp()
        if done == steps:
            break


def _trainer(variant, model, data, steps, batch, stamp, gpu) -> None:
    from transformers import TrainerCallback

    if variant == "hf_backend":
        from hf_backend import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamp()

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=batch, max_steps=steps, bf16=True,
                                 learning_rate=5e-5, save_strategy="no", eval_strategy="no", logging_steps=10_000,
                                 report_to="none", disable_tqdm=True, dataloader_pin_memory=gpu, seed=0,
                                 use_cpu=not gpu)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[Stamp()]).train()


def _run(variant: str, steps: int, batch: int, smoke: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, __file__, "--worker", variant, "--steps", str(steps), "--batch", str(batch),
               "--out", str(out), *(["--smoke"] if smoke else [])]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if not out.is_file():
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}",
                    "stderr": proc.stderr[-3000:]}
        return json.loads(out.read_text())


def _largest_batch(max_batch: int, smoke: bool) -> int:
    """The largest power of two from 8 with which every variant runs 3 steps."""
    fits, batch = 0, 8
    while batch <= max_batch:
        runs = {v: _run(v, 3, batch, smoke) for v in VARIANTS}
        failed = {v: r["error"] for v, r in runs.items() if "error" in r}
        if failed:
            raise SystemExit(f"batch search at {batch}: a variant failed for another reason than memory: {failed}")
        ooms = [v for v, r in runs.items() if r["oom"]]
        print(f"batch {batch}: " + ("fits all three" if not ooms else f"out of memory in {', '.join(ooms)}"),
              flush=True)
        if ooms:
            break
        fits, batch = batch, batch * 2
    if not fits:
        raise SystemExit("even batch 8 runs out of memory in one of the variants")
    return fits


def _versions() -> dict:
    import importlib.metadata

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "accelerate", "hf_backend"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=None, help="default: the largest power of two that fits all three")
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", choices=VARIANTS, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="a tiny BERT on the CPU: runs the code, measures nothing")
    args = p.parse_args()
    if args.worker:  # (the batch search's workers run 3 steps)
        _worker(args.worker, args.steps, args.batch, Path(args.out), args.smoke)
        return 0
    if args.steps <= 11:
        p.error(f"--steps {args.steps}: samples/s is taken over the steps after the 10th; give at least 12")

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks/gpu_trainer.py: no CUDA device here; it measures GPU training only", file=sys.stderr)
        return 2
    device = "CPU (--smoke: a 2-layer, 64-wide BERT)" if args.smoke else torch.cuda.get_device_name(0)
    batch = args.batch or _largest_batch(args.max_batch, args.smoke)
    results: dict = {"device": device, "host": f"{platform.machine()}, {os.cpu_count()} cores",
                     "versions": _versions(), "date": time.strftime("%Y-%m-%d"), "batch": batch, "seq": SEQ,
                     "steps": args.steps, "repeats": args.repeats, "runs": {v: [] for v in VARIANTS}}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            results["runs"][variant].append(_run(variant, args.steps, batch, args.smoke))
    size = "tiny" if args.smoke else "BERT-base-sized"
    print(f"\n{device}; {size}, bf16, sequence {SEQ}, batch {batch}, {args.steps} steps, median of "
          f"{args.repeats}; {', '.join(f'{k} {v}' for k, v in results['versions'].items())}\n")
    rows: dict = {}
    for variant, runs in results["runs"].items():
        bad = [r for r in runs if "error" in r or r["oom"]]
        rows[variant] = {key: statistics.median(r[key] for r in runs) if runs[0][key] is not None else None
                         for key in ("samples_per_s", "first_step_s", "peak_gib")} if not bad else None
        if bad:
            results.setdefault("failures", {})[variant] = bad[0].get("error", "out of memory")
    print("| variant | samples/s | vs bare | vs transformers | time to first step (s) | peak memory (GiB) |")
    print("|---|---|---|---|---|---|")
    for variant, row in rows.items():
        if row is None:
            print(f"| {variant} | failed: {results['failures'][variant]} | | | | |")
            continue
        ratio = {base: f"{row['samples_per_s'] / rows[base]['samples_per_s']:.3f}" if rows.get(base) else "-"
                 for base in ("bare", "transformers")}
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        print(f"| {variant} | {row['samples_per_s']:.1f} | {ratio['bare']} | {ratio['transformers']} | "
              f"{row['first_step_s']:.2f} | {peak} |")
    results["medians"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
