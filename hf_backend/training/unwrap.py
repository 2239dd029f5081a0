"""Peeling wrappers off a model: Accelerate's `extract_model_from_parallel` and `is_compiled_module`,
which scripts import from `accelerate.utils`, and what every strategy's `unwrap_model` builds on."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel


def is_compiled_module(module: torch.nn.Module) -> bool:
    """A `torch.compile(...)` wrapper."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def _wrappers() -> tuple[type, ...]:
    """The parallel wrappers a script may hand over: DDP, `nn.DataParallel`, and a DeepSpeed engine
    when DeepSpeed is loaded (it is never imported for the check)."""
    deepspeed = sys.modules.get("deepspeed")
    engine = getattr(deepspeed, "DeepSpeedEngine", None)
    return (DistributedDataParallel, torch.nn.DataParallel, *((engine,) if isinstance(engine, type) else ()))


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True,
                                is_wrapper: Callable[[torch.nn.Module], bool] | None = None) -> torch.nn.Module:
    """Strip parallel wrappers (DDP, `nn.DataParallel`, a DeepSpeed engine, or what `is_wrapper` says)
    and, unless `keep_torch_compile`, the torch.compile wrapper."""
    wrappers = _wrappers()
    while True:
        if isinstance(model, wrappers) or (is_wrapper is not None and is_wrapper(model)):
            inner = getattr(model, "module", None)
        else:
            inner = None if keep_torch_compile or not is_compiled_module(model) else model._orig_mod
        if not isinstance(inner, torch.nn.Module):
            if not keep_fp32_wrapper:
                from .precision import Precision

                Precision.unwrap_forward(model)
            return model
        model = inner
