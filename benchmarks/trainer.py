"""hf_backend.Trainer against transformers.Trainer and a bare PyTorch loop, side by side in one run.

Same recipe for each: a small BERT (2 layers, hidden 128) fine-tuned for sequence classification on made-up
sentences (tokenized, padded per batch by DataCollatorWithPadding), AdamW with linear decay, clipping at 1.0, batch
16 per process, no evaluation or checkpoints. With several processes all variants train data-parallel with DDP (gloo):
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
    .venv/bin/python benchmarks/trainer.py --profile [--steps 150] [--model lora]  # where a step goes, cProfile
    .venv/bin/python benchmarks/trainer.py --phases [--steps 150] [--model lora]  # the same, wall clock per phase

With several processes a fourth variant, hf_backend_static, is hf_backend.Trainer with
ddp_find_unused_parameters=False (see VARIANTS).

Besides the medians, "paired" is the median over repeats of each repeat's ratio to the bare loop run just before it
(less sensitive to the machine's load drifting during the run). Each repeat runs the bare loop first and the others in
an order rotated from repeat to repeat.
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

VARIANTS = ("bare", "transformers", "hf_backend", "hf_backend_static")
# hf_backend_static: hf_backend.Trainer with ddp_find_unused_parameters=False (transformers' default is True for a
# PreTrainedModel without gradient checkpointing: DDP then walks the autograd graph after every forward). Only run
# with several processes; in one there is no DDP.
WORDS = ["good", "great", "fine", "nice", "bad", "awful", "poor", "sad", "the", "a", "movie", "film", "plot", "was",
         "is", "very", "quite", "story", "acting", "actors", "music", "scene", "long", "short", "funny", "boring"]


def _setup(workdir: Path, tiny: bool = False, kind: str = "bert"):
    """The tokenizer, the tokenized rows and the model: a BERT classifier, the same with a LoRA adapter (peft: r 8
    on query and value, the classifier trained whole), or a Llama causal LM of the same size on the same sentences."""
    import torch
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = workdir / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tok = BertTokenizerFast(vocab_file=str(vocab))
    r = random.Random(0)
    rows = [{"text": " ".join(r.choice(WORDS) for _ in range(r.randint(8, 48))), "label": r.randint(0, 1)}
            for _ in range(4096)]
    causal = kind == "llama"
    data = Dataset.from_list(rows).map(lambda b: tok(b["text"], truncation=True, return_token_type_ids=not causal),
                                       batched=True, remove_columns=["text", *(["label"] if causal else [])])
    torch.manual_seed(0)
    size = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=1, intermediate_size=16) if tiny else \
        dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)
    if causal:
        from transformers import LlamaConfig, LlamaForCausalLM

        return tok, data, LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), max_position_embeddings=64,
                                                       pad_token_id=tok.pad_token_id, **size))
    model = BertForSequenceClassification(BertConfig(vocab_size=len(tok), max_position_embeddings=64, num_labels=2,
                                                     **size))
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16,
                                                 target_modules=["query", "value"], lora_dropout=0.0))
    return tok, data, model


def _collator(tok, kind: str):
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    return DataCollatorForLanguageModeling(tok, mlm=False) if kind == "llama" else DataCollatorWithPadding(tok)


def _worker(variant: str, steps: int, batch: int, out: Path, tiny: bool, kind: str) -> None:
    workdir = Path(tempfile.mkdtemp())
    tok, data, model = _setup(workdir, tiny, kind)
    stamps: list[float] = []
    start = time.perf_counter()
    if variant == "bare":
        _bare_loop(model, _collator(tok, kind), data, steps, batch, stamps)
    else:
        _trainer(variant, model, tok, _collator(tok, kind), data, steps, batch, stamps, workdir)
    if int(os.environ.get("RANK", "0")) == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        steady = (len(stamps) - 10) * batch * world / (stamps[-1] - stamps[9])
        out.write_text(json.dumps({"first_step_s": stamps[0] - start, "samples_per_s": steady}))


def _bare_loop(model, collator, data, steps, batch, stamps) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sampler = None
    if world > 1:
        torch.distributed.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
        sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch, shuffle=sampler is None, sampler=sampler,
                        collate_fn=collator)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=5e-5, weight_decay=0.0, fused=True)  # the Trainer's default
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


def _trainer(variant, model, tok, collator, data, steps, batch, stamps, workdir) -> None:
    from transformers import TrainerCallback

    if variant.startswith("hf_backend"):
        from hf_backend import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = TrainingArguments(output_dir=str(workdir / "out"), per_device_train_batch_size=batch, max_steps=steps,
                             use_cpu=True,
                             learning_rate=5e-5, save_strategy="no", eval_strategy="no", logging_steps=10_000,
                             report_to="none", disable_tqdm=True,
                             **({"ddp_find_unused_parameters": False} if variant == "hf_backend_static" else {}))
    Trainer(model=model, args=args, train_dataset=data, processing_class=tok,
            data_collator=collator, callbacks=[Stamp()]).train()


def _profile(steps: int, batch: int, tiny: bool, kind: str = "bert") -> None:
    """Each variant once in this process under cProfile: per step, the time of each call the loop makes (the loop's
    own callees, and those of transformers' `training_step`), largest first, over all steps (the first ones include
    warm-up). cProfile adds about a microsecond per Python call, so Python-heavy rows are inflated against torch's
    kernels; the step time printed is the profiled one."""
    loops = {"bare": ("_bare_loop",), "hf_backend": ("_run_epoch", "training_step"),
             "transformers": ("_run_epoch", "training_step")}
    for variant, parents in loops.items():
        workdir = Path(tempfile.mkdtemp())
        tok, data, model = _setup(workdir, tiny, kind)
        profiler, stamps = cProfile.Profile(), []
        profiler.enable()
        if variant == "bare":
            _bare_loop(model, _collator(tok, kind), data, steps, batch, stamps)
        else:
            _trainer(variant, model, tok, _collator(tok, kind), data, steps, batch, stamps, workdir)
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


# Phase name -> the calls timed for it (module or class, attribute). Only the outermost call of a phase counts, so a
# phase that nests (Trainer._clip_grad_norm around torch's clip, Module.train recursing) is timed once.
BATCH = "next batch (DataLoader, collate)"
PHASES = {
    BATCH: [("torch.utils.data.dataloader:_BaseDataLoaderIter", "__next__")],
    "get_batch_samples (loader included)": [("transformers:Trainer", "get_batch_samples")],
    "forward (loss included)": [("torch.nn.modules.module:Module", "__call__")],
    "backward": [("torch:Tensor", "backward")],
    "clip_grad_norm_": [("transformers:Trainer", "_clip_grad_norm"), ("torch.nn.utils", "clip_grad_norm_")],
    "optimizer.step": [("torch.optim:AdamW", "step")],
    "scheduler.step": [("torch.optim.lr_scheduler:LRScheduler", "step")],
    "zero_grad (model's or optimizer's)": [("torch.nn.modules.module:Module", "zero_grad"),
                                            ("torch.optim:Optimizer", "zero_grad")],
    "model.train()": [("torch.nn.modules.module:Module", "train")],
    "callbacks": [("transformers.trainer_callback:CallbackHandler", "call_event")],
    "_prepare_inputs": [("transformers:Trainer", "_prepare_inputs")],
    "floating_point_ops": [("transformers:Trainer", "floating_point_ops"),
                           ("hf_backend:Trainer", "floating_point_ops")],
}


def _phases(steps: int, batch: int, tiny: bool, kind: str = "bert") -> None:
    """Each variant once in this process (bare, hf_backend, transformers, then bare and hf_backend again) with the
    calls in PHASES timed by wrappers (wall clock, about 1 µs per wrapped call): ms per step for each phase over steps
    10..end, and what is left ("the rest": the loop's own code and everything not listed). Rows nest where noted
    (get_batch_samples contains the next batch)."""
    import importlib

    totals = {name: 0.0 for name in PHASES}
    depth = {name: 0 for name in PHASES}

    def timed(original, phase):
        def call(*args, **kwargs):
            depth[phase] += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                depth[phase] -= 1
                if not depth[phase]:
                    totals[phase] += time.perf_counter() - start
        return call

    for phase, targets in PHASES.items():
        for target, attribute in targets:
            module, _, cls = target.partition(":")
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            setattr(owner, attribute, timed(getattr(owner, attribute), phase))

    class Stamps(list):
        """The loop's step stamps; keeps the phase totals as they were at the 10th."""

        def append(self, stamp: float) -> None:
            super().append(stamp)
            if len(self) == 10:
                self.at_ten = dict(totals)

    columns: dict[str, dict[str, float]] = {}
    for n, variant in enumerate(("bare", "hf_backend", "transformers", "bare", "hf_backend")):
        workdir = Path(tempfile.mkdtemp())
        tok, data, model = _setup(workdir, tiny, kind)
        stamps = Stamps()
        if variant == "bare":
            _bare_loop(model, _collator(tok, kind), data, steps, batch, stamps)
        else:
            _trainer(variant, model, tok, _collator(tok, kind), data, steps, batch, stamps, workdir)
        measured = len(stamps) - 10
        column = {phase: (totals[phase] - stamps.at_ten[phase]) / measured * 1e3 for phase in PHASES}
        nested = column[BATCH] if column["get_batch_samples (loader included)"] else 0.0  # counted in it
        column["step"] = (stamps[-1] - stamps[9]) / measured * 1e3
        column["the rest"] = column["step"] - (sum(column[phase] for phase in PHASES) - nested)
        columns[f"{variant} ({n // 3 + 1})" if variant != "transformers" else variant] = column
    print(f"\nms per step, steps 10..{steps}, one process\n{'phase':<38}" + "".join(f"{v:>16}" for v in columns))
    for phase in ["step", *PHASES, "the rest"]:
        print(f"{phase:<38}" + "".join(f"{c[phase]:>16.3f}" for c in columns.values()))


def _name(function: tuple) -> str:
    path, line, name = function
    if path == "~":
        return name
    parts = Path(path).parts
    return f"{'/'.join(parts[parts.index('site-packages') + 1:] if 'site-packages' in parts else parts[-2:])}:{line}" \
        f"({name})"


def _run(variant: str, nproc: int, steps: int, batch: int, tiny: bool, kind: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable]
        if nproc > 1:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += [__file__, "--worker", variant, "--steps", str(steps), "--batch", str(batch), "--out", str(out),
                "--model", kind, *(["--tiny"] if tiny else [])]
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
    p.add_argument("--model", choices=("bert", "lora", "llama"), default="bert",
                   help="the BERT classifier, it with a LoRA adapter, or a Llama causal LM of the same size")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", choices=VARIANTS, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="where a step goes (one process, cProfile), no timing runs")
    p.add_argument("--phases", action="store_true", help="wall time per phase of a step (one process), no timing runs")
    args = p.parse_args()
    if args.profile:
        _profile(args.steps, args.batch, args.tiny, args.model)
        return 0
    if args.phases:
        _phases(args.steps, args.batch, args.tiny, args.model)
        return 0
    if args.worker:
        _worker(args.worker, args.steps, args.batch, Path(args.out), args.tiny, args.model)
        return 0

    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "steps": args.steps, "tiny": args.tiny,
                     "model": args.model,
                     "batch_per_process": args.batch, "runs": {}}
    for nproc in args.nproc:
        variants = [v for v in VARIANTS if nproc > 1 or v != "hf_backend_static"]
        samples: dict[str, list[dict]] = {v: [] for v in variants}
        for repeat in range(args.repeats):
            # bare first (the paired ratios divide by it), the others in an order rotated each repeat: a run can
            # slow the next one down (a process still exiting), which should not always fall on the same variant
            others = variants[1:]
            for variant in ["bare", *others[repeat % len(others):], *others[:repeat % len(others)]]:
                samples[variant].append(_run(variant, nproc, args.steps, args.batch, args.tiny, args.model))
        rows = {v: {"samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
                    "paired_vs_bare": statistics.median(r["samples_per_s"] / b["samples_per_s"]
                                                        for r, b in zip(runs, samples["bare"])),
                    "first_step_s": statistics.median(r["first_step_s"] for r in runs),
                    "crashed_at_exit": sum(r["crashed_at_exit"] for r in runs)} for v, runs in samples.items()}
        results["runs"][f"{nproc} process" + ("es" if nproc > 1 else "")] = rows
        print(f"\n{args.model}, {nproc} process(es), batch {args.batch} per process, {args.steps} steps, "
              f"median of {args.repeats}")
        print(f"{'variant':<19}{'samples/s':>11}{'vs bare':>9}{'paired':>8}{'vs transformers':>17}"
              f"{'first step s':>14}{'exit crashes':>14}")
        for v, row in rows.items():
            print(f"{v:<19}{row['samples_per_s']:>11.1f}{row['samples_per_s'] / rows['bare']['samples_per_s']:>9.3f}"
                  f"{row['paired_vs_bare']:>8.3f}{row['samples_per_s'] / rows['transformers']['samples_per_s']:>17.3f}"
                  f"{row['first_step_s']:>14.2f}{row['crashed_at_exit']:>10}/{len(samples[v])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
