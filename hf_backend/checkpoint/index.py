"""`CheckpointIndex`: what an hf_backend checkpoint holds, read once from its metadata and manifest.

Every question about a checkpoint's storage (is this model's state sharded, what is the optimizer
file called, how many of each object, who wrote it) is answered here, from the metadata `read_index`
verified, never by looking at the directory again: a file or directory added after the save is not
part of the checkpoint. Format 2 is the first whose every checkpoint is sealed (manifest.py) and
stores model and optimizer states in the two strategy-neutral forms (full files or DCP shards); a
format-1 checkpoint (an hf_backend before 2026-11-27: unsealed, or DeepSpeed's own files) is one
line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..core.errors import HfBackendError
from ..core.notes import note
from . import layout, manifest


class CheckpointIndex:
    """The verified metadata of the checkpoint in `directory` (built by `read_index`)."""

    def __init__(self, directory: Path, meta: dict[str, Any]) -> None:
        self.directory = directory
        self.meta = meta
        self.files = layout.state_files(meta)  # the names of its full optimizer and scheduler files
        self._dirs = {Path(name).parts[0] for name in meta["files"] if len(Path(name).parts) > 1}

    @property
    def counts(self) -> dict[str, int]:
        return self.meta["counts"]

    @property
    def written_by_trainer(self) -> bool:
        return self.meta.get("written_by") == layout.TRAINER_WRITER

    def sharded(self, stem: str) -> bool:
        """Whether model or optimizer `stem` is stored as each process's DCP shards (else as full
        files)."""
        return layout.sharded_dir(stem) in self._dirs

    def shards(self, stem: str) -> Path:
        return self.directory / layout.sharded_dir(stem)

    def optimizer_file(self, stem: str) -> Path:
        return self.directory / self.files.optimizer(stem)

    def scheduler_file(self, index: int) -> Path:
        return self.directory / self.files.scheduler(index)


def read_index(source: str | os.PathLike, checksums: bool = True, caller: str = "load_state",
               sharing: manifest.Sharing | None = None) -> CheckpointIndex:
    """The checkpoint at `source`, once its format version and manifest check out (`checksums`: hash
    every file;
    `sharing`: the processes of a machine divide that, manifest.py). Whatever is wrong is one line
    naming the file (`caller` starts it)."""
    source = _interrupted_overwrite(Path(source))
    if not source.is_dir():
        raise HfBackendError(f"{caller}: no checkpoint directory at "
                             f"{source}; pass the directory save_state wrote")
    meta_path = source / layout.METADATA
    path = source
    try:
        os.listdir(source)  # pathlib would report the files of an unreadable directory as missing
        path = meta_path
        text = _read_metadata_file(meta_path, source, caller)
    except OSError as err:
        raise HfBackendError(f"{caller}: {path} cannot be read ({type(err).__name__}); give this "
                             "process read access to it") from None
    meta = _parse_metadata(meta_path, text, caller)
    version = meta.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):  # True == 1 in Python
        raise HfBackendError(f"{caller}: {meta_path} has no valid 'format_version'; the checkpoint "
                             "is damaged, use another one")
    if version == 1:
        raise HfBackendError(f"{caller}: {source} is a format-1 checkpoint (written by an "
                             "hf_backend before 2026-11-27); this hf_backend reads formats "
                             f"{_readable()}: load it with the hf_backend that wrote it")
    if version not in layout.READABLE_FORMATS:
        raise HfBackendError(f"{caller}: {meta_path} has format_version {version}; "
                             f"this hf_backend reads formats {_readable()}: load "
                             "it with the hf_backend that wrote it, or upgrade")
    # after the version: a newer format may seal otherwise
    manifest.check_metadata(meta_path, meta, caller)
    for key, kind in (("num_processes", int), ("counts", dict), ("files", dict)):
        if not isinstance(meta.get(key), kind):
            raise HfBackendError(f"{caller}: {meta_path} has no valid {key!r}; the checkpoint is "
                                 "damaged, use another one")
    manifest.verify(source, meta["files"], checksums, caller, sharing)
    return CheckpointIndex(source, meta)


def _readable() -> str:
    return " and ".join(map(str, layout.READABLE_FORMATS))


def _interrupted_overwrite(source: Path) -> Path:
    """`source`, or the complete checkpoint an overwriting save of it left in `source.previous` when it
    was killed between its two renames (directories.py)."""
    previous = layout.previous_dir(source)
    if not source.exists() and (previous / layout.METADATA).is_file():
        note(f"{source} is missing but {previous} holds the checkpoint an interrupted save was "
             "replacing; loading it")
        return previous
    return source


def _read_metadata_file(meta_path: Path, source: Path, caller: str) -> str:
    if meta_path.is_dir():
        raise HfBackendError(f"{caller}: {meta_path} is a directory where the metadata file should "
                             "be; the checkpoint is damaged, use another one")
    if not meta_path.is_file():
        raise HfBackendError(f"{caller}: {source} is not an hf_backend checkpoint (no "
                             f"{layout.METADATA}); pass a directory written by "
                             "Accelerator.save_state")
    try:
        return meta_path.read_bytes().decode()
    except UnicodeDecodeError:
        raise HfBackendError(f"{caller}: {meta_path} is corrupt (not UTF-8 "
                             "text); use another checkpoint") from None


def _parse_metadata(meta_path: Path, text: str, caller: str) -> dict[str, Any]:
    if not text.strip():
        raise HfBackendError(f"{caller}: {meta_path} is empty; use another checkpoint")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        raise HfBackendError(f"{caller}: {meta_path} is corrupt (line "
                             f"{err.lineno}); use another checkpoint") \
            from None
    if not isinstance(meta, dict):
        raise HfBackendError(f"{caller}: {meta_path} is corrupt (not "
                             "a JSON object); use another checkpoint")
    return meta


__all__ = ["CheckpointIndex", "read_index"]
