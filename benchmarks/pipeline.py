"""Step time of pipeline stages by schedule (issue 56): pp 2 with GPipe, 1F1B and interleaved 1F1B over 8 microbatches,
against one process training the whole model, side by side in one run.

A Llama from a config (hidden 256, 8 layers, vocabulary 1024, fp32), a global batch of 16 sequences of 256 tokens,
SGD, through an Accelerator loop (`accelerator.forward_backward` on the stages; `model(**batch)` and `backward` in one
process). Each setting is its own launch, one thread per process (the 2 processes of pp 2 have a core each): 2 steps
to warm up, then the median of `--steps` timed steps, and each rank's peak private memory (`RssAnon`, sampled every
2 ms by a thread of this script) above what it held before the timed steps: the activations its schedule keeps.

The ideal pp 2 step is one process's over 2 (each rank runs half the layers); what it loses is the bubble, (p - 1) /
(m + p - 1) of a step for GPipe and 1F1B, (p - 1) / (2 m + p - 1) interleaved, and the sends between the stages. The
table gives both: the measured share lost, 1 - ideal / measured, beside the schedule's bubble.

The settings run in turn `--repeats` times (A B C D A B C D); the table has the median of the runs' medians and
their range.

    .venv/bin/python benchmarks/pipeline.py [--steps 5] [--repeats 2] [--microbatches 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SETTINGS = {"one process": None, "pp 2 GPipe": "GPipe", "pp 2 1F1B": "1F1B", "pp 2 Interleaved1F1B": "Interleaved1F1B"}
CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=8, max_position_embeddings=512, use_cache=False, tie_word_embeddings=False)
ROWS, SEQ = 16, 256


def rank_main(args: argparse.Namespace) -> None:
    import ctypes
    import threading

    if not ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024):  # M_MMAP_THRESHOLD: large frees return at once
        raise SystemExit("mallopt(M_MMAP_THRESHOLD) failed")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_backend import Accelerator, ParallelismConfig

    torch.set_num_threads(1)

    def private_mib() -> float:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(fields["RssAnon"].split()[0]) / 1024

    peak = {"anon": 0.0}

    def sample() -> None:  # a daemon thread of this measuring script, not of the library
        while True:
            peak["anon"] = max(peak["anon"], private_mib())
            time.sleep(0.002)

    pipelined = args.schedule is not None
    config = ParallelismConfig(pp_size=2, pp_schedule=args.schedule, pp_microbatches=args.microbatches) \
        if pipelined else None
    accelerator = Accelerator(parallelism_config=config) if pipelined else Accelerator()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, CONFIG["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}

    def step() -> None:
        if pipelined:
            accelerator.forward_backward(model, batch)
        else:
            accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        step()
    base = private_mib()
    threading.Thread(target=sample, daemon=True).start()
    times = []
    for _ in range(args.steps):
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    out = torch.tensor([statistics.median(times), peak["anon"] - base])
    if pipelined:
        gathered = [torch.zeros(2) for _ in range(accelerator.num_processes)]
        torch.distributed.all_gather(gathered, out)
    else:
        gathered = [out]
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({"step_s": max(float(g[0]) for g in gathered),
                                              "step_mib": [round(float(g[1]), 1) for g in gathered]}))
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs of every setting, in turn")
    parser.add_argument("--json")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    from hf_backend.strategies.pipeline import bubble_fraction

    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # the settings in turn, A B C D A B C D
            for name, schedule in SETTINGS.items():
                out = Path(tmp) / "r.json"
                rank = [str(HERE), "--rank", "--out", str(out), "--steps", str(args.steps), "--microbatches",
                        str(args.microbatches)] + (["--schedule", schedule] if schedule else [])
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *rank] if schedule else [sys.executable, *rank]
                subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
                runs[name].append(json.loads(out.read_text()))
    step = {name: statistics.median(r["step_s"] for r in rs) for name, rs in runs.items()}
    one = step["one process"]
    print(f"| setting | step (s), median of {args.repeats} runs (range) | x one process | lost to the ideal (one "
          f"process / 2) | schedule's bubble | step memory per rank (MiB) |\n|---|---|---|---|---|---|")
    for name, schedule in SETTINGS.items():
        times = [r["step_s"] for r in runs[name]]
        lost = f"{1 - one / 2 / step[name]:.0%}" if schedule else "-"
        bubble = f"{bubble_fraction(schedule, 2, args.microbatches, 2):.0%}" if schedule else "-"
        print(f"| {name} | {step[name]:.3f} ({min(times):.3f}-{max(times):.3f}) | {step[name] / one:.2f} | {lost} | "
              f"{bubble} | {', '.join(map(str, runs[name][-1]['step_mib']))} |")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
