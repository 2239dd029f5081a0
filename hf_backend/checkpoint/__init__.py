"""Checkpoints: every file hf_backend writes or reads to save and resume training, and nothing else
does.

    layout.py       every name in a checkpoint directory (and the layout itself, documented there)
    files.py        how bytes are written and read: safetensors weights, torch files, random generator states
    directories.py  staging + rename (a save appears complete or not at all), automatic naming, rotation,
                    which Trainer checkpoint to resume and whether it can be
    durable.py      large files hashed while written (for the manifest) and fsynced; safetensors from tensor memory
    async_save.py   where a save's large writes go: now, or host memory then a writer thread (async save_state)
    manifest.py     every file's size and checksum (pieces of XXH3-128), checked before anything loads
    index.py        CheckpointIndex: what a checkpoint holds, read once from its verified metadata and manifest
    state_io.py     CheckpointIO: a set of prepared objects to files and back, the strategy saying what each state is
    safe_load.py    every read of a torch file or a DCP directory, none of which can run code from the file
    mapped_dcp.py   DCP's reader, each stored tensor read from the mapped file straight into the live one
    inspect.py      `hf-backend checkpoint inspect`: what a checkpoint holds and whether it verifies
    consolidate.py  `hf-backend checkpoint consolidate / convert`: weights for from_pretrained, full <-> sharded
    adapters.py     a PEFT adapter's saved names to the prepared model's
"""

from __future__ import annotations

from . import adapters, layout, manifest
from .directories import (
    automatic_dir,
    check_trainer_checkpoint,
    last_complete_trainer_checkpoint,
    latest_automatic_checkpoint,
    rotate,
)
from .files import load_file, save_object
from .index import CheckpointIndex, read_index
from .state_io import CheckpointIO, apply_load_hooks, apply_save_hooks

__all__ = ["CheckpointIO", "CheckpointIndex", "adapters", "apply_load_hooks", "apply_save_hooks", "automatic_dir",
           "check_trainer_checkpoint", "last_complete_trainer_checkpoint", "latest_automatic_checkpoint", "layout",
           "load_file", "manifest", "read_index", "rotate", "save_object"]
