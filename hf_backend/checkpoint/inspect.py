"""`hf-backend checkpoint inspect`: what a checkpoint directory holds, who wrote it, and whether it
verifies.

Reads only metadata, JSON, safetensors headers, DCP metadata (through safe_load), and the small
scheduler and data loader files (`weights_only`); never the weights themselves. The dtypes of the
saved weights and optimizer state come from those headers and metadata, and from full torch files
(`optimizer.bin`, transformers' `optimizer.pt`, `.bin` weights) loaded `weights_only` with their
storages memory-mapped, so only the structure is read, not the values; they are read only from a
checkpoint that verified. Works for `save_state` checkpoints and transformers' / hf_backend's
Trainer checkpoints (`checkpoint-N/` with trainer_state.json, with or without the engine's part);
one that does not verify (damaged, or of format 1) is described from what its files show.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..core.errors import HfBackendError
from . import layout
from .index import CheckpointIndex, read_index
from .safe_load import check_dcp, read_dcp_metadata, torch_load

_KINDS = ("models", "optimizers", "schedulers", "dataloaders", "custom")


def inspect_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """A description of the checkpoint at `directory` (a JSON-able dict); `verified` and `problem` say
    whether every file it lists is there, intact and readable without running code."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HfBackendError(f"{directory} is not a directory; pass a checkpoint directory")
    trainer_state = _json(directory / layout.TRAINER_STATE)
    engine = (directory / layout.METADATA).is_file()
    if not engine and trainer_state is None:
        raise HfBackendError(f"{directory} is not a checkpoint (no {layout.METADATA} and no "
                             f"{layout.TRAINER_STATE}); pass a directory written by save_state or "
                             "a Trainer's checkpoint-N")
    report: dict[str, Any] = {"path": str(directory), "kind": "trainer" if trainer_state is not None else "engine",
                              "files": _files(directory)}
    report["total_bytes"] = sum(size for size in report["files"].values())
    problem, index = None, None
    try:
        index = read_index(directory, checksums=True, caller="inspect") if engine else None
        meta = index.meta if index is not None else {}
    except HfBackendError as err:
        found, problem = _json(directory / layout.METADATA), str(err).replace("inspect: ", "", 1)
        meta = found if isinstance(found, dict) else {}
    report.update(format_version=meta.get("format_version"), num_processes=meta.get("num_processes"),
                  counts=meta.get("counts"), manifest="files" in meta,
                  strategy=meta.get("strategy") or _inferred_strategy(directory, trainer_state))
    report["converted_to"] = meta.get("converted_to")  # `hf-backend checkpoint convert` wrote it
    report["written_by"] = meta.get("written_by", "hf_backend.Accelerator.save_state" if engine and trainer_state
                                    is None else "transformers.Trainer" if not engine else "hf_backend.Trainer")
    report["progress"] = _progress(directory, meta, trainer_state)
    report["weights"] = _weights(directory, meta, index)
    if "files" in meta:
        listed = set(meta["files"]) if isinstance(meta["files"], dict) else set()
        report["unlisted"] = sorted(set(report["files"]) - listed - {layout.METADATA})
    if problem is None:
        problem = _structure_problem(directory, index, report)
    report["verified"], report["problem"] = problem is None, problem
    report["dtypes"] = _dtypes(directory, index, report) if problem is None else {}
    return report


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError):
        return {}


def _files(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def _inferred_strategy(directory: Path, trainer_state: Any) -> str:
    """For checkpoints written before the metadata recorded the strategy: what the files say."""
    if (directory / "latest").is_file():
        return "DEEPSPEED (inferred from its files)"
    if (directory / layout.sharded_dir("model")).is_dir() or (directory / layout.sharded_dir("optimizer")).is_dir():
        return "FSDP (inferred from its sharded files)"
    return "not recorded (full weights: one process, DDP, or FSDP with full state dicts)"


def _progress(directory: Path, meta: dict[str, Any], trainer_state: Any) -> dict[str, Any]:
    progress: dict[str, Any] = {}
    if isinstance(trainer_state, dict):
        progress.update({k: trainer_state[k] for k in ("global_step", "epoch") if k in trainer_state})
    progress.update({k: meta[k] for k in ("iteration", "accumulation_step") if k in meta})
    scheduler = layout.state_files(meta).scheduler(0)
    for name, keys in ((scheduler, ("last_epoch",)), (layout.dataloader_file(0), ("epoch", "steps"))):
        if (directory / name).is_file() and (directory / name).stat().st_size < (1 << 20):
            try:
                state = torch_load(directory / name, "inspect")
            except HfBackendError:
                continue  # reported by the structure check
            if isinstance(state, dict):
                stem = name.split(".")[0]
                progress.update({f"{stem}_{k}": state[k] for k in keys if isinstance(state.get(k), int)})
    return progress


def _weights(directory: Path, meta: dict[str, Any], index: CheckpointIndex | None) -> dict[str, Any]:
    """How each model is stored, with its tensor and parameter counts where the headers say them: as
    the index says, or (a checkpoint that did not verify, or transformers.Trainer's) as its files
    show."""
    found: dict[str, Any] = {}
    count = (meta.get("counts") or {}).get("models", 1)
    for i in range(count if isinstance(count, int) else 1):
        stem = layout.model_stem(i)
        if index.sharded(stem) if index is not None else (directory / layout.sharded_dir(stem)).is_dir():
            found[stem] = {"form": f"sharded (DCP, {layout.sharded_dir(stem)}/)"}
        elif any(directory.glob(f"{stem}*.safetensors")):
            found[stem] = {"form": "full (safetensors)", **_safetensors_counts(directory, stem)}
        elif any(directory.glob(f"{stem}*.bin")):
            found[stem] = {"form": "full (torch .bin)"}
        elif any(directory.glob("global_step*")):
            found[stem] = {"form": "DeepSpeed's own (global_step*/)"}
    return found


def _safetensors_counts(directory: Path, stem: str) -> dict[str, int]:
    from safetensors import safe_open

    tensors = parameters = 0
    for path in sorted(directory.glob(f"{stem}*.safetensors")):
        try:
            with safe_open(str(path), "pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shape = f.get_slice(key).get_shape()
                    tensors, parameters = tensors + 1, parameters + _numel(shape)
        except Exception:  # noqa: BLE001 - a damaged header; the structure check names it
            return {}
    return {"tensors": tensors, "parameters": parameters}


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# -- dtypes of the saved weights and optimizer state -----------------------------------------------
_SAFETENSORS_DTYPES = {"F64": "fp64", "F32": "fp32", "F16": "fp16", "BF16": "bf16", "F8_E4M3": "fp8_e4m3",
                       "F8_E5M2": "fp8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                       "U8": "uint8", "BOOL": "bool"}


def _dtypes(directory: Path, index: CheckpointIndex | None, report: dict[str, Any]) -> dict[str, Any]:
    """Per model and optimizer: {dtype: {"tensors": n, "values": m}} (optimizers also list the state
    keys, e.g. exp_avg, in each dtype), or {"not_read": why}."""
    found: dict[str, Any] = {}
    for stem, weights in report["weights"].items():
        form = weights["form"]
        if form.startswith("sharded"):
            found[stem] = _read(_dcp_dtypes, directory / layout.sharded_dir(stem), False)
        elif form.startswith("full (safetensors)"):
            found[stem] = _read(_safetensors_dtypes, sorted(directory.glob(f"{stem}*.safetensors")))
        elif form.startswith("full (torch"):
            found[stem] = _read(_torch_file_dtypes, sorted(directory.glob(f"{stem}*.bin")), False)
        else:
            found[stem] = {"not_read": "DeepSpeed's own files"}
    optimizers = 0
    if index is not None:
        optimizers = index.counts.get("optimizers", 0)
        for i in range(optimizers):
            stem = layout.optimizer_stem(i)
            if index.sharded(stem):
                found[stem] = _read(_dcp_dtypes, index.shards(stem), True)
            elif index.optimizer_file(stem).is_file():
                found[stem] = _read(_torch_file_dtypes, [index.optimizer_file(stem)], True)
    if not optimizers and (directory / layout.TRAINER_OPTIMIZER).is_file():
        found["optimizer"] = _read(_torch_file_dtypes, [directory / layout.TRAINER_OPTIMIZER], True)
    return found


def _read(read: Any, *args: Any) -> dict[str, Any]:
    try:
        return read(*args)
    except Exception as err:  # noqa: BLE001 - the dtypes are extra information; the checks above judge the files
        return {"not_read": " ".join(f"{type(err).__name__}: {err}".split())[:200]}


def _add(table: dict[str, Any], dtype: str, numel: int, key: str | None = None) -> None:
    entry = table.setdefault(dtype, {"tensors": 0, "values": 0})
    entry["tensors"] += 1
    entry["values"] += numel
    if key is not None and key not in entry.setdefault("keys", []):
        entry["keys"].append(key)


def _safetensors_dtypes(paths: list[Path]) -> dict[str, Any]:
    from safetensors import safe_open

    table: dict[str, Any] = {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                piece = f.get_slice(key)
                raw = piece.get_dtype()
                _add(table, _SAFETENSORS_DTYPES.get(raw, raw.lower()), _numel(piece.get_shape()))
    return table


def _dtype_name(dtype: Any) -> str:
    from ..core.dtypes import dtype_name

    return dtype_name(dtype)


def _dcp_dtypes(directory: Path, optimizer: bool) -> dict[str, Any]:
    """From the DCP metadata alone. An optimizer's keys are flattened as
    `[optimizer.]state.<parameter>.<key>`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    table: dict[str, Any] = {}
    for fqn, item in read_dcp_metadata(directory, "inspect").state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        if optimizer and "state" not in fqn.split(".")[:-1]:
            continue  # param_groups' hyperparameters
        _add(table, _dtype_name(item.properties.dtype), _numel(item.size),
             fqn.rsplit(".", 1)[-1] if optimizer else None)
    return table


def _torch_file_dtypes(paths: list[Path], optimizer: bool) -> dict[str, Any]:
    """A torch file loaded `weights_only` with its storages memory-mapped: the structure is unpickled,
    the values stay on disk."""
    import torch

    table: dict[str, Any] = {}
    for path in paths:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if optimizer:
            for entry in (loaded.get("state") or {}).values() if isinstance(loaded, dict) else []:
                for key, value in entry.items() if isinstance(entry, dict) else []:
                    if isinstance(value, torch.Tensor):
                        _add(table, _dtype_name(value.dtype), value.numel(), str(key))
        else:
            for value in loaded.values() if isinstance(loaded, dict) else []:
                if isinstance(value, torch.Tensor):
                    _add(table, _dtype_name(value.dtype), value.numel())
    return table


def _structure_problem(directory: Path, index: CheckpointIndex | None, report: dict[str, Any]) -> str | None:
    """What the manifest does not check: the files its counts name are there, each DCP directory's
    metadata and values read safely and name shard files that are there."""
    if index is None:  # transformers.Trainer's checkpoint: nothing of the engine's to check
        return None
    try:
        counts = index.counts
        for i in range(counts.get("schedulers", 0)):
            torch_load(index.scheduler_file(i), "inspect")
        for i in range(counts.get("dataloaders", 0)):
            torch_load(directory / layout.dataloader_file(i), "inspect")
        # not read: its state may hold types only the training script allows
        for i in range(counts.get("custom", 0)):
            if not (directory / layout.custom_file(i)).is_file():
                return f"{directory / layout.custom_file(i)} is missing; the checkpoint is incomplete, use another one"
        for i in range(counts.get("optimizers", 0)):
            stem = layout.optimizer_stem(i)
            full = index.optimizer_file(stem)
            if not index.sharded(stem) and not full.is_file():
                return f"{full} is missing; the checkpoint is incomplete, use another one"
        for kind, stem_of in (("models", layout.model_stem), ("optimizers", layout.optimizer_stem)):
            for i in range(counts.get(kind, 0)):
                name = layout.sharded_dir(stem_of(i))
                if index.sharded(stem_of(i)):
                    dcp_meta = check_dcp(directory / name, "inspect")
                    for info in dcp_meta.storage_data.values():
                        shard = directory / name / info.relative_path
                        if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
                            return f"{shard} is missing or shorter than its metadata says; use another checkpoint"
        if report["kind"] == "engine" and not report["weights"] and counts.get("models"):
            return f"{directory} holds no weights for its {counts['models']} model(s); use another checkpoint"
    except HfBackendError as err:
        return str(err).replace("inspect: ", "", 1)
    return None


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _describe_dtypes(table: dict[str, Any]) -> str:
    if "not_read" in table:
        return f"not read ({table['not_read']})"
    if not table:
        return "none (no tensors)"
    parts = []
    # the most values first
    for dtype, entry in sorted(table.items(), key=lambda item: -item[1]["values"]):
        keys = f": {', '.join(entry['keys'])}" if entry.get("keys") else ""
        parts.append(f"{dtype} {entry['tensors']} tensors ({entry['values']:,} values{keys})")
    return ", ".join(parts)


def describe(report: dict[str, Any]) -> list[str]:
    """`inspect_checkpoint`'s report as lines for a person."""
    kind = {"engine": "hf_backend checkpoint (save_state)", "trainer": "Trainer checkpoint"}[report["kind"]]
    lines = [f"checkpoint: {report['path']}", f"kind: {kind}, written by {report['written_by']}"
             + (f", format {report['format_version']}" if report["format_version"] else "")]
    lines.append(f"strategy: {report['strategy']}" + (f", {report['num_processes']} process(es)"
                                                      if report["num_processes"] else "")
                 + (f"; converted to {report['converted_to']} since" if report.get("converted_to") else ""))
    if report["progress"]:
        lines.append("progress: " + ", ".join(f"{k} {v}" for k, v in report["progress"].items()))
    if report["counts"]:
        lines.append("holds: " + ", ".join(f"{k} {report['counts'][k]}" for k in _KINDS if k in report["counts"]))
    for stem, weights in report["weights"].items():
        extra = f", {weights['tensors']} tensors, {weights['parameters']:,} parameters" if "tensors" in weights else ""
        lines.append(f"{stem}: {weights['form']}{extra}")
    for stem, table in report.get("dtypes", {}).items():
        lines.append(f"{stem} {'state ' if stem.startswith('optimizer') else ''}dtypes: "
                     f"{_describe_dtypes(table)}")
    lines.append(f"files: {len(report['files'])}, {_size(report['total_bytes'])}")
    lines += [f"  {name}  {_size(size)}" for name, size in report["files"].items()]
    if report.get("unlisted"):
        lines.append(f"not in the manifest (added after the save): {', '.join(report['unlisted'])}")
    if report["verified"]:
        how = ("every file matches the manifest's size and checksum" if report["manifest"] else
               "without checksums: transformers.Trainer wrote it, with no manifest")
        lines.append(f"verified: yes, {how}")
    else:
        lines.append(f"verified: no ({report['problem']})")
    return lines


__all__ = ["describe", "inspect_checkpoint"]
