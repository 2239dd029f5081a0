"""torch.compile on the engine, one process on the CPU: a Llama trained by an hf_backend.Accelerator loop eagerly,
compiled whole and compiled by regions (`TorchDynamoPlugin(use_regional_compilation=True)`), with inductor. Each
variant runs in a fresh process with inductor's caches off (so the first step pays the whole compilation), the
variants taking turns, repeat after repeat. Reports the first step's seconds (compilation included) and the median
step after it, against eager.

    .venv/bin/python benchmarks/compile.py [--model tiny|bench] [--repeats 2] [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# tiny: tests/test_compile.py's (2 layers, hidden 32, 8 x 16 tokens); bench: 4 layers, hidden 256, 8 x 128 tokens
MODELS = {"tiny": {"layers": 2, "hidden": 32, "batch": 8, "seq": 16},
          "bench": {"layers": 4, "hidden": 256, "batch": 8, "seq": 128}}
VARIANTS = ("eager", "whole", "regional")


def one_run(model_name: str, variant: str, steps: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_backend import Accelerator
    from hf_backend.utils import TorchDynamoPlugin

    size = MODELS[model_name]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=size["hidden"], intermediate_size=2 * size["hidden"],
        num_hidden_layers=size["layers"], num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        use_cache=False))
    plugin = None if variant == "eager" else TorchDynamoPlugin(
        backend="inductor", use_regional_compilation=variant == "regional")
    accelerator = Accelerator(cpu=True, dynamo_plugin=plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 512, (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(1))
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
    return {"first": seconds[0], "step": statistics.median(seconds[1:])}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bench", choices=list(MODELS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one run, in the child process
    args = p.parse_args()
    if args.variant:
        print(json.dumps(one_run(args.model, args.variant, args.steps)))
        return 0
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                                  "--variant", variant], env=env, capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    eager = statistics.median(r["step"] for r in runs["eager"])
    rows = {}
    print(f"{args.model}: {MODELS[args.model]}, {args.repeats} repeats of {args.steps} steps, threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'all')}")
    print(f"{'variant':10} {'first step s':>13} {'step ms':>9} {'speed vs eager':>15}")
    for variant, results in runs.items():
        first, step = statistics.median(r["first"] for r in results), statistics.median(r["step"] for r in results)
        rows[variant] = {"first_step_s": first, "step_ms": step * 1e3, "speed_vs_eager": eager / step}
        print(f"{variant:10} {first:13.1f} {step * 1e3:9.1f} {eager / step:14.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "size": MODELS[args.model], "runs": runs, "summary": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
