"""The GPU lane (docs/gpu.md): every test under tests/gpu needs a CUDA device.

`make test` collects this directory like the rest of tests/ and every test here is skipped at once, with the reason
"no CUDA device", on a machine without one (CI never has one); `make test-gpu` runs only this directory and refuses
to start without a GPU, so a green `make test-gpu` always means the tests ran.

What the modules share is in tests/helpers.py, as for every test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_CUDA = "no CUDA device"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu, `make test-gpu`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))

