"""The install a user gets, tested: `make test-install` (and .ci/run) builds a clean virtualenv, runs in it the
`pip install` lines of the README's Install section and nothing else (so no accelerate, and whatever transformers pip
picks within pyproject's range), then trains there:

- tests/install/trainer_check.py: hf_backend.Trainer, in one process, in two (DDP) and two under FSDP, each with a
  checkpoint resumed to the same weights;
- tests/scripts/tutorial_loop.py: Accelerate's tutorial loop with its imports changed, in one and two processes,
  and in two stopped after 5 steps and resumed from `save_state`, to the same weights;
- `TrainingArguments(deepspeed=...)`, which needs accelerate through transformers: refused in one line.

Run with any Python 3: `python3 tests/install/check.py --venv .venv-install` (the virtualenv must exist and be empty).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"


def readme_install_lines(readme: Path = ROOT / "README.md") -> list[list[str]]:
    """The `pip install` commands of the README's Install section, as argument lists (comments dropped)."""
    section = readme.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    if block is None:
        raise SystemExit("README.md: the Install section has no ```bash block")
    commands = [shlex.split(line, comments=True) for line in block.group(1).splitlines()]
    found = [c for c in commands if c[:2] == ["pip", "install"]]
    if not found:
        raise SystemExit("README.md: the Install section's block has no `pip install` line")
    return found


def run(command: list[str], what: str, cwd: Path = ROOT, show: bool = True) -> str:
    if show:
        print(f"[install check] {what}: {' '.join(command)}", flush=True)
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.stdout.write(done.stdout[-4000:])
        sys.stderr.write(done.stderr[-8000:])
        raise SystemExit(f"[install check] FAILED: {what} exited {done.returncode}")
    last = done.stdout.strip().splitlines()[-1:]
    if show and last:
        print(f"    {last[0]}", flush=True)
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", required=True, type=Path)
    venv = parser.parse_args().venv.resolve()
    python, launcher = str(venv / "bin" / "python"), str(venv / "bin" / "hf-backend")
    for command in readme_install_lines():
        run([python, "-m", *command], "README install line")

    versions = json.loads(run([python, "-c", _VERSIONS], "installed versions", show=False).strip().splitlines()[-1])
    print(f"[install check] installed: {versions}", flush=True)
    if versions["accelerate"] is not None:
        raise SystemExit(f"[install check] FAILED: the README's lines installed accelerate {versions['accelerate']}; "
                         "the check is meant to run without it")

    refusal = subprocess.run([python, "-c", _DEEPSPEED_WITHOUT_ACCELERATE], capture_output=True, text=True, timeout=300)
    if refusal.returncode == 0 or "pip install 'hf-backend[deepspeed]'" not in refusal.stderr.splitlines()[-1]:
        raise SystemExit("[install check] FAILED: TrainingArguments(deepspeed=...) without accelerate is not the "
                         f"one-line refusal:\n{refusal.stderr[-3000:]}")
    print(f"[install check] DeepSpeed without accelerate: {refusal.stderr.splitlines()[-1]}", flush=True)

    with tempfile.TemporaryDirectory(prefix="install-check-") as tmp:
        work = Path(tmp)
        trainer = str(ROOT / "tests" / "install" / "trainer_check.py")
        run([python, trainer, str(work / "t1")], "Trainer, 1 process")
        run([launcher, "launch", "--cpu", "--num_processes", "2", trainer, str(work / "t2")], "Trainer, 2 processes")
        run([launcher, "launch", "--cpu", "--num_processes", "2", trainer, str(work / "t3"), "--fsdp"],
            "Trainer, 2 processes, FSDP")

        loop = str(SCRIPTS / "tutorial_loop.py")
        reports = {}
        for name, nproc, extra in (("one", 1, []), ("two", 2, []),
                                   ("stop", 2, ["--stop-after", "5", "--checkpoint", str(work / "ckpt")]),
                                   ("resumed", 2, ["--resume", "--checkpoint", str(work / "ckpt")])):
            out = work / f"{name}.json"
            prefix = [python] if nproc == 1 else [launcher, "launch", "--cpu", "--num_processes", str(nproc)]
            run([*prefix, loop, "--out", str(out), *extra], f"Accelerate loop ({name}), {nproc} process(es)")
            reports[name] = json.loads(out.read_text())
    _check_loops(reports)
    print(f"[install check] passed: transformers {versions['transformers']}, torch {versions['torch']}, no accelerate",
          flush=True)
    return 0


def _check_loops(reports: dict) -> None:
    one, two, resumed = reports["one"], reports["two"], reports["resumed"]
    problems = []
    if (one["world"], two["world"]) != (1, 2):
        problems.append(f"world sizes {one['world']} and {two['world']}, expected 1 and 2")
    if not (two["ranks_agree"] and resumed["ranks_agree"]):
        problems.append("the two processes' weights differ after a step")
    if resumed["params"] != two["params"]:
        problems.append("the resumed run ended with other weights than the uninterrupted one")
    if problems:
        raise SystemExit("[install check] FAILED: Accelerate loop: " + "; ".join(problems))
    print(f"[install check] Accelerate loop: 1 and 2 processes, {len(two['losses'])} steps, resumed run equal",
          flush=True)


_DEEPSPEED_WITHOUT_ACCELERATE = """
from hf_backend import TrainingArguments
TrainingArguments(output_dir="unused", deepspeed={"zero_optimization": {"stage": 2}}, report_to="none")
"""

_VERSIONS = """
import importlib.metadata as m, json
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(json.dumps({name: version(name) for name in ("torch", "transformers", "accelerate", "hf-backend")}))
"""

if __name__ == "__main__":
    sys.exit(main())
