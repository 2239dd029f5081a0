"""`hf-backend checkpoint consolidate` and `convert`, in one process without a process group.

consolidate: a checkpoint's model weights, whichever form they are in (each process's DCP shards,
full safetensors or .bin files, a DeepSpeed checkpoint of transformers.Trainer), as one safetensors
model directory (sharded with an index above a size) that `from_pretrained` loads when a config.json
goes with it; a PEFT adapter's checkpoint is merged into its base model.

convert: a `save_state` checkpoint between its two forms, model and optimizer together: `full`
(model.safetensors,
optimizer.bin: what a run without FSDP's sharded state dicts writes) and `sharded` (model_dcp/,
optimizer_dcp/). Every other file is copied as it is and the result gets a fresh manifest. Either
form already loads under any strategy and world size; converting moves a checkpoint to a place
without DCP, or makes one that each process reads its part of.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from ..core.errors import HfBackendError
from . import layout, manifest
from .files import read_weights, write_weights
from .index import CheckpointIndex, read_index
from .safe_load import dcp_load, torch_load

FORMS = ("full", "sharded")


def model_weights(directory: str | os.PathLike, stem: str = "model", what: str = "consolidate") -> dict[str, Any]:
    """The full weights of model `stem` in an hf_backend checkpoint (verified first; shards or full
    files, as its index says), or in a directory of full weights or DeepSpeed's own checkpoint (a
    `latest` file naming its tag, as transformers.Trainer writes it under DeepSpeed); read without
    running code from any file."""
    directory = Path(directory)
    if layout.holds_engine_state(directory):
        return _checkpoint_weights(read_index(directory, caller=what), stem, what)
    if any(directory.glob(f"{stem}*.safetensors")) or (directory / f"{stem}.bin").is_file() \
            or (directory / f"{stem}.bin.index.json").is_file():
        return read_weights(directory, stem)
    # DeepSpeed's own checkpoint: global_step{N}/, named by `latest`
    if (directory / "latest").is_file():
        # imports deepspeed: only for DeepSpeed's own checkpoints
        from .deepspeed_files import native_weights

        return native_weights(directory, (directory / "latest").read_text().strip())
    raise HfBackendError(f"{what}: {directory} holds no weights of {stem} (no "
                         f"{layout.METADATA}, {stem}.safetensors or "
                         "DeepSpeed's `latest`); pass a checkpoint directory")


def _checkpoint_weights(index: CheckpointIndex, stem: str, what: str) -> dict[str, Any]:
    if index.sharded(stem):
        return _dcp_state(index.shards(stem), "model", what)
    return read_weights(index.directory, stem)


def _dcp_state(shards: Path, key: str, what: str) -> Any:
    state: dict[str, Any] = {}
    # "torch.distributed is ... uninitialized": one process is what is meant
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, shards, empty=True, what=what)
    if key not in state:
        raise HfBackendError(f"{what}: {shards} holds no {key} state ({sorted(state)}); pass the "
                             f"checkpoint's {key}_dcp directory's parent")
    return state[key]


def _fresh(out: Path, what: str) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HfBackendError(f"{what}: {out} exists and is not an "
                             "empty directory; pass a new directory")
    staging = layout.staging_dir(out)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, out: Path) -> None:
    if out.exists():
        out.rmdir()
    staging.rename(out)


def consolidate(directory: str | os.PathLike, out: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                config: str | os.PathLike | None = None, stem: str = "model",
                base: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write the model's full weights as `out/model.safetensors` (or shards with an index), with
    config.json from `config` (a file or a directory holding one) or the checkpoint's own; returns
    what was written. A checkpoint that holds a PEFT adapter is merged into its base model (`base`,
    default the adapter's base_model_name_or_path)."""
    directory, out = Path(directory), Path(out)
    if not directory.is_dir():
        raise HfBackendError(f"consolidate: {directory} is not a "
                             "directory; pass a checkpoint directory")
    if layout.adapter_weights_file(directory) is not None:
        return _merge_adapter(directory, out, base, max_shard_size)
    if base is not None:
        raise HfBackendError("consolidate: --base is for a checkpoint of a PEFT adapter, and "
                             f"{directory} holds no {layout.ADAPTER_WEIGHTS[0]}; drop --base")
    source = _config_source(directory, config)
    weights = {k: v for k, v in model_weights(directory, stem).items() if isinstance(v, torch.Tensor)}
    staging = _fresh(out, "consolidate")
    try:
        write_weights(weights, staging, filename_stem=layout.PRETRAINED_STEM, max_shard_size=max_shard_size)
        # under the name from_pretrained reads, and the generation config beside it
        if source is not None:
            shutil.copyfile(source, staging / "config.json")
            if (source.parent / "generation_config.json").is_file():
                shutil.copyfile(source.parent / "generation_config.json", staging / "generation_config.json")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publish(staging, out)
    return {"out": str(out), "files": sorted(p.name for p in out.iterdir()), "tensors": len(weights),
            "parameters": sum(v.numel() for v in weights.values()),
            "config": str(source) if source is not None else None}


def _merge_adapter(directory: Path, out: Path, base: str | os.PathLike | None,
                   max_shard_size: int | str) -> dict[str, Any]:
    """The base model with the adapter's weights merged in (PEFT's merge_and_unload), in
    from_pretrained's layout."""
    import transformers
    from peft import PeftConfig, PeftModel

    adapter = PeftConfig.from_pretrained(str(directory))
    base = base if base is not None else adapter.base_model_name_or_path
    if not base:
        raise HfBackendError(f"consolidate: {directory} holds a PEFT adapter whose "
                             "base model is not named in its adapter_config.json; "
                             "pass --base with the base model's directory")
    try:
        model_config = transformers.AutoConfig.from_pretrained(str(base))
        model_class = getattr(transformers, (model_config.architectures or ["AutoModel"])[0])
        model = model_class.from_pretrained(str(base))
    except (OSError, ValueError, AttributeError) as err:
        reason = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        raise HfBackendError(f"consolidate: the base model {base} cannot be loaded ({reason}); "
                             "pass --base with a directory from_pretrained reads") from None
    if getattr(model, "hf_quantizer", None) is not None:  # a base saved quantized (QLoRA's): merged in float
        model = _dequantized(model)
    merged = PeftModel.from_pretrained(model, str(directory)).merge_and_unload()
    staging = _fresh(out, "consolidate")
    try:
        merged.save_pretrained(staging, max_shard_size=max_shard_size)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publish(staging, out)
    weights = merged.state_dict()
    return {"out": str(out), "files": sorted(p.name for p in out.iterdir()), "tensors": len(weights),
            "parameters": sum(v.numel() for v in weights.values()), "config": str(out / "config.json"),
            "merged_adapter": str(directory), "base": str(base)}


def _dequantized(model: Any) -> Any:
    """A float model of `model`'s class holding its dequantized weights (transformers' `dequantize`
    leaves a model that cannot be saved: it keeps the quantized loading's conversions)."""
    weights = model.dequantize().state_dict()
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = type(model)(config).to(next(w.dtype for w in weights.values() if w.is_floating_point()))
    fresh.load_state_dict(weights)
    return fresh


def _config_source(directory: Path, config: str | os.PathLike | None) -> Path | None:
    if config is None:
        found = directory / "config.json"
        return found if found.is_file() else None
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise HfBackendError(f"consolidate: --config {config} is not a config.json (nor a "
                             "directory holding one); pass the model's config.json")
    try:
        json.loads(path.read_text())
    except ValueError:
        raise HfBackendError(f"consolidate: {path} is not JSON; pass "
                             "the model's config.json") from None
    return path


def convert(directory: str | os.PathLike, out: str | os.PathLike, to: str) -> dict[str, Any]:
    """A copy of the `save_state` checkpoint `directory` at `out` with its models and optimizers in the
    form `to` (`full` or `sharded`), every other file as it was, and a new manifest."""
    directory, out = Path(directory), Path(out)
    if to not in FORMS:
        raise HfBackendError(f"convert: --to {to!r} is not one of {', '.join(FORMS)}")
    # verified: a damaged checkpoint is not converted
    index = read_index(directory, caller="convert")
    meta = index.meta
    if index.written_by_trainer:
        raise HfBackendError(f"convert: {directory} is a Trainer checkpoint, which resumes in "
                             "either form as it is; convert takes save_state checkpoints "
                             "(`consolidate` takes its weights)")
    staging = _fresh(out, "convert")
    converted: set[str] = set()
    try:
        for i in range(meta["counts"]["models"]):
            stem = layout.model_stem(i)
            converted.update(_weight_names(directory, stem))
            _write(_checkpoint_weights(index, stem, "convert"), staging, stem, "model", to)
        for i in range(meta["counts"]["optimizers"]):
            stem = layout.optimizer_stem(i)
            converted.update({layout.sharded_dir(stem), index.files.optimizer(stem)})
            state = _dcp_state(index.shards(stem), "optimizer", "convert") if index.sharded(stem) \
                else torch_load(index.optimizer_file(stem), "convert")
            _write(state, staging, stem, "optimizer", to)
        for path in directory.iterdir():
            if path.name not in converted and path.name != layout.METADATA:
                (shutil.copytree if path.is_dir() else shutil.copyfile)(path, staging / path.name)
        meta = {k: v for k, v in meta.items() if k != "files"}
        meta["converted_to"] = to
        (staging / layout.METADATA).write_text(json.dumps(meta, indent=2))
        manifest.seal(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publish(staging, out)
    return {"out": str(out), "form": to, "files": sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                                         if p.is_file())}


def _weight_names(directory: Path, stem: str) -> set[str]:
    names = {layout.sharded_dir(stem), f"{stem}.bin", f"{stem}.safetensors"}
    names.update(p.name for p in directory.glob(f"{stem}-*-of-*.*"))
    names.update(p.name for p in directory.glob(f"{stem}.*.index.json"))
    return names


def _write(state: dict[str, Any], directory: Path, stem: str, key: str, to: str) -> None:
    if to == "sharded":
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({key: state}, checkpoint_id=str(directory / layout.sharded_dir(stem)), no_dist=True)
    elif key == "model":
        write_weights(state, directory, filename_stem=stem)
    else:
        torch.save(state, directory / layout.STATE_FILES.optimizer(stem))


__all__ = ["FORMS", "consolidate", "convert", "model_weights"]
