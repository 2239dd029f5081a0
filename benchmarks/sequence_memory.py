"""Memory per rank of one training step on long sequences (issue 44): one process, sp 2, cp 2, sp 4 and cp 4, a Llama
from a config (hidden 256, 8 heads, 2 layers, vocabulary 1024, fp32), batch 1, AdamW, through an Accelerator loop
that calls the model inside `maybe_context_parallel`.

One launch per setting. At each length in turn (shortest first) each rank trains one step to warm up (weights, gradients
and optimizer state exist after it), then a second step, and reports the peak of private memory (`RssAnon`, sampled
every 2 ms by a thread of this script) above what it held just before the second step: the step's activations,
attention's working memory, the communication buffers and the gradients made again. glibc's mmap threshold is fixed
(`mallopt`) so that freed memory is returned at once. The largest rank's figure is reported, beside `hf-backend plan`'s
activation estimate for the same run (plan/memory.py). With the step's memory linear in the length (SDPA's fused causal
kernel, the ring's chunk pairs, Ulysses' head groups), the longest sequence that fits a budget follows from two lengths:
(budget - intercept) / slope, rounded down to a multiple of 1024 tokens.

    .venv/bin/python benchmarks/sequence_memory.py [--lengths 8192,16384] [--budget-gib 2] [--json out.json]
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
SETTINGS = {"one process": {}, "sp 2": {"sp_size": 2}, "cp 2": {"cp_size": 2}, "sp 4": {"sp_size": 4},
            "cp 4": {"cp_size": 4}}
CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=8, max_position_embeddings=65536, use_cache=False)


# -- one rank (run under torch.distributed.run, or alone) -------------------------------------------------------------
def rank_main(args: argparse.Namespace) -> None:
    import ctypes
    import threading
    import time

    if not ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024):  # M_MMAP_THRESHOLD: large frees return at once
        raise SystemExit("mallopt(M_MMAP_THRESHOLD) failed")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_backend import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    def private_mib() -> float:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(fields["RssAnon"].split()[0]) / 1024

    peak = {"anon": 0.0}

    def sample() -> None:  # a daemon thread of this measuring script, not of the library
        while True:
            peak["anon"] = max(peak["anon"], private_mib())
            time.sleep(0.002)

    sizes = json.loads(args.sizes)
    kwargs = {}
    if sizes:
        kwargs = {"parallelism_config": ParallelismConfig(**sizes),
                  "fsdp_plugin": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])}
    accelerator = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(length: int) -> None:
        ids = torch.randint(0, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        positions = torch.arange(length)[None]
        with accelerator.maybe_context_parallel(buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1]):
            loss = model(input_ids=ids, labels=labels, shift_labels=labels, position_ids=positions).loss
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    threading.Thread(target=sample, daemon=True).start()
    report = {}
    for length in map(int, args.lengths.split(",")):  # at each length: one step warms up, the next is measured
        step(length)
        before = private_mib()
        peak["anon"] = before
        started = time.perf_counter()
        step(length)
        seconds = time.perf_counter() - started
        time.sleep(0.01)
        report[str(length)] = {"step_mib": peak["anon"] - before, "held_mib": before, "seconds": seconds}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.end_training()


# -- the driver -------------------------------------------------------------------------------------------------------
def planned_mib(setting: str, length: int) -> float:
    """`hf-backend plan`'s activation estimate per rank for the setting (the model built on the meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_backend.parallel.dims import MeshShape
    from hf_backend.plan.memory import plan_memory

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    sizes = {name.removesuffix("_size"): size for name, size in SETTINGS[setting].items()}
    shape = MeshShape(**sizes)
    plan = plan_memory(model, "fsdp" if sizes else "no", shape.world, shape=shape if sizes else None,
                       sequence_length=length)
    return plan.activation_bytes / 2**20


def measure(setting: str, lengths: list[int], work: Path) -> dict:
    """One launch per setting: its ranks train at every length in turn and report each length's step."""
    sizes = SETTINGS[setting]
    nproc = max([1, *sizes.values()])
    out = work / setting.replace(" ", "")
    command = [sys.executable, str(HERE), "--rank", "--lengths", ",".join(map(str, sorted(lengths))), "--sizes",
               json.dumps(sizes), "--out", str(out)]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   *command[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {str(n): {key: max(r[str(n)][key] for r in ranks) for key in ("step_mib", "held_mib", "seconds")}
            for n in lengths}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="{}")
    p.add_argument("--out", default=None)
    p.add_argument("--lengths", default="8192,16384", help="two or more sequence lengths, comma-separated")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--budget-gib", type=float, default=2.0, help="the step's memory per rank the fit is read at")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.rank:
        rank_main(args)
        return 0
    lengths = [int(n) for n in args.lengths.split(",")]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as work:
        for setting in args.settings.split(","):
            results[setting] = measure(setting, lengths, Path(work))
    one = results.get("one process")
    budget = args.budget_gib * 1024
    first_length = lengths[0]
    print(f"| setting | {' | '.join(f'step memory at {n} tokens (MiB)' for n in lengths)} | plan's estimate at "
          f"{first_length} | x one process at {first_length} | longest in {args.budget_gib:g} GiB | step at "
          f"{first_length} (s) |")
    print("|---" * (len(lengths) + 5) + "|")
    for setting, by_length in results.items():
        first, last = by_length[str(lengths[0])], by_length[str(lengths[-1])]
        slope = (last["step_mib"] - first["step_mib"]) / (lengths[-1] - lengths[0])
        intercept = first["step_mib"] - slope * lengths[0]
        longest = int((budget - intercept) / slope) // 1024 * 1024 if slope > 0 else 0
        ratio = first["step_mib"] / one[str(lengths[0])]["step_mib"] if one else float("nan")
        planned = planned_mib(setting, lengths[0])
        results[setting].update(longest_in_budget=longest, planned_mib=planned)
        cells = " | ".join(f"{by_length[str(n)]['step_mib']:.0f}" for n in lengths)
        print(f"| {setting} | {cells} | {planned:.0f} | {ratio:.2f} | {longest} | {first['seconds']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
