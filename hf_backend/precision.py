"""Mixed precision: the autocast context and, for fp16, the gradient scaler."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from .errors import HfBackendError
from .options import AutocastKwargs, GradScalerKwargs

PRECISIONS = ("no", "fp16", "bf16")
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _to_fp32(value):
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, dict):
        # Keep ModelOutput and other dict subclasses: update in place where the type allows it.
        try:
            out = type(value)(**{k: _to_fp32(v) for k, v in value.items()})
        except TypeError:
            out = {k: _to_fp32(v) for k, v in value.items()}
        return out
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_fp32(v) for v in value)
    return value


class Precision:
    """One per Accelerator: knows the compute dtype, wraps forwards in autocast and owns the fp16 GradScaler."""

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
        return _DTYPES.get(self.mode)

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
        """Run `module.forward` under autocast and hand back fp32 outputs; a no-op without mixed precision."""
        if self.mode == "no" or hasattr(module, "_hf_backend_original_forward"):
            return
        original: Callable = module.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            with self.autocast():
                out = original(*args, **kwargs)
            return _to_fp32(out)

        module._hf_backend_original_forward = original
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

    def scale_and_backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)
