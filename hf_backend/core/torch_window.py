"""The torch releases hf_backend is tested with, checked once when the engine's process state is imported.

The engine reaches into torch's private APIs (`DeviceMesh._unflatten`, `torch.distributed._functional_collectives`,
DCP's `_nested_dict`, the SDPA CPU kernels' ops), so a release outside the window would fail deep inside a strategy.
Instead: older than OLDEST is one ImportError line naming the install; newer than NEWEST one warning. The window is
pyproject.toml's `torch` requirement, and `make test-torch TORCH=...` runs the whole suite on one release
(docs/development.md, "torch releases").
"""

from __future__ import annotations

import torch
from packaging.version import Version

from .notes import warn

OLDEST, NEWEST = (2, 13), (2, 15)


def _span() -> str:
    return f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def check(installed: str | None = None) -> None:
    installed = installed or torch.__version__
    release = Version(installed).release[:2]
    if release < OLDEST:
        raise ImportError(f"hf_backend needs torch {_span()} (it builds on distributed internals that older "
                          f"releases lack); you have {installed}: pip install "
                          f"'torch>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}'")
    if release > NEWEST:
        warn(f"the engine is tested with torch {_span()}; you have {installed} (it may fail inside torch's "
             "distributed internals; report it with `hf-backend env`)")
