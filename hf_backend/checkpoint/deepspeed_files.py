"""DeepSpeed's own checkpoint files (the `global_step*/` transformers.Trainer writes under DeepSpeed),
merged into full weights for `hf-backend checkpoint consolidate` without running pickled code.

DeepSpeed reads its `.pt` files with `torch.load(weights_only=False)`; here every read goes through
`torch.load(weights_only=True)` with the few DeepSpeed classes its files hold allow-listed (a loss
scaler, the ZeRO stage enum, the fragment addresses of universal checkpoints). DeepSpeed's
zero_to_fp32 offers no hook for how it reads, so a private copy of that module (it is a standalone
script, which DeepSpeed also copies into each checkpoint) is loaded with its own `torch` answering
`load` with `safe_load`; DeepSpeed's imported module is left as it is. `deepspeed` is imported
inside the functions: this module loads without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pickle
import types
from pathlib import Path
from typing import Any

import torch

from ..core.errors import HfBackendError
from ..core.notes import note

# module, name: what DeepSpeed 0.19's ZeRO-1/2/3 and bf16 checkpoint files hold besides tensors
_ALLOWED = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def _allowed_globals() -> list[Any]:
    found = []
    for module, name in _ALLOWED:
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), name))
    return found


def safe_load(path: str | Path, map_location: Any = None, **_: Any) -> Any:
    """One DeepSpeed checkpoint file, with nothing but allow-listed types unpickled; anything else is
    one line."""
    path = Path(path)
    if not path.is_file():
        raise HfBackendError(f"load_state: {path} is missing; the "
                             "checkpoint is incomplete, use another one")
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location if map_location is not None else "cpu",
                              weights_only=True)
    except pickle.UnpicklingError as err:  # what torch raises for a type outside the allow-list
        reason = str(err).split("WeightsUnpickler error: ")[-1].split(".")[0].strip() or "a pickled object"
        raise HfBackendError(f"load_state: {path} holds more than tensors and DeepSpeed's plain "
                             f"types ({reason}); it was not written by DeepSpeed's "
                             "save_checkpoint, use another checkpoint") from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        reason = " ".join(str(err).split()).split(". ")[0][:200] or type(err).__name__
        raise HfBackendError(f"load_state: {path} cannot be read ({reason}); the checkpoint is "
                             "damaged, use another one") from None


def _safe_zero_to_fp32() -> Any:
    """A private copy of DeepSpeed's zero_to_fp32 module whose `torch.load` is `safe_load` (module
    docstring)."""
    spec = importlib.util.find_spec("deepspeed.utils.zero_to_fp32")
    if spec is None or spec.loader is None:
        raise HfBackendError("consolidate: DeepSpeed's zero_to_fp32 "
                             "is not installed; pip install deepspeed")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    safe_torch = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch)
                                          if not name.startswith("__")})
    safe_torch.load = safe_load
    module.__dict__["torch"] = safe_torch
    return module


def native_weights(directory: Path, tag: str) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a DeepSpeed checkpoint `directory/tag/` as `engine.save_checkpoint`
    wrote it: ZeRO-1, 2 or 3 at any world size, merged from every rank's partition of the fp32
    master weights (with the module's buffers); without ZeRO (stage 0), the module's weights as
    saved. No pickled code runs."""
    directory = Path(directory)
    folder = directory / tag
    if not folder.is_dir():
        raise HfBackendError(f"{folder} does not exist; pass the directory holding DeepSpeed's "
                             "checkpoint and its tag")
    # stage 0: no partitions, the module holds the weights
    if not any(folder.glob("*_optim_states.pt")):
        models = sorted(folder.glob("mp_rank_*_model_states.pt"))
        if not models:
            raise HfBackendError(f"{folder} holds no DeepSpeed model states "
                                 "(mp_rank_*_model_states.pt); pass a directory written by "
                                 "DeepSpeed's save_checkpoint")
        return _stage0_weights(safe_load(models[0]))
    zero_to_fp32 = _safe_zero_to_fp32()
    try:
        # its progress
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
    except (ValueError, FileNotFoundError, KeyError) as err:
        raise HfBackendError(f"{folder}: not a complete DeepSpeed ZeRO checkpoint ({err}); use "
                             "another checkpoint") from None
    return dict(state)


def _stage0_weights(states: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The module's weights in fp32; with bf16 (DeepSpeed's unfused optimizer), its fp32 copies in
    their place when they line up with the module's parameters in order and shape (an optimizer over
    `model.parameters()`)."""
    weights = {k: v.float() if v.is_floating_point() else v for k, v in states["module"].items()}
    masters = [t for group in (states.get("optimizer") or {}).get("fp32_groups", []) for t in group]
    buffers = set(states.get("buffer_names") or [])
    names = [k for k in states["module"] if k not in buffers]
    if masters and len(names) == len(masters) and all(weights[n].shape == m.shape for n, m in zip(names, masters)):
        weights.update({n: m.float() for n, m in zip(names, masters)})
    elif masters:
        note("DeepSpeed checkpoint without ZeRO: its fp32 master copies do not line up with the "
             "module's parameters; the module's 16-bit weights are returned")
    return weights


__all__ = ["native_weights", "safe_load"]
