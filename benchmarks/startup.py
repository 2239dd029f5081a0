"""Start-up (issue 22): `hf-backend launch` against bare torchrun, to the end of the first optimizer step.

One tiny DDP training script (this file with `--worker`: an MLP 32-64-2, AdamW, an in-memory TensorDataset, all
through `hf_backend.Accelerator`, `--steps` optimizer steps) is started on 2 CPU processes, in pairs that take turns
(which variant goes first alternates from pair to pair):

- launcher: `python -m hf_backend.cli.main launch --cpu --num_processes 2 startup.py --worker ...`
  (what the `hf-backend` console script runs);
- torchrun: `python -m torch.distributed.run --standalone --nproc_per_node 2 startup.py --worker ...`
  (the same script: under torchrun the Accelerator reads torch elastic's variables and trains DDP over gloo too).

The driver takes `time.time()` just before it starts the launch's subprocess and hands it nothing else; rank 0 of
the script writes `time.time()` when it starts (after its standard-library imports), when torch and hf_backend are
imported, when `prepare` has returned, when its first optimizer step has returned and when `end_training` has.
Reports per variant the median over pairs of each of those (seconds from the launch) and of the whole launch's wall
time (until the launch process has exited), and the launcher / torchrun ratio of the first-step times, per pair and
their median.

Both get the same environment: OMP_NUM_THREADS set by the driver (default: the cores divided by the processes,
what `hf-backend launch` would pick; torchrun alone would pick 1), no HF_BACKEND_* or torch elastic variables, and
an empty HF_HOME (so the launcher finds no default config file). The launcher also sets HF_BACKEND_USE_CPU and the
distributed type in the workers' environment; the script checks that both variants train DDP on 2 processes.

    .venv/bin/python benchmarks/startup.py [--pairs 5] [--steps 3] [--threads N] [--json out.json]
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

VARIANTS = ("launcher", "torchrun")
STAMPS = ("script_start", "imported", "prepared", "first_step", "ended")
NPROC = 2


def _worker(out: Path, steps: int) -> None:
    """The training script: rank 0 writes its timestamps (time.time(), comparable across processes) to `out`."""
    stamps = {"script_start": time.time()}
    import torch

    from hf_backend import Accelerator

    stamps["imported"] = time.time()
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randint(0, 2, (256,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    stamps["prepared"] = time.time()
    for step, (inputs, labels) in enumerate(loader):
        accelerator.backward(torch.nn.functional.cross_entropy(model(inputs), labels))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            stamps["first_step"] = time.time()
        if step + 1 == steps:
            break
    distributed_type, num_processes = str(accelerator.distributed_type), accelerator.num_processes
    accelerator.end_training()
    stamps["ended"] = time.time()
    if accelerator.is_main_process:
        out.write_text(json.dumps({**stamps, "distributed_type": distributed_type, "num_processes": num_processes}))


def _command(variant: str, out: Path, steps: int) -> list[str]:
    script = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--steps", str(steps)]
    if variant == "launcher":
        return [sys.executable, "-m", "hf_backend.cli.main", "launch", "--cpu", "--num_processes", str(NPROC), *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC), *script]


def _environment(threads: int, hf_home: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_BACKEND_", "TORCHELASTIC_")) and k not in drop}
    return {**env, "OMP_NUM_THREADS": str(threads), "HF_HOME": hf_home}


def _run(variant: str, steps: int, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stamps.json"
        command = _command(variant, out, steps)
        start = time.time()
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp)
        wall = time.time() - start
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"{variant} failed (exit code {proc.returncode}):\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
    if data["num_processes"] != NPROC or "MULTI_CPU" not in data["distributed_type"]:
        raise SystemExit(f"{variant}: trained {data['distributed_type']} on {data['num_processes']} processes, "
                         f"not DDP on {NPROC}")
    return {**{name: data[name] - start for name in STAMPS}, "wall": wall}


def _table(results: dict) -> None:
    runs, medians = results["runs"], results["medians"]
    print(f"\n{results['pairs']} pairs, {NPROC} processes, OMP_NUM_THREADS={results['threads']}, "
          f"{results['machine']}; medians, seconds from the launch")
    print(f"{'variant':<10}" + "".join(f"{name:>14}" for name in (*STAMPS, "wall")))
    for variant in VARIANTS:
        print(f"{variant:<10}" + "".join(f"{medians[variant][name]:>14.2f}" for name in (*STAMPS, "wall")))
    print(f"\nfirst step, launcher / torchrun: ratio of the medians {results['ratio_of_medians']:.3f}, "
          f"median of the pairs' ratios {results['median_pair_ratio']:.3f}")
    print(f"{'pair':<6}{'first':>10}{'launcher':>10}{'torchrun':>10}{'ratio':>8}{'wall l':>9}{'wall t':>9}")
    for i, (a, b) in enumerate(zip(runs["launcher"], runs["torchrun"])):
        first = VARIANTS[i % 2]
        print(f"{i + 1:<6}{first:>10}{a['first_step']:>10.2f}{b['first_step']:>10.2f}"
              f"{a['first_step'] / b['first_step']:>8.3f}{a['wall']:>9.2f}{b['wall']:>9.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=5, help="launches of each variant, in turns")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps the script trains")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // NPROC),
                   help="OMP_NUM_THREADS for both variants")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(Path(args.out), args.steps)
        return 0

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as hf_home:
        env = _environment(args.threads, hf_home)
        for i in range(args.pairs):
            for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                runs[variant].append(_run(variant, args.steps, env))
    medians = {v: {name: statistics.median(r[name] for r in runs[v]) for name in (*STAMPS, "wall")} for v in VARIANTS}
    pair_ratios = [a["first_step"] / b["first_step"] for a, b in zip(runs["launcher"], runs["torchrun"])]
    import torch  # only for the version in the results

    results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
               "pairs": args.pairs, "steps": args.steps, "threads": args.threads, "medians": medians,
               "ratio_of_medians": medians["launcher"]["first_step"] / medians["torchrun"]["first_step"],
               "median_pair_ratio": statistics.median(pair_ratios), "pair_ratios": pair_ratios, "runs": runs}
    _table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
