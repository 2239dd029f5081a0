"""Mixed precision: the autocast context, for fp16 the gradient scaler, and the dtype the optimizer
steps.

**choice** (docs/precision.md): under mixed precision the optimizer steps fp32 master weights
whatever dtype the model was loaded in, as DeepSpeed's bf16 does. A model loaded in bf16 or fp16 has
its trainable parameters upcast to fp32 when a strategy prepares it for training (one note, naming
the bytes); autocast still computes in the 16-bit dtype. With mixed precision "no" a 16-bit model
trains in its own dtype, master weights and optimizer state included (one note).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config.options import AutocastKwargs, GradScalerKwargs
from ..core.dtypes import dtype_name, dtype_of
from ..core.errors import HfBackendError
from ..core.nested import recursively_apply
from ..core.notes import note

PRECISIONS = ("no", "fp16", "bf16")
def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _to_fp32(value: Any) -> Any:
    """Model outputs with their fp16 / bf16 tensors in fp32 (containers, ModelOutput included,
    rebuilt)."""
    return recursively_apply(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, value)


class Precision:
    """One per Accelerator: knows the compute dtype, wraps forwards in autocast and owns the fp16
    GradScaler."""

    def __init__(self, mode: str, device: torch.device, scaler_kwargs: GradScalerKwargs | None = None,
                 autocast_kwargs: AutocastKwargs | None = None) -> None:
        if mode not in PRECISIONS:
            raise HfBackendError(f"mixed_precision={mode!r} is not one of {', '.join(PRECISIONS)}")
        self.mode = mode
        self.device = device
        self._autocast_kwargs = (autocast_kwargs or AutocastKwargs()).to_kwargs()
        self.scaler: torch.amp.GradScaler | None = None
        if mode == "fp16":
            self.scaler = torch.amp.GradScaler(device.type, **(scaler_kwargs or GradScalerKwargs()).to_kwargs())

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.mode == "no" else dtype_of(self.mode, "mixed_precision")

    @contextlib.contextmanager
    def autocast(self, enabled: bool = True) -> Iterator[None]:
        if self.mode == "no" or not enabled:
            yield
            return
        kwargs = dict(self._autocast_kwargs)
        kwargs.setdefault("enabled", True)
        with torch.autocast(device_type=self.device.type, dtype=self.dtype, **kwargs):
            yield

    def wrap_forward(self, module: torch.nn.Module) -> None:
        """Run `module.forward` under autocast and hand back fp32 outputs; a no-op without mixed
        precision."""
        if self.mode == "no" or hasattr(module, "_hf_backend_original_forward"):
            return
        original: Callable = module.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            with self.autocast():
                out = original(*args, **kwargs)
            return _to_fp32(out)

        module._hf_backend_original_forward = original  # type: ignore[assignment]  # Module.__setattr__ takes any value
        module.forward = forward

    @staticmethod
    def unwrap_forward(module: torch.nn.Module) -> None:
        original = module.__dict__.pop("_hf_backend_original_forward", None)
        if original is None:
            return
        if getattr(original, "__func__", None) is type(module).forward:
            del module.forward  # the class's own method shows through again
        else:
            module.forward = original

    def keep_fp32_masters(self, model: torch.nn.Module, sharded: bool = False,
                          param_dtype: torch.dtype | None = None) -> int:
        """What a strategy calls on a model it prepares for training, after placing it and before
        wrapping or sharding it (DDP's buckets and FSDP2's shards take the dtype they see). Under
        mixed precision (this policy's fp16 / bf16, or `param_dtype`: the 16-bit dtype an FSDP2
        MixedPrecisionPolicy all-gathers in) the trainable fp16 / bf16 parameters become fp32 in
        place, through `param.data`: an optimizer built over them before `prepare` keeps the same
        Parameter objects and now steps fp32 master weights with fp32 state, while the forward still
        computes in 16 bits. Frozen parameters keep their dtype (nothing steps them), and so do
        buffers. Returns how many elements were upcast. Without mixed precision nothing changes, and
        one note says the model trains in its own dtype. `sharded`: the note counts bytes over all
        ranks, not per process."""
        low: dict[int, torch.nn.Parameter] = {}
        for param in model.parameters():  # shared (tied) parameters once
            if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
                low.setdefault(id(param), param)
        if not low:
            return 0
        loaded = "/".join(sorted({dtype_name(p.dtype) for p in low.values()}))
        numel = sum(p.numel() for p in low.values())
        policy = param_dtype if param_dtype in (torch.float16, torch.bfloat16) else None
        if self.mode == "no" and policy is None:
            note(f"the model's {numel:,} trainable parameters are {loaded} and mixed_precision is "
                 f"'no': they train in {loaded}, master weights and optimizer state included "
                 "(mixed_precision='bf16' keeps fp32 masters)")
            return 0
        with torch.no_grad():
            for param in low.values():
                _upcast(param)
        if self.mode != "no":
            why, compute, instead = f"mixed_precision={self.mode}", self.mode, "mixed_precision='no'"
        else:
            assert policy is not None  # mode 'no' without a policy returned above
            why = f"the FSDP mixed_precision_policy (param_dtype={dtype_name(policy)})"
            compute, instead = dtype_name(policy), "the policy without param_dtype"
        where = "in all, sharded over the ranks" if sharded else "per process"
        note(f"{why}: {numel:,} trainable {loaded} parameters upcast to fp32 master weights, as "
             f"DeepSpeed keeps them (+{_size(2 * numel)} {where}, +{_size(2 * numel)} of "
             f"gradients, +{_size(4 * numel)} of Adam state); the forward still computes in "
             f"{compute} ({instead} would train them in {loaded})")
        return numel

    def scale_and_backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)


def _upcast(param: torch.nn.Parameter) -> None:
    """`param` as fp32 in place (the same Parameter object, which an optimizer may hold). A DTensor
    (a model transformers split by its tp_plan) is swapped whole, as torch's own `Module.to` does:
    `param.data = ...` would change its dtype but not its local shard's."""
    grad = param.grad
    if is_traceable_wrapper_subclass(param):
        upcast = torch.nn.Parameter(param.data.float(), requires_grad=param.requires_grad)
        upcast.__dict__.update(param.__dict__)  # swap_tensors swaps the attributes too (transformers' marks)
        torch.utils.swap_tensors(param, upcast)
    else:
        param.data = param.data.float()
    if grad is not None:  # a gradient from before prepare: accumulated in the master's dtype
        param.grad = grad.float()
