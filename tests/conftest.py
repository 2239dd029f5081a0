"""Shared helpers: run a script in one process or under torchrun with 2 gloo processes, and read its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(script: str, args: list[str], nproc: int = 1, timeout: int = 240,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run tests/scripts/<script> and fail with its output when it fails."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(SCRIPTS / script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(name, None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_report(script: str, out: Path, args: list[str], nproc: int = 1, **kw) -> dict:
    run_script(script, ["--out", str(out), *args], nproc=nproc, **kw)
    return json.loads(out.read_text())


# The BERT-shaped loop shared by the FSDP and DeepSpeed tests: 32 optimizer steps with accumulation and clipping.
BERT_LOOP = "bert_loop.py"
BERT_TRAIN = ["--batch-size", "4", "--grad-accum", "2", "--epochs", "2"]


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@pytest.fixture(scope="session")
def bert_ddp(tmp_path_factory) -> dict:
    """The DDP run every sharded strategy is compared with (run once per test session)."""
    return run_report(BERT_LOOP, tmp_path_factory.mktemp("bert_ddp") / "r.json", BERT_TRAIN, nproc=2)
