"""Every byte hf_backend writes or reads for checkpoints: layout, naming, rotation, safetensors weights, RNG.

`save_state(dir)` writes into `dir.incomplete` and renames it into place once every process has written its part, so
an interrupted save never leaves a half-written checkpoint under the real name (nor destroys the previous one).

Layout of a state checkpoint (model i > 0 and friends get an `_i` suffix):
    hf_backend_checkpoint.json   what was saved: counts, world size, accumulation step, versions
    model.safetensors            full weights of model 0 (sharded with an index JSON when large)
    optimizer.bin  scheduler.bin  scaler.pt  dataloader.bin  custom_checkpoint_0.pkl
    rng_state_{rank}.pt          python, numpy, torch (and CUDA) generator states of each process
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file as load_safetensors

from .collectives import gather_object
from .errors import HfBackendError
from .state import ProcessState

METADATA = "hf_backend_checkpoint.json"
FORMAT_VERSION = 1
_AUTO_NAME = re.compile(r"checkpoint_(\d+)$")


@dataclass
class Checkpointable:
    """The objects an Accelerator saves and restores, in prepare order."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)


def _name(stem: str, index: int, ext: str) -> str:
    return f"{stem}{'' if index == 0 else f'_{index}'}{ext}"


# -- weights ---------------------------------------------------------------------------------------------------------
def write_weights(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike, *, filename_stem: str = "model",
                  max_shard_size: int | str = "10GB", safe_serialization: bool = True,
                  tied_keys: list[str] | None = None) -> None:
    """Write a full state dict as safetensors shards (with an index JSON when there is more than one shard)."""
    ext = ".safetensors" if safe_serialization else ".bin"
    save_torch_state_dict(
        {k: _own_storage(v.detach().cpu()) for k, v in state_dict.items()}, directory,
        filename_pattern=filename_stem + "{suffix}" + ext, max_shard_size=max_shard_size,
        safe_serialization=safe_serialization, shared_tensors_to_discard=tied_keys or None,
    )


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A view into a larger buffer (DeepSpeed's ZeRO-3 gathered weights are) copied out: safetensors refuses to
    write part of a storage, and would otherwise write the whole buffer."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole else tensor.clone()


def read_state_dict(directory: str | os.PathLike, filename_stem: str = "model") -> dict[str, torch.Tensor]:
    """All tensors `write_weights` wrote: one file or the shards its index lists, safetensors or (unsafe) .bin."""
    directory = Path(directory)
    ext = ".safetensors" if any(directory.glob(f"{filename_stem}*.safetensors*")) else ".bin"
    index = directory / f"{filename_stem}{ext}.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else [f"{filename_stem}{ext}"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise HfBackendError(f"{path} is missing; the checkpoint is incomplete, use another one")
        state.update(load_safetensors(path) if ext == ".safetensors" else torch.load(path, weights_only=True))
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
    """The names transformers drops when saving tied weights (a list in v4, a mapping target -> source in v5)."""
    keys = getattr(model, "_tied_weights_keys", None) or []
    return list(keys.keys()) if isinstance(keys, dict) else list(keys)


def save_object(obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
    """`torch.save`, or safetensors for a dict of tensors when `safe_serialization`."""
    if safe_serialization:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in obj.items()}, str(f), metadata={"format": "pt"})
    else:
        torch.save(obj, f)


# -- RNG -------------------------------------------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
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


# -- directories -----------------------------------------------------------------------------------------------------
def auto_checkpoint_dir(project_dir: str, iteration: int) -> Path:
    return Path(project_dir) / "checkpoints" / f"checkpoint_{iteration}"


def list_auto_checkpoints(project_dir: str) -> list[Path]:
    """Automatic checkpoints, oldest first."""
    root = Path(project_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _AUTO_NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def automatic_dir(config: Any) -> Path:
    """Where `save_state()` without a directory writes: the next automatic checkpoint of a ProjectConfiguration."""
    if not config.automatic_checkpoint_naming:
        raise HfBackendError("save_state() needs a directory, or ProjectConfiguration(automatic_checkpoint_naming="
                             "True, project_dir=...)")
    if config.project_dir is None:
        raise HfBackendError("save_state(): automatic checkpoint naming needs project_dir; pass "
                             "Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...)")
    return auto_checkpoint_dir(config.project_dir, config.iteration)


def latest_automatic_dir(config: Any) -> Path:
    """What `load_state()` without a directory reads: the newest automatic checkpoint."""
    found = list_auto_checkpoints(config.project_dir) if config.project_dir else []
    if not found:
        raise HfBackendError(f"load_state(): no checkpoint under {config.project_dir}/checkpoints; pass the "
                             "directory save_state wrote")
    return found[-1]


def rotate(project_dir: str, total_limit: int) -> None:
    for old in list_auto_checkpoints(project_dir)[:-total_limit]:
        shutil.rmtree(old, ignore_errors=True)


def _staged_write(target: Path, state: ProcessState, write: Callable[[Path], None]) -> None:
    """Run `write(staging_dir)` on every process, then move the staging dir to `target` in one rename.

    When the processes name different directories (each its own, as Accelerate allows), each process stages and
    renames its own, holding its part of the checkpoint."""
    own = state.distributed and len(set(gather_object(str(target.resolve())))) > 1
    if own:
        _staged_write(target, dataclasses.replace(state, num_processes=1, process_index=0), write)
        state.wait_for_everyone()
        return
    staging = target.with_name(target.name + ".incomplete")
    if state.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    state.wait_for_everyone()
    write(staging)
    state.wait_for_everyone()
    if state.is_main_process:
        previous = target.with_name(target.name + ".previous")
        if target.exists():
            shutil.rmtree(previous, ignore_errors=True)
            target.rename(previous)
        staging.rename(target)
        shutil.rmtree(previous, ignore_errors=True)
    state.wait_for_everyone()


def after_save_hooks(hooks: Iterable[Callable], objects: Checkpointable, output_dir: str | os.PathLike,
                     state_dict: Callable[[torch.nn.Module], dict]) -> Checkpointable:
    """Run `register_save_state_pre_hook` hooks as `hook(models, weights, output_dir)`; a model whose state dict a
    hook removed from `weights` is left out of the checkpoint (the hook saves it its own way)."""
    hooks = list(hooks)
    if not hooks:
        return objects
    weights = [state_dict(model) for model in objects.models]
    kept = list(weights)
    for hook in hooks:
        hook(objects.models, kept, str(output_dir))
    return dataclasses.replace(objects, models=[m for m, w in zip(objects.models, weights)
                                                if any(w is k for k in kept)])


def after_load_hooks(hooks: Iterable[Callable], objects: Checkpointable,
                     input_dir: str | os.PathLike) -> Checkpointable:
    """Run `register_load_state_pre_hook` hooks as `hook(models, input_dir)`; a model a hook removed from `models` is
    not loaded (the hook loads it its own way)."""
    hooks = list(hooks)
    if not hooks:
        return objects
    models = list(objects.models)
    for hook in hooks:
        hook(models, str(input_dir))
    return dataclasses.replace(objects, models=[m for m in objects.models if any(m is k for k in models)])


# -- state checkpoints ------------------------------------------------------------------------------------------------
def write_state(directory: Path, objects: Checkpointable, *, state: ProcessState, strategy: Any,
                scaler: torch.amp.GradScaler | None, extra: dict[str, Any], safe_serialization: bool = True,
                rng: bool = True) -> None:
    """Write `objects` into the existing `directory`; every process calls it (gathering a full state, or writing
    each process's shards, is collective)."""
    if rng:
        torch.save(capture_rng(), directory / f"rng_state_{state.process_index}.pt")
    for i, model in enumerate(objects.models):
        strategy.save_model_state(model, directory, _name("model", i, ""), safe_serialization)
    for i, opt in enumerate(objects.optimizers):
        strategy.save_optimizer_state(opt, directory, _name("optimizer", i, ""))
    if not state.is_main_process:
        return
    for i, sched in enumerate(objects.schedulers):
        torch.save(sched.state_dict(), directory / _name("scheduler", i, ".bin"))
    for i, loader in enumerate(objects.dataloaders):
        torch.save(loader.state_dict(), directory / _name("dataloader", i, ".bin"))
    for i, obj in enumerate(objects.custom):
        torch.save(obj.state_dict(), directory / f"custom_checkpoint_{i}.pkl")
    if scaler is not None:
        torch.save(scaler.state_dict(), directory / "scaler.pt")
    meta = {
        "format_version": FORMAT_VERSION,
        "num_processes": state.num_processes,
        "counts": {k: len(getattr(objects, k)) for k in ("models", "optimizers", "schedulers", "dataloaders",
                                                          "custom")},
        "scaler": scaler is not None,
        **extra,
    }
    (directory / METADATA).write_text(json.dumps(meta, indent=2))


def save_checkpoint(target: str | os.PathLike, objects: Checkpointable, *, state: ProcessState, strategy: Any,
                    scaler: torch.amp.GradScaler | None, extra: dict[str, Any],
                    safe_serialization: bool = True) -> Path:
    """`write_state` into a new directory `target`, staged so that it appears complete or not at all."""
    target = Path(target)
    _staged_write(target, state, lambda directory: write_state(
        directory, objects, state=state, strategy=strategy, scaler=scaler, extra=extra,
        safe_serialization=safe_serialization))
    return target


def read_metadata(source: str | os.PathLike) -> dict[str, Any]:
    source = Path(source)
    if not source.is_dir():
        raise HfBackendError(f"load_state: no checkpoint directory at {source}; pass the directory save_state wrote")
    meta_path = source / METADATA
    if not meta_path.is_file():
        raise HfBackendError(f"load_state: {source} is not an hf_backend checkpoint (no {METADATA}); "
                             "pass a directory written by Accelerator.save_state")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise HfBackendError(f"load_state: {meta_path} is corrupt (line {err.lineno}); use another checkpoint") \
            from None
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise HfBackendError(f"load_state: {meta_path} has format_version {version!r}; this hf_backend reads versions "
                             f"1 to {FORMAT_VERSION}: load it with the hf_backend that wrote it, or upgrade")
    return meta


def load_checkpoint(source: str | os.PathLike, objects: Checkpointable, *, state: ProcessState, strategy: Any,
                    scaler: torch.amp.GradScaler | None, rng: bool = True,
                    models_taken_by_hooks: bool = False) -> dict[str, Any]:
    """Restore `objects` from `source`. `models_taken_by_hooks`: load-state hooks took some models to load them
    themselves, so fewer models than the checkpoint holds are read (in order, as Accelerate does)."""
    source = Path(source)
    meta = read_metadata(source)
    for kind, saved in meta["counts"].items():
        have = len(getattr(objects, kind))
        if saved != have and not (kind == "models" and models_taken_by_hooks and have < saved):
            raise HfBackendError(
                f"load_state: {source} holds {saved} {kind} but {have} are prepared/registered; prepare and register "
                "the same objects, in the same order, as the run that saved it"
            )
    for i, model in enumerate(objects.models):
        strategy.load_model_state(model, source, _name("model", i, ""))
    for i, opt in enumerate(objects.optimizers):
        strategy.load_optimizer_state(opt, source, _name("optimizer", i, ""))
    for i, sched in enumerate(objects.schedulers):
        sched.load_state_dict(load_file(source / _name("scheduler", i, ".bin")))
    for i, loader in enumerate(objects.dataloaders):
        loader.load_state_dict(load_file(source / _name("dataloader", i, ".bin")))
    for i, obj in enumerate(objects.custom):
        obj.load_state_dict(torch.load(source / f"custom_checkpoint_{i}.pkl", weights_only=False))
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(load_file(source / "scaler.pt"))
    rng_file = source / f"rng_state_{state.process_index}.pt"
    if rng and rng_file.is_file():
        restore_rng(load_file(rng_file))
    return meta


def load_file(path: Path) -> Any:
    if not path.is_file():
        raise HfBackendError(f"load_state: {path} is missing; the checkpoint is incomplete, use another one")
    return torch.load(path, map_location="cpu", weights_only=True)
