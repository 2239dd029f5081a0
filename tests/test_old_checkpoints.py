"""Checkpoints written by an earlier hf_backend (tests/fixtures/checkpoints_v1, made by tests/scripts/old_checkpoints.py
at commit 129f7ee) load with today's code, and a run resumed from them sees exactly what the saving run saw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_report

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints_v1"


@pytest.mark.parametrize("kind, nproc", [("single", 1), ("fsdp", 1), ("deepspeed", 2)])
def test_checkpoint_of_an_earlier_version_loads(tmp_path, kind, nproc):
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
    expected = json.loads((FIXTURES / kind / "expected.json").read_text())
    seen = run_report("old_checkpoints.py", tmp_path / "seen.json",
                      ["check", "--kind", kind, "--dir", str(FIXTURES / kind)], nproc=nproc)
    assert seen == expected
