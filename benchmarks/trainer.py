"""hf_backend.Trainer against transformers.Trainer and a bare PyTorch loop, side by side in one run.

Same recipe for each: a small BERT (2 layers, hidden 128) fine-tuned for sequence classification on made-up
sentences (tokenized, padded per batch by DataCollatorWithPadding), AdamW with linear decay, clipping at 1.0, batch
16 per process, no evaluation or checkpoints. With several processes all three train data-parallel with DDP (gloo):
the bare loop wraps the model itself, and both Trainers get `use_cpu=True` (without it, transformers.Trainer under
torchrun on a CPU-only machine does not wrap the model in DDP at all: each process trains its own copy).
Each variant runs in fresh processes (so process-group setup counts), in turns, repeat after repeat.
Reports the median of:
- time to first step: from building TrainingArguments (the bare loop: its loader and optimizer) to the end of the
  first optimizer step, the model and data already in memory;
- samples/s: steady state, optimizer steps 10..end, global batch / step time.

    .venv/bin/python benchmarks/trainer.py [--repeats 3] [--steps 150] [--nproc 1 2] [--json out.json]
    .venv/bin/python benchmarks/trainer.py --tiny --batch 4 --steps 600 --nproc 1   # per-step overhead: a model so
                                                                                    # small the loop's own code shows
    .venv/bin/python benchmarks/trainer.py --profile [--steps 150]   # where a step goes, one process, under cProfile

Besides the medians, "paired" is the median over repeats of each repeat's ratio to the bare loop run just before it
(less sensitive to the machine's load drifting during the run).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("bare", "transformers", "hf_backend")
WORDS = ["good", "great", "fine", "nice", "bad", "awful", "poor", "sad", "the", "a", "movie", "film", "plot", "was",
         "is", "very", "quite", "story", "acting", "actors", "music", "scene", "long", "short", "funny", "boring"]


def _setup(workdir: Path, tiny: bool = False):
    import torch
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = workdir / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tok = BertTokenizerFast(vocab_file=str(vocab))
    r = random.Random(0)
    rows = [{"text": " ".join(r.choice(WORDS) for _ in range(r.randint(8, 48))), "label": r.randint(0, 1)}
            for _ in range(4096)]
    data = Dataset.from_list(rows).map(lambda b: tok(b["text"], truncation=True), batched=True,
                                       remove_columns=["text"])
    torch.manual_seed(0)
    size = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=1, intermediate_size=16) if tiny else \
        dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)
    model = BertForSequenceClassification(BertConfig(vocab_size=len(tok), max_position_embeddings=64, num_labels=2,
                                                     **size))
    return tok, data, model


def _worker(variant: str, steps: int, batch: int, out: Path, tiny: bool) -> None:
    workdir = Path(tempfile.mkdtemp())
    tok, data, model = _setup(workdir, tiny)
    stamps: list[float] = []
    start = time.perf_counter()
    if variant == "bare":
        _bare_loop(model, tok, data, steps, batch, stamps)
    else:
        _trainer(variant, model, tok, data, steps, batch, stamps, workdir)
    if int(os.environ.get("RANK", "0")) == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        steady = (len(stamps) - 10) * batch * world / (stamps[-1] - stamps[9])
        out.write_text(json.dumps({"first_step_s": stamps[0] - start, "samples_per_s": steady}))


def _bare_loop(model, tok, data, steps, batch, stamps) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding, get_linear_schedule_with_warmup

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sampler = None
    if world > 1:
        torch.distributed.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
        sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch, shuffle=sampler is None, sampler=sampler,
                        collate_fn=DataCollatorWithPadding(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0, fused=True)  # the Trainer's default
    sched = get_linear_schedule_with_warmup(opt, 0, steps)
    model.train()
    done = 0
    while done < steps:
        for inputs in loader:
            model(**inputs).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            stamps.append(time.perf_counter())
            done += 1
            if done == steps:
                break


def _trainer(variant, model, tok, data, steps, batch, stamps, workdir) -> None:
    from transformers import DataCollatorWithPadding, TrainerCallback

    if variant == "hf_backend":
        from hf_backend import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = TrainingArguments(output_dir=str(workdir / "out"), per_device_train_batch_size=batch, max_steps=steps,
                             use_cpu=True,
                             learning_rate=5e-5, save_strategy="no", eval_strategy="no", logging_steps=10_000,
                             report_to="none", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data, processing_class=tok,
            data_collator=DataCollatorWithPadding(tok), callbacks=[Stamp()]).train()


def _profile(steps: int, batch: int, tiny: bool) -> None:
    """Each variant once in this process under cProfile: per step, the time of each call the loop makes (the loop's
    own callees, and those of transformers' `training_step`), largest first, over all steps (the first ones include
    warm-up). cProfile adds about a microsecond per Python call, so Python-heavy rows are inflated against torch's
    kernels; the step time printed is the profiled one."""
    loops = {"bare": ("_bare_loop",), "hf_backend": ("_run_epoch", "training_step"),
             "transformers": ("_run_epoch", "training_step")}
    for variant, parents in loops.items():
        workdir = Path(tempfile.mkdtemp())
        tok, data, model = _setup(workdir, tiny)
        profiler, stamps = cProfile.Profile(), []
        profiler.enable()
        if variant == "bare":
            _bare_loop(model, tok, data, steps, batch, stamps)
        else:
            _trainer(variant, model, tok, data, steps, batch, stamps, workdir)
        profiler.disable()
        measured = len(stamps)
        rows = []
        for function, (_, _, _, _, callers) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
            for caller, (_, calls, _, cumulative) in callers.items():
                if caller[2] in parents:
                    rows.append((cumulative / measured * 1e6, calls / measured, f"{caller[2]} -> {_name(function)}"))
        print(f"\n{variant}: {(stamps[-1] - stamps[9]) / (measured - 10) * 1e3:.2f} ms a step under cProfile "
              f"(steps 10..{measured})\n{'us/step':>9}{'calls/step':>12}  call")
        for us, calls, name in sorted(rows, reverse=True)[:25]:
            print(f"{us:>9.1f}{calls:>12.2f}  {name}")


def _name(function: tuple) -> str:
    path, line, name = function
    if path == "~":
        return name
    parts = Path(path).parts
    return f"{'/'.join(parts[parts.index('site-packages') + 1:] if 'site-packages' in parts else parts[-2:])}:{line}" \
        f"({name})"


def _run(variant: str, nproc: int, steps: int, batch: int, tiny: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable]
        if nproc > 1:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += [__file__, "--worker", variant, "--steps", str(steps), "--batch", str(batch), "--out", str(out),
                *(["--tiny"] if tiny else [])]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
               "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if not out.is_file():
            raise SystemExit(f"{variant} x{nproc} failed:\n{proc.stderr[-3000:]}")
        # A run that measured and then died at interpreter exit (gloo's "terminate called without an active
        # exception", which hf_backend prevents by destroying its process group first) is counted, and reported.
        return {**json.loads(out.read_text()), "crashed_at_exit": proc.returncode != 0}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tiny", action="store_true", help="a 1-layer, 16-wide model: measures per-step overhead")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", choices=VARIANTS, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="where a step goes (one process, cProfile), no timing runs")
    args = p.parse_args()
    if args.profile:
        _profile(args.steps, args.batch, args.tiny)
        return 0
    if args.worker:
        _worker(args.worker, args.steps, args.batch, Path(args.out), args.tiny)
        return 0

    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "steps": args.steps, "tiny": args.tiny,
                     "batch_per_process": args.batch, "runs": {}}
    for nproc in args.nproc:
        samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                samples[variant].append(_run(variant, nproc, args.steps, args.batch, args.tiny))
        rows = {v: {"samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
                    "paired_vs_bare": statistics.median(r["samples_per_s"] / b["samples_per_s"]
                                                        for r, b in zip(runs, samples["bare"])),
                    "first_step_s": statistics.median(r["first_step_s"] for r in runs),
                    "crashed_at_exit": sum(r["crashed_at_exit"] for r in runs)} for v, runs in samples.items()}
        results["runs"][f"{nproc} process" + ("es" if nproc > 1 else "")] = rows
        print(f"\n{nproc} process(es), batch {args.batch} per process, {args.steps} steps, median of {args.repeats}")
        print(f"{'variant':<14}{'samples/s':>11}{'vs bare':>9}{'paired':>8}{'vs transformers':>17}"
              f"{'first step s':>14}{'exit crashes':>14}")
        for v, row in rows.items():
            print(f"{v:<14}{row['samples_per_s']:>11.1f}{row['samples_per_s'] / rows['bare']['samples_per_s']:>9.3f}"
                  f"{row['paired_vs_bare']:>8.3f}{row['samples_per_s'] / rows['transformers']['samples_per_s']:>17.3f}"
                  f"{row['first_step_s']:>14.2f}{row['crashed_at_exit']:>10}/{len(samples[v])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
