"""The torch window (hf_backend/core/torch_window.py): pyproject.toml's requirement, one line at import outside it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_backend.core import torch_window


def test_pyproject_requires_the_tested_window():
    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    (low, high), = re.findall(r'"torch>=([\d.]+),<([\d.]+)"', text)
    oldest, newest = torch_window.OLDEST, torch_window.NEWEST
    assert (low, high) == (f"{oldest[0]}.{oldest[1]}", f"{newest[0]}.{newest[1] + 1}")


def test_an_older_torch_is_one_line_and_a_newer_one_a_warning(caplog):
    torch_window.check("2.13.0+cpu")
    torch_window.check("2.15.0+cu132")
    with pytest.raises(ImportError, match=r"^hf_backend needs torch 2\.13 to 2\.15 .* you have 2\.12\.1: "
                                          r"pip install 'torch>=2\.13,<2\.16'$"):
        torch_window.check("2.12.1")
    with caplog.at_level("WARNING"):
        torch_window.check("2.16.0")
    assert "the engine is tested with torch 2.13 to 2.15; you have 2.16.0" in caplog.text


def test_the_engine_checks_at_import():
    """`import hf_backend.accelerator` under a torch that says it is 2.12: the one line, before any strategy."""
    code = "import torch; torch.__version__ = '2.12.0'\nimport hf_backend.accelerator"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("ImportError: hf_backend needs torch 2.13 to 2.15"), \
        proc.stderr[-2000:]
