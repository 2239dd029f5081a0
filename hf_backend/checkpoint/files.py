"""How bytes are written and read: safetensors weights (sharded with an index when large), torch files
read with `weights_only=True` (safe_load.py: no code in a file runs, a refusal is one line), and the
random generators' states."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file as load_safetensors

from ..core.errors import HfBackendError
from .safe_load import torch_load


# -- weights ---------------------------------------------------------------------------------------
def write_weights(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike, *, filename_stem: str = "model",
                  max_shard_size: int | str = "10GB", safe_serialization: bool = True,
                  tied_keys: list[str] | None = None) -> None:
    """Write a full state dict as safetensors shards (with an index JSON when there is more than one
    shard)."""
    ext = ".safetensors" if safe_serialization else ".bin"
    save_torch_state_dict(
        {k: _own_storage(v.detach().cpu()) for k, v in state_dict.items()}, os.fspath(directory),
        filename_pattern=filename_stem + "{suffix}" + ext, max_shard_size=max_shard_size,
        safe_serialization=safe_serialization, shared_tensors_to_discard=tied_keys or None,
    )


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A view into a larger buffer (DeepSpeed's ZeRO-3 gathered weights are) copied out: safetensors
    refuses to write part of a storage, and would otherwise write the whole buffer."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole else tensor.clone()


def read_weights(directory: str | os.PathLike, filename_stem: str = "model") -> dict[str, torch.Tensor]:
    """All tensors `write_weights` wrote: one file or the shards its index lists, safetensors or
    (unsafe) .bin."""
    directory = Path(directory)
    ext = ".safetensors" if any(directory.glob(f"{filename_stem}*.safetensors*")) else ".bin"
    index = directory / f"{filename_stem}{ext}.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else [f"{filename_stem}{ext}"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise HfBackendError(f"{path} is missing; the checkpoint "
                                 "is incomplete, use another one")
        state.update(load_safetensors(path) if ext == ".safetensors" else torch_load(path))
    return state


def check_loaded(model: torch.nn.Module, result: Any, directory: str | os.PathLike) -> None:
    """A key may be missing only when it is a tied alias of one that was loaded."""
    shared = _tied_names(model)
    missing = [k for k in result.missing_keys if k not in shared]
    if missing or result.unexpected_keys:
        raise HfBackendError(
            f"weights in {directory} do not fit the model: missing {missing[:5]}, unexpected "
            f"{list(result.unexpected_keys)[:5]}; load them into the model they were saved from"
        )


def _tied_names(model: torch.nn.Module) -> set[str]:
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = tensor.data_ptr()
        if ptr in seen and tensor.numel():
            tied.update((name, seen[ptr]))
        seen.setdefault(ptr, name)
    return tied


def tied_weight_keys(model: torch.nn.Module) -> list[str]:
    """The names transformers drops when saving tied weights (a list in v4, a mapping target -> source
    in v5)."""
    keys = getattr(model, "_tied_weights_keys", None) or []
    return list(keys.keys()) if isinstance(keys, dict) else list(keys)


# -- other objects ---------------------------------------------------------------------------------
def save_object(obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
    """`torch.save`, or safetensors for a dict of tensors when `safe_serialization`."""
    if safe_serialization:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in obj.items()}, str(f), metadata={"format": "pt"})
    else:
        torch.save(obj, f)


def load_file(path: Path, mmap: bool = False) -> Any:
    """A torch file of plain data (state dicts): no pickled code runs. `mmap`: its tensors map the file
    (see safe_load.torch_load)."""
    return torch_load(path, mmap=mmap)


def load_custom_object(path: Path) -> Any:
    """A registered object's state, as plain data like every other file: a state holding other types (a
    class of the user's, a numpy array) loads once the user allows them with
    `torch.serialization.add_safe_globals`, which the refusal says."""
    return torch_load(path)


# -- random generators -----------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state()  # legacy: a tuple (numpy's stub picks the dict overload)
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),  # type: ignore[index]  # wrong stub overload
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
