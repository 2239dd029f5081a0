"""Host memory per rank while FSDP loads a pretrained model (issue 34): `from_pretrained` after FSDP
TrainingArguments, then the Trainer's `prepare` (up to its `on_train_begin`), 2 processes, for hf_backend.Trainer
with `cpu_ram_efficient_loading` off and on, and transformers.Trainer (on Accelerate) with it on.

A Llama of 134 M parameters (hidden 768, 12 layers, vocabulary 32000) is saved once in fp32 and once in bf16; three
ways of loading it:
- fp32 file, `from_pretrained` in its dtype (transformers 5's default `dtype="auto"`), no mixed precision;
- bf16 file, in its dtype, `bf16=True` (the engine keeps fp32 master weights);
- fp32 file, `from_pretrained(dtype=torch.bfloat16)`: a conversion, so `from_pretrained` makes a copy.

Per phase and rank: the peak of private memory (`RssAnon`, sampled every 2 ms by a thread of the measuring script)
above what the process held before the phase, and the peak of all resident memory (`VmHWM`, reset before the phase
through /proc/self/clear_refs), which also counts pages of the weights file that the process mapped and touched
(page cache, shared by the ranks and dropped under pressure, not memory the rank owns). glibc's mmap threshold is
fixed (`mallopt`) so that freed memory is returned at once.

    .venv/bin/python benchmarks/loading_memory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
VARIANTS = {"hf_backend, option off": ["--efficient", "0"], "hf_backend, option on": ["--efficient", "1"],
            "transformers.Trainer, option on": ["--efficient", "1", "--stock"]}
LOADS = {"fp32 file, dtype auto": ("fp32", "auto", False), "bf16 file, dtype auto, bf16=True": ("bf16", "auto", True),
         "fp32 file, dtype=bfloat16": ("fp32", "bfloat16", False)}


# -- one rank (run under torch.distributed.run) -----------------------------------------------------------------------
def rank_main(args: argparse.Namespace) -> None:
    import ctypes
    import threading
    import time

    if not ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024):  # M_MMAP_THRESHOLD: large frees return at once
        raise SystemExit("mallopt(M_MMAP_THRESHOLD) failed")
    import torch
    from transformers import LlamaForCausalLM, TrainerCallback

    if args.stock:
        from transformers import Trainer, TrainingArguments
    else:
        from hf_backend import Trainer, TrainingArguments

    def status() -> dict[str, float]:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return {k: int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "VmHWM")}

    peak = {"anon": 0.0}

    def sample() -> None:  # a daemon thread of this measuring script, not of the library
        while True:
            peak["anon"] = max(peak["anon"], status()["RssAnon"])
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()

    def phase_start() -> float:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM
        time.sleep(0.01)
        held = status()["RssAnon"]
        peak["anon"] = held
        return held

    def phase_end(held: float) -> dict[str, float]:
        time.sleep(0.01)
        now = status()
        return {"peak_private_mib": max(peak["anon"], now["RssAnon"]) - held, "peak_resident_mib": now["VmHWM"]}

    training = TrainingArguments(
        output_dir=args.out, max_steps=1, per_device_train_batch_size=1, report_to=[], save_strategy="no",
        logging_strategy="no", use_cpu=True, bf16=args.bf16, fsdp="full_shard",
        fsdp_config={"cpu_ram_efficient_loading": bool(args.efficient),
                     "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    rows: dict[str, dict[str, float]] = {}
    held = phase_start()
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=dtype)
    rows["from_pretrained"] = phase_end(held)
    held = phase_start()

    class Probe(TrainerCallback):
        def on_train_begin(self, *_, **__) -> None:
            rows["prepare"] = phase_end(held)

    ids = torch.randint(0, 1000, (2, 16))
    Trainer(model=model, args=training, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
            callbacks=[Probe()]).train()
    Path(args.out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(rows))


# -- driver -----------------------------------------------------------------------------------------------------------
def save_models(root: Path) -> dict[str, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12)
    model = LlamaForCausalLM(config)
    paths = {"fp32": root / "fp32", "bf16": root / "bf16"}
    model.save_pretrained(paths["fp32"])
    model.to(torch.bfloat16).save_pretrained(paths["bf16"])
    return paths


def launch(model: Path, flags: list[str], out: Path) -> dict[int, dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(HERE),
               "--rank-main", "--model", str(model), "--out", str(out), *flags]
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{' '.join(flags)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--efficient", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = save_models(Path(tmp))
        figures = {}
        for load, (file, dtype, bf16) in LOADS.items():
            for variant, flags in VARIANTS.items():
                extra = ["--dtype", dtype] + (["--bf16"] if bf16 else [])
                figures[f"{load} | {variant}"] = launch(paths[file], [*flags, *extra], Path(tmp) / "out")
    lines = ["| load | trainer, cpu_ram_efficient_loading | from_pretrained: private peak, rank 0 / 1 (MiB) | "
             "prepare: private peak, rank 0 / 1 | prepare: resident peak, rank 0 / 1 |", "|---|---|---|---|---|"]
    def pair(ranks: dict, phase: str, field: str) -> str:
        return f"{ranks[0][phase][field]:.0f} / {ranks[1][phase][field]:.0f}"

    for key, ranks in figures.items():
        load, variant = key.split(" | ")
        lines.append(f"| {load} | {variant} | {pair(ranks, 'from_pretrained', 'peak_private_mib')} | "
                     f"{pair(ranks, 'prepare', 'peak_private_mib')} | {pair(ranks, 'prepare', 'peak_resident_mib')} |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
