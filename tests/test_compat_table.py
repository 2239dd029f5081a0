"""docs/compat.md against the installed Accelerate: every public name it has is in the table, and the table's word
for each (same / no-op / refused) is what hf_backend does."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_backend
import hf_backend.utils
from hf_backend import Accelerator
from hf_backend.core.errors import HfBackendError

TABLE = Path(__file__).resolve().parents[1] / "docs" / "compat.md"
SECTIONS = {"## `Accelerator` members": "Accelerator", "## Names in `accelerate` (top level)": "accelerate",
            "## Names in `accelerate.utils`": "accelerate.utils"}

# Accelerate's public names, listed in a child process (building its Accelerator sets up its own global state).
_LIST = """
import json, types, accelerate, accelerate.utils as u
acc = accelerate.Accelerator(cpu=True)
print(json.dumps({
    "Accelerator": sorted({n for n in dir(accelerate.Accelerator) if not n.startswith("_")}
                          | {n for n in vars(acc) if not n.startswith("_")}),
    "accelerate": sorted(n for n in dir(accelerate) if not n.startswith("_")),
    "accelerate.utils": sorted(n for n in dir(u) if not n.startswith("_")
                               and not isinstance(getattr(u, n), types.ModuleType)),
}))
"""


def _table() -> dict[str, dict[str, str]]:
    table: dict[str, dict[str, str]] = {scope: {} for scope in SECTIONS.values()}
    scope = None
    for line in TABLE.read_text().splitlines():
        heading = next((s for h, s in SECTIONS.items() if line.startswith(h)), None)
        if heading or line.startswith("## "):
            scope = heading
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if scope is None or len(cells) < 2 or cells[1] not in ("same", "no-op", "refused"):
            continue
        for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cells[0]):
            assert name not in table[scope], f"{name} is listed twice under {scope}"
            table[scope][name] = cells[1]
    return table


@pytest.fixture(scope="module")
def accelerate_names() -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", _LIST], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def accelerator() -> Accelerator:
    return Accelerator()


def test_every_public_accelerate_name_is_in_the_table(accelerate_names):
    table = _table()
    for scope, names in accelerate_names.items():
        missing = sorted(set(names) - set(table[scope]))
        assert not missing, f"docs/compat.md lacks these {scope} names: {missing}"


def _lookup(scope: str, name: str, accelerator: Accelerator) -> object:
    if scope == "Accelerator":
        return getattr(accelerator, name)
    module = hf_backend if scope == "accelerate" else hf_backend.utils
    try:
        return getattr(module, name)
    except AttributeError:
        if scope == "accelerate":
            return importlib.import_module(f"hf_backend.{name}")
        raise


def test_the_table_says_what_hf_backend_does(accelerator):
    wrong = []
    for scope, rows in _table().items():
        for name, status in rows.items():
            try:
                value = _lookup(scope, name, accelerator)
            except HfBackendError as err:
                if status != "refused" or "\n" in str(err):
                    wrong.append(f"{scope}.{name}: table says {status}, access raised {err}")
                continue
            except Exception as err:  # noqa: BLE001 - anything else is a wrong row
                wrong.append(f"{scope}.{name}: table says {status}, access raised {type(err).__name__}: {err}")
                continue
            # refused module names raise on access; refused Accelerator methods raise when called (test below)
            if status == "refused" and (scope != "Accelerator" or not callable(value)):
                wrong.append(f"{scope}.{name}: table says refused, but it is there: {value!r}")
    assert not wrong, "\n".join(wrong)


def test_refused_accelerator_methods_raise_one_line_when_called(accelerator):
    for name, status in _table()["Accelerator"].items():
        if status != "refused":
            continue
        try:
            member = getattr(accelerator, name)
        except HfBackendError:
            continue
        with pytest.raises(HfBackendError) as err:
            member(None, None)
        assert "\n" not in str(err.value) and name in str(err.value)
