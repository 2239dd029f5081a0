"""Every name in a checkpoint directory, in one place (no other module spells a checkpoint file).

A state checkpoint (`save_state`; object i > 0 of a kind gets an `_i` suffix):

    hf_backend_checkpoint.json   what was saved: format version, counts, world size, accumulation step, iteration
    model.safetensors            full weights (sharded with an index JSON when large), or
    model_dcp/                   each process's shards (torch.distributed.checkpoint)
    optimizer.bin | optimizer_dcp/
    scheduler.bin  dataloader.bin  custom_checkpoint_0.pkl  scaler.pt
    rng_state_{rank}.pt          python, numpy, torch (and CUDA) generator states of each process

The metadata also lists every file with its size and checksum (manifest.py), added once every
process has written its part; index.py reads and verifies it before anything is loaded, and answers
what the checkpoint holds.

Automatic checkpoints (`ProjectConfiguration(automatic_checkpoint_naming=True)`) are
`project_dir/checkpoints/ checkpoint_{n}`. A save is staged in `<dir>.incomplete`; an overwritten
checkpoint waits in `<dir>.previous` until the new one is in place. transformers' Trainer
checkpoints (`checkpoint-{step}/` with `trainer_state.json`, `optimizer.pt`, `scheduler.pt`) are
named here too, for hf_backend.Trainer.

A Trainer checkpoint (hf_backend.Trainer, every strategy alike) is transformers' directory with the
engine's state in it, full states under transformers' names so that transformers.Trainer resumes it
too:

    checkpoint-{step}/           trainer_state.json, rng_state*.pth, scaler.pt, training_args.bin, config, tokenizer
    model.safetensors | model_dcp/ | adapter_model.safetensors (+ adapter_config.json: a PEFT model's trainable part)
    optimizer.pt | optimizer_dcp/     (full: keyed by parameter names, in the order of the param groups)
    scheduler.pt  dataloader.bin  hf_backend_checkpoint.json
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

METADATA = "hf_backend_checkpoint.json"
# 1: before 2026-11-27 (unsealed checkpoints, DeepSpeed's own files), refused by index.py
FORMAT_VERSION = 3
READABLE_FORMATS = (2, 3)  # 2: whole-file checksums in the manifest; 3: piecewise (manifest.py)
SCALER = "scaler.pt"
STAGING_SUFFIX = ".incomplete"
PREVIOUS_SUFFIX = ".previous"
PRETRAINED_STEM = "model"  # the weights `save_model` writes, in the layout `from_pretrained` reads
RAY_MODEL_DIR = "model"  # where ray_train.report puts `save_model`'s output in a Ray checkpoint

# transformers' Trainer checkpoint (the names transformers.trainer uses; the engine does not import
# transformers)
TRAINER_STATE = "trainer_state.json"
TRAINER_OPTIMIZER = "optimizer.pt"
TRAINER_SCHEDULER = "scheduler.pt"
TRAINER_ARGUMENTS = "training_args.bin"
TRAINER_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# DeepSpeed's engine checkpoint in transformers.Trainer's (not read)
TRAINER_DEEPSPEED_GLOB = "global_step*"
# A model's full weights as transformers' save_pretrained writes them: one file, or shards named by
# an index JSON
PRETRAINED_WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
PRETRAINED_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
PRETRAINED_SINGLE = ("model.safetensors", "pytorch_model.bin")
# A PEFT model's weights in a Trainer checkpoint and in `save_model`'s output, under every strategy:
# its adapter, as PEFT's `save_pretrained` writes it (the frozen base is neither gathered nor
# written)
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")

_AUTOMATIC = re.compile(r"^checkpoint_(\d+)$")


def indexed(stem: str, index: int, ext: str = "") -> str:
    """`model`, `model_1`, ... for the i-th object of a kind."""
    return f"{stem}{'' if index == 0 else f'_{index}'}{ext}"


def model_stem(index: int) -> str:
    return indexed("model", index)


def optimizer_stem(index: int) -> str:
    return indexed("optimizer", index)


@dataclasses.dataclass(frozen=True)
class FullStateFiles:
    """How full (gathered) optimizer and scheduler states are named: `save_state` writes Accelerate's
    `optimizer.bin` / `scheduler.bin`, a Trainer checkpoint transformers' `optimizer.pt` /
    `scheduler.pt`."""

    ext: str

    def optimizer(self, stem: str) -> str:
        return f"{stem}{self.ext}"

    def scheduler(self, index: int) -> str:
        return indexed("scheduler", index, self.ext)


STATE_FILES = FullStateFiles(".bin")
TRAINER_FILES = FullStateFiles(".pt")
TRAINER_WRITER = "hf_backend.Trainer"  # the metadata's "written_by" in a Trainer checkpoint


def state_files(meta: dict) -> FullStateFiles:
    """The names of the full optimizer and scheduler files in a checkpoint with this metadata."""
    return TRAINER_FILES if meta.get("written_by") == TRAINER_WRITER else STATE_FILES


def sharded_dir(stem: str) -> str:
    """The DCP directory every process writes its shards of one model or optimizer into."""
    return f"{stem}_dcp"


def dataloader_file(index: int) -> str:
    return indexed("dataloader", index, ".bin")


def custom_file(index: int) -> str:
    return f"custom_checkpoint_{index}.pkl"


def rng_file(process_index: int) -> str:
    return f"rng_state_{process_index}.pt"


def automatic_dir(project_dir: str | Path, iteration: int) -> Path:
    return Path(project_dir) / "checkpoints" / f"checkpoint_{iteration}"


def automatic_dirs(project_dir: str | Path) -> list[Path]:
    """The automatic checkpoints under `project_dir`, oldest first."""
    root = Path(project_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _AUTOMATIC.match(p.name))]
    return [p for _, p in sorted(found)]


def staging_dir(target: Path) -> Path:
    return target.with_name(target.name + STAGING_SUFFIX)


def previous_dir(target: Path) -> Path:
    return target.with_name(target.name + PREVIOUS_SUFFIX)


def holds_engine_state(directory: str | Path) -> bool:
    """A directory hf_backend wrote its state into (a `save_state` checkpoint, or the engine's part of
    a Trainer's)."""
    return (Path(directory) / METADATA).is_file()


def adapter_weights_file(directory: str | os.PathLike) -> Path | None:
    """The adapter weights PEFT wrote into `directory`, if it holds any."""
    return next((Path(directory) / name for name in ADAPTER_WEIGHTS if (Path(directory) / name).is_file()), None)


def holds_trainer_optimizer(directory: str | Path) -> bool:
    """transformers' own optimizer and scheduler files (either Trainer writes them outside FSDP and
    DeepSpeed)."""
    return (Path(directory) / TRAINER_OPTIMIZER).is_file() and (Path(directory) / TRAINER_SCHEDULER).is_file()
