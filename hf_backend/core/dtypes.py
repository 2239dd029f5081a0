"""Precision names and torch dtypes, both ways: `dtype_of("bf16")` for what a user or a config names, `dtype_name`
for what a note or a report shows."""

from __future__ import annotations

from typing import Any

import torch

from .errors import HfBackendError

_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "float32": torch.float32}
_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    """fp32, bf16, ... (torch's own name for any other dtype)."""
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


def dtype_of(value: Any, what: str) -> torch.dtype | None:
    """torch's dtype for fp16 / bf16 / fp32 (or torch's own names, or a dtype); None stays None; any
    other value is one line naming `what`."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if str(value) not in _DTYPES:
        raise HfBackendError(f"{what}={value!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[str(value)]
