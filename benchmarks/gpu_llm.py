"""On one GPU: a 1.1B Llama, full fine-tuning and LoRA, on a bare loop, the two Trainers and TRL.

The model: LlamaForCausalLM from a config (hidden 2048, 16 layers, 32 heads, 8 key/value heads,
intermediate 8192, vocabulary 32000, untied lm_head: 1,104,218,112 parameters; nothing is
downloaded); made-up token ids, sequence 2048, batch 2, no padding; bf16 autocast, activation
checkpointing (non-reentrant), fused AdamW, linear decay, clipping at 1.0, nothing logged or saved.
Modes: full (fp32 weights, all trained) and lora (a frozen bf16 base; PEFT LoRA, rank 16, alpha 32,
on q/k/v/o: 3,407,872 fp32 parameters). Variants: a bare PyTorch loop, transformers.Trainer,
hf_backend.Trainer, TRL's SFTTrainer stock and through `hf_backend.on_engine` (TRL's own loss and
per-step metrics). Each (mode, variant) runs in a fresh process, in turns over the repeats; medians:
- tokens/s over optimizer steps 4..end (a CUDA event at each step end, no synchronization added);
- MFU: tokens/s x FLOPs per token / the device's dense bf16 peak (PEAK_BF16_TFLOPS), the FLOPs
  6 N for full and 4 N + 6 N_adapter for LoRA (N: all parameters; attention's sequence-squared
  FLOPs and the checkpointing recompute not counted);
- time to first step: from building the optimizer or Trainer (the model already on the GPU) to
  the end of the first optimizer step; peak memory: torch.cuda.max_memory_allocated.

    python benchmarks/gpu_llm.py [--repeats 1] [--steps 20] [--modes full lora] [--json out.json]

(`make bench-gpu-llm`). `--smoke`: on the CPU with a tiny Llama (2 layers, width 64, vocabulary
512, sequence 64, fp32), measuring nothing: tests/test_benchmarks.py runs the code with it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("full", "lora")
VARIANTS = ("bare", "transformers", "hf_backend", "trl", "trl_engine")
STOCK = {"hf_backend": "transformers", "trl_engine": "trl"}  # engine variant: its stock one
WARM = 3  # tokens/s over the steps after this one
LR = {"full": 1e-5, "lora": 1e-4}
# NVIDIA's dense bf16 Tensor Core peak (datasheets; their sparse figures are twice these), matched
# in this order against torch.cuda.get_device_name: the first name it contains.
PEAK_BF16_TFLOPS = (("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
                    ("H100", 989.0))


def _size(smoke: bool) -> dict:
    if smoke:
        return dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, seq=64)
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, seq=2048)


def _model(mode: str, smoke: bool):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    size = _size(smoke)
    seq = size.pop("seq")
    config = LlamaConfig(**size, max_position_embeddings=seq, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    lora, dtype = mode == "lora", torch.bfloat16 if mode == "lora" and not smoke else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=targets))
    return model, seq


def _worker(mode: str, variant: str, steps: int, batch: int, out: Path, smoke: bool) -> None:
    import torch

    gpu = not smoke
    with torch.device("cuda", 0) if gpu else torch.device("cpu"):
        model, seq = _model(mode, smoke)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(3, model.config.vocab_size, (batch * steps, seq),
                        generator=torch.Generator().manual_seed(0))
    ones = torch.ones(seq, dtype=torch.long)
    rows = [{"input_ids": row, "attention_mask": ones, "labels": row} for row in ids]
    ends: list = []  # one CUDA event (CPU: a time) per optimizer step
    first: list[float] = []

    def step_end() -> None:
        ends.append(torch.cuda.Event(enable_timing=True) if gpu else time.perf_counter())
        if gpu:
            ends[-1].record()
        if len(ends) == 1:  # the first step, waited for
            if gpu:
                torch.cuda.synchronize()
            first.append(time.perf_counter())

    start = time.perf_counter()
    try:
        if variant == "bare":
            _bare_loop(model, rows, mode, steps, batch, step_end, gpu)
        else:
            _trainer(variant, model, rows, mode, steps, batch, step_end, gpu)
    except torch.OutOfMemoryError:
        out.write_text(json.dumps({"oom": True}))
        return
    if gpu:
        torch.cuda.synchronize()
        seconds = ends[WARM - 1].elapsed_time(ends[-1]) / 1000
    else:
        seconds = ends[-1] - ends[WARM - 1]
    out.write_text(json.dumps({
        "oom": False, "steps": len(ends), "first_step_s": first[0] - start,
        "tokens_per_s": (len(ends) - WARM) * batch * seq / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))


def _bare_loop(model, rows, mode, steps, batch, step_end, gpu) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    device = next(model.parameters()).device
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5.23 on
    (enable or model.gradient_checkpointing_enable)()  # non-reentrant, as the Trainers' argument
    model.train()
    loader = DataLoader(rows, batch_size=batch, shuffle=True, pin_memory=gpu, drop_last=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR[mode], weight_decay=0.0, fused=True)
    sched = get_linear_schedule_with_warmup(opt, 0, steps)
    for done, inputs in enumerate(loader, 1):
        inputs = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step_end()
        if done == steps:
            break


def _trainer(variant, model, rows, mode, steps, batch, step_end, gpu) -> None:
    import dataclasses

    from transformers import TrainerCallback

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_end()

    extra: dict = {}
    if variant in ("trl", "trl_engine"):
        from datasets import Dataset
        from trl import SFTConfig as Arguments
        from trl import SFTTrainer as Trainer

        if variant == "trl_engine":
            import hf_backend

            Trainer, Arguments = hf_backend.on_engine(Trainer, Arguments)
        seq = len(rows[0]["input_ids"])
        extra = {"processing_class": _tokenizer(model.config.vocab_size)}
        data = Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows]})
        options = {"max_length": seq, "packing": False, "gradient_checkpointing": True}
    else:
        if variant == "hf_backend":
            from hf_backend import Trainer
            from hf_backend import TrainingArguments as Arguments
        else:
            from transformers import Trainer
            from transformers import TrainingArguments as Arguments
        data = rows
        fields = {field.name for field in dataclasses.fields(Arguments)}
        options = {"activation_checkpointing" if "activation_checkpointing" in fields
                   else "gradient_checkpointing": True}
    with tempfile.TemporaryDirectory() as tmp:
        args = Arguments(output_dir=tmp, per_device_train_batch_size=batch, max_steps=steps,
                         bf16=gpu, learning_rate=LR[mode], weight_decay=0.0, warmup_steps=0,
                         lr_scheduler_type="linear", max_grad_norm=1.0, save_strategy="no",
                         eval_strategy="no", logging_steps=10_000, report_to="none",
                         disable_tqdm=True, dataloader_pin_memory=gpu, seed=0, use_cpu=not gpu,
                         **options)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[StepEnd()], **extra).train()


def _tokenizer(vocab: int):
    """A word-level tokenizer of `vocab` made-up words: SFTTrainer wants one (the data: ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", *(f"w{i}" for i in range(3, vocab))]
    raw = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def _run(mode: str, variant: str, steps: int, batch: int, smoke: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        if smoke:  # the code path only: in this process, not a fresh one per run (peak memory is not read)
            began = time.perf_counter()
            _worker(mode, variant, steps, batch, out, smoke)
            return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - began}
        cmd = [sys.executable, __file__, "--worker", variant, "--mode", mode, "--steps", str(steps),
               "--batch", str(batch), "--out", str(out), *(["--smoke"] if smoke else [])]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false",
               "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
        began = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if not out.is_file():
            lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
            return {"error": lines[-1], "stderr": proc.stderr[-3000:]}
        return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - began}


def _mfu(mode: str, run: dict, tokens_per_s: float, peak: float | None) -> float | None:
    if peak is None:
        return None
    n, adapter = run["parameters"], run["trainable"]
    per_token = 6 * n if mode == "full" else 4 * (n - adapter) + 6 * adapter
    return per_token * tokens_per_s / (peak * 1e12)


def _versions() -> dict:
    import importlib.metadata as metadata

    import torch

    names = ("transformers", "accelerate", "peft", "trl", "hf_backend")
    found = {d.metadata["Name"].replace("-", "_"): d.version for d in metadata.distributions()}
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            **{name: found.get(name, "not installed") for name in names}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--json", default=None)
    p.add_argument("--worker", choices=VARIANTS, default=None)
    p.add_argument("--mode", choices=MODES, default="full")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU: measures nothing")
    args = p.parse_args()
    if args.worker:
        _worker(args.mode, args.worker, args.steps, args.batch, Path(args.out), args.smoke)
        return 0
    if args.steps <= WARM + 1:
        p.error(f"--steps {args.steps}: tokens/s is taken after step {WARM}; give {WARM + 2}+")
    modes, variants = args.modes, args.variants
    needed = {"peft": "lora" in modes, "trl": bool({"trl", "trl_engine"} & set(variants))}
    missing = [name for name, used in needed.items() if used and not importlib.util.find_spec(name)]
    if missing:
        print(f"benchmarks/gpu_llm.py: {missing[0]} is not installed (pip install -e '.[llm]'); or "
              "leave out what needs it (--modes full, --variants bare transformers hf_backend)",
              file=sys.stderr)
        return 2

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks/gpu_llm.py: no CUDA device here; it measures GPU training only",
              file=sys.stderr)
        return 2
    device = "CPU (--smoke: a tiny Llama)" if args.smoke else torch.cuda.get_device_name(0)
    peak = next((tflops for name, tflops in PEAK_BF16_TFLOPS if name in device), None)
    seq = _size(args.smoke)["seq"]
    results: dict = {"device": device, "peak_bf16_tflops": peak, "versions": _versions(),
                     "date": time.strftime("%Y-%m-%d"), "batch": args.batch, "seq": seq,
                     "steps": args.steps, "repeats": args.repeats,
                     "runs": {m: {v: [] for v in variants} for m in modes}}
    for _ in range(args.repeats):
        for mode in modes:
            for variant in variants:
                run = _run(mode, variant, args.steps, args.batch, args.smoke)
                results["runs"][mode][variant].append(run)
                done = f"{run['tokens_per_s']:.0f} tokens/s, {run['wall_s']:.0f} s" \
                    if "tokens_per_s" in run else run.get("error", "out of memory")
                print(f"{mode} {variant}: {done}", flush=True)
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    print(f"\n{device} (bf16 dense peak: {peak or 'not in the table'} TFLOPS); "
          f"{'a tiny Llama' if args.smoke else 'Llama 1.1B'}, sequence {seq}, batch {args.batch}, "
          f"{args.steps} steps, median of {args.repeats}; {versions}\n")
    print("| mode | variant | tokens/s | vs bare | vs stock | MFU | time to first step (s) "
          "| peak memory (GiB) |\n|---|---|---|---|---|---|---|---|")
    medians: dict = {}
    for mode in modes:
        rows = medians[mode] = {}
        for variant, runs in results["runs"][mode].items():
            bad = [r.get("error", "out of memory") for r in runs if "error" in r or r["oom"]]
            if bad:
                results.setdefault("failures", {})[f"{mode} {variant}"] = bad[0]
                print(f"| {mode} | {variant} | failed: {bad[0]} | | | | | |")
                continue
            row = rows[variant] = {
                key: None if runs[0][key] is None else statistics.median(r[key] for r in runs)
                for key in ("tokens_per_s", "first_step_s", "peak_gib")}
            row["mfu"] = _mfu(mode, runs[0], row["tokens_per_s"], peak)
            ratio = {base: f"{row['tokens_per_s'] / rows[base]['tokens_per_s']:.3f}"
                     if base in rows else "-" for base in ("bare", STOCK.get(variant))}
            mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
            memory = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
            print(f"| {mode} | {variant} | {row['tokens_per_s']:.0f} | {ratio['bare']} | "
                  f"{ratio[STOCK.get(variant)]} | {mfu} | {row['first_step_s']:.2f} | {memory} |")
    results["medians"] = medians
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if "failures" in results else 0


if __name__ == "__main__":
    sys.exit(main())
