"""Run Accelerate's published example scripts, offline, on Accelerate itself or on hf_backend, and report metrics.

    .venv/bin/python benchmarks/accelerate_examples/run.py --examples /tmp/acc_ex --stack accelerate
    .venv/bin/python benchmarks/accelerate_examples/run.py --examples /tmp/acc_ex --stack hf_backend --processes 2 \
        --baseline benchmarks/results/accelerate_examples/accelerate_1p.json

For hf_backend each script is copied with only its `accelerate` import lines rewritten; for accelerate it runs as
published. offline/sitecustomize.py (put first on PYTHONPATH) swaps the Hub's MRPC, bert-base-cased and GLUE
metric for local ones. See README.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OFFLINE_DIR = HERE / "offline"
DEFAULT_RESULTS = REPO / "benchmarks" / "results" / "accelerate_examples"


@dataclass(frozen=True)
class Run:
    """One invocation of a script: `{work}` in args and expect is the shared work directory of this session."""

    script: str
    label: str
    args: tuple[str, ...] = ()
    expect: str | None = None  # a path (glob) under the work directory that must exist after the run


RUNS: tuple[Run, ...] = (
    Run("nlp_example", "nlp_example"),
    # batch size 256 never OOMs on CPU, so find_executable_batch_size keeps it (gradient accumulation 1)
    Run("automatic_gradient_accumulation", "automatic_gradient_accumulation"),
    Run("checkpointing", "checkpointing", ("--checkpointing_steps", "epoch", "--output_dir", "{work}/ckpt_epoch"),
        "ckpt_epoch/epoch_2"),
    Run("checkpointing", "checkpointing:resume_epoch",
        ("--resume_from_checkpoint", "{work}/ckpt_epoch/epoch_0", "--output_dir", "{work}/ckpt_epoch")),
    Run("checkpointing", "checkpointing:steps", ("--checkpointing_steps", "15", "--output_dir", "{work}/ckpt_steps"),
        "ckpt_steps/step_15"),
    Run("checkpointing", "checkpointing:resume_step",  # mid-epoch: skip_first_batches
        ("--resume_from_checkpoint", "{work}/ckpt_steps/step_15", "--output_dir", "{work}/ckpt_steps")),
    Run("cross_validation", "cross_validation", ("--num_folds", "3")),
    Run("early_stopping", "early_stopping"),
    Run("gradient_accumulation", "gradient_accumulation", ("--gradient_accumulation_steps", "2")),
    Run("local_sgd", "local_sgd", ("--local_sgd_steps", "4")),
    Run("memory", "memory"),
    Run("multi_process_metrics", "multi_process_metrics"),
    Run("tracking", "tracking", ("--with_tracking", "--project_dir", "{work}/logs"),
        "logs/**/events.out.tfevents.*"),
)

IMPORT_LINE = re.compile(r"^(\s*)(from\s+accelerate(?=[\s.])|import\s+accelerate\b)")
METRIC_LINE = re.compile(r"^(epoch \d+|Average test metrics from all folds):\s*(\{.*\})\s*$")
ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt)|error:|.*\brank \d+\b.*(fail|error))",
                        re.IGNORECASE)


@dataclass
class Result:
    """What one run did; `metrics` is the last `epoch N: {...}` line, `test` cross_validation's fold average."""

    script: str
    label: str
    ok: bool
    returncode: int | None
    wall_s: float
    metrics: dict | None = None
    test: dict | None = None
    epochs: list[dict] = field(default_factory=list)
    error: str | None = None
    log: str = ""


def port_script(source: str) -> tuple[str, int]:
    """`from accelerate...` / `import accelerate` lines -> hf_backend; nothing else changes. Returns (text, count)."""
    out, count = [], 0
    for line in source.splitlines(keepends=True):
        match = IMPORT_LINE.match(line)
        if match:
            indent, head = match.groups()
            if head.startswith("from"):
                line = indent + "from hf_backend" + line[match.end():]
            else:  # `import accelerate[.x]` still binds the name `accelerate`
                rest = line[match.end():]
                line = indent + ("import hf_backend" + rest if " as " in rest else
                                 f"import hf_backend{rest.rstrip()}; import hf_backend as accelerate\n")
            count += 1
        out.append(line)
    return "".join(out), count


def child_env(train: int, eval_: int, threads: int, seedable: bool = False) -> dict[str, str]:
    """Offline, with sitecustomize first on PYTHONPATH (the caller's PYTHONPATH kept after it)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HFB_EXAMPLES_SEEDABLE="1" if seedable else "0")
    env.pop("TESTING_MOCKED_DATALOADERS", None)  # the scripts' test hook would swap in Accelerate's own test data
    env.update(TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HFB_EXAMPLES_TRAIN=str(train), HFB_EXAMPLES_EVAL=str(eval_), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(OFFLINE_DIR), env.get("PYTHONPATH")) if p)
    return env


def parse_output(text: str) -> tuple[list[dict], dict | None]:
    """The per-epoch metric dicts and the cross-validation test dict printed by the scripts."""
    epochs, test = [], None
    for line in text.splitlines():
        match = METRIC_LINE.match(line.strip())
        if not match:
            continue
        try:
            value = ast.literal_eval(match.group(2))
        except (ValueError, SyntaxError):
            continue
        if match.group(1).startswith("epoch"):
            epochs.append(value)
        else:
            test = value
    return epochs, test


def last_error(text: str) -> str | None:
    """The last line that looks like an error (a traceback's final line), else the last non-empty line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return (errors or lines or [None])[-1]


def run_one(run: Run, script: Path, args: argparse.Namespace, work: Path, logs: Path) -> Result:
    """Runs one invocation, with its stdout and stderr in logs/<label>.{out,err}."""
    extra = [a.replace("{work}", str(work)) for a in run.args]
    if args.processes == 1:
        command = [sys.executable, str(script), "--cpu", *extra]
    else:
        launcher = shutil.which("hf-backend", path=str(Path(sys.executable).parent)) or "hf-backend"
        command = [launcher, "launch", "--cpu", "--num_processes", str(args.processes), str(script), "--cpu", *extra]
    stem = run.label.replace(":", "-")
    out_path, err_path = logs / f"{stem}.out", logs / f"{stem}.err"
    start = time.perf_counter()
    with out_path.open("w") as out, err_path.open("w") as err:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        try:
            env = child_env(args.train, args.eval, args.threads, args.seedable)
            proc = subprocess.run(command, cwd=work, env=env, stdout=out, stderr=err, timeout=args.timeout,
                                  start_new_session=True)
            returncode: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    wall = time.perf_counter() - start
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    epochs, test = parse_output(stdout)
    ok, error = returncode == 0, None
    if returncode is None:
        error = f"timed out after {args.timeout} s"
    elif returncode != 0:
        error = last_error(stderr) or last_error(stdout)
    elif not epochs:
        ok, error = False, "exit 0 but no `epoch N: {...}` metric line"
    elif run.expect and not list(work.glob(run.expect)):
        ok, error = False, f"exit 0 but {run.expect} was not written"
    return Result(run.script, run.label, ok, returncode, round(wall, 1), epochs[-1] if epochs else None, test,
                  epochs, error, str(out_path))


def fmt(metrics: dict | None, key: str) -> str:
    return f"{metrics[key]:.4f}" if metrics and key in metrics else "-"


def table(results: list[Result], baseline: dict[str, dict]) -> str:
    """A markdown table; with a baseline, its accuracy/F1 for the same run label beside ours."""
    head = "| run | ok | exit | accuracy | f1 | wall s |"
    if baseline:
        head += " baseline acc | baseline f1 |"
    lines = [head + " error |", "|" + "---|" * (head.count("|"))]
    for r in results:
        metrics = r.test or r.metrics
        row = f"| {r.label} | {'ok' if r.ok else 'FAIL'} | {r.returncode} | {fmt(metrics, 'accuracy')} | " \
              f"{fmt(metrics, 'f1')} | {r.wall_s} |"
        if baseline:
            base = baseline.get(r.label, {})
            row += f" {fmt(base, 'accuracy')} | {fmt(base, 'f1')} |"
        error = (r.error or "").replace("|", "\\|")
        lines.append(row + f" {error[:160]} |")
    return "\n".join(lines)


def load_baseline(path: Path | None) -> dict[str, dict]:
    """label -> the metrics shown for it (cross_validation: the fold-average test metrics)."""
    if path is None:
        return {}
    data = json.loads(path.read_text())
    return {r["label"]: r.get("test") or r.get("metrics") or {} for r in data["results"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=Path, required=True, help="folder with the exported example scripts")
    parser.add_argument("--stack", choices=("accelerate", "hf_backend"), default="hf_backend")
    parser.add_argument("--processes", type=int, choices=(1, 2), default=1,
                        help="2: `hf-backend launch --cpu --num_processes 2` (hf_backend only)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="script names (all runs of each) or run labels")
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/accelerate_examples/"
                                                 "<stack>_<n>p.json); logs go to <out stem>_logs/")
    parser.add_argument("--baseline", type=Path, help="a results JSON to show beside these (e.g. accelerate's)")
    parser.add_argument("--train", type=int, default=int(os.environ.get("HFB_EXAMPLES_TRAIN", "320")),
                        help="first N MRPC train rows")
    parser.add_argument("--eval", type=int, default=int(os.environ.get("HFB_EXAMPLES_EVAL", "160")),
                        help="first M MRPC validation rows")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of each process (default: $OMP_NUM_THREADS, "
                        "else CPUs / processes); on a busy machine 1 is much faster than oversubscribing")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (checkpoints, logs)")
    parser.add_argument("--seedable", action="store_true",
                        help="accelerate only: DataLoaderConfiguration(use_seedable_sampler=True) by default, the "
                             "epoch order hf_backend always uses (seed + epoch), so both engines see the same batches")
    args = parser.parse_args()
    if args.stack == "accelerate" and args.processes != 1:
        parser.error("--processes 2 is for hf_backend (Accelerate's launcher starts one process on CPU)")
    if args.seedable and args.stack != "accelerate":
        parser.error("--seedable is for --stack accelerate (hf_backend's order is always seedable)")
    if args.threads is None:
        args.threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // args.processes))
    runs = [r for r in RUNS if not args.only or r.script in args.only or r.label in args.only]
    unknown = set(args.only or ()) - {r.script for r in RUNS} - {r.label for r in RUNS}
    if unknown or not runs:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {sorted({r.script for r in RUNS})}")
    missing = [r.script for r in runs if not (args.examples / f"{r.script}.py").is_file()]
    if missing:
        parser.error(f"--examples {args.examples}: missing {', '.join(sorted(set(missing)))}.py (see README.md)")
    out = args.out or DEFAULT_RESULTS / f"{args.stack}{'_seedable' if args.seedable else ''}_{args.processes}p.json"
    logs = out.with_name(out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)

    work = Path(tempfile.mkdtemp(prefix=f"acc_examples_{args.stack}_"))
    results: list[Result] = []
    ported: dict[str, int] = {}
    try:
        for run in runs:
            script = (args.examples / f"{run.script}.py").resolve()
            if args.stack == "hf_backend":
                text, ported[run.script] = port_script(script.read_text())
                (work / "scripts").mkdir(exist_ok=True)
                script = work / "scripts" / script.name
                script.write_text(text)
            print(f"[{run.label}] ...", flush=True)
            result = run_one(run, script, args, work, logs)
            results.append(result)
            status = "ok" if result.ok else f"FAIL ({result.error})"
            print(f"[{run.label}] {status} in {result.wall_s} s: {result.test or result.metrics}", flush=True)
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    report = {"stack": args.stack, "processes": args.processes, "train_rows": args.train, "eval_rows": args.eval,
              "omp_num_threads": args.threads,
              "examples": str(args.examples.resolve()), "python": platform.python_version(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "ported_import_lines": ported,
              "results": [asdict(r) for r in results]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table(results, load_baseline(args.baseline)))
    print(f"\n{sum(r.ok for r in results)}/{len(results)} ok; results: {out}; logs: {logs}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
