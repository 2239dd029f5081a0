"""The manifest a `save_state` checkpoint carries: every file with its size and SHA-256, written into the metadata
once every process has written its part, and verified before anything is loaded. A damaged or incomplete
checkpoint is one line naming the file and what is wrong, never weights loaded from damaged bytes."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import HfBackendError
from . import layout

_CHUNK = 1 << 20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def seal(directory: Path, digest: Callable[[Path], str] = sha256) -> None:
    """Add the manifest of every file under `directory` to its metadata (main process, after all have written). A
    directory without metadata (another process's part, when each process names its own directory) has none.
    `digest`: a file's SHA-256 (the writer's, when it hashed the bytes as it wrote them)."""
    meta_path = directory / layout.METADATA
    if not meta_path.is_file():
        return
    meta = json.loads(meta_path.read_text())
    meta["files"] = {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": digest(p)}
                     for p in sorted(directory.rglob("*")) if p.is_file() and p != meta_path}
    temporary = meta_path.with_name(meta_path.name + ".tmp")
    with open(temporary, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, meta_path)


def verify(directory: Path, files: Any, checksums: bool = True) -> None:
    """Every file the manifest lists is there with its size (and, with `checksums`, its SHA-256)."""
    if not isinstance(files, dict):
        raise HfBackendError(f"load_state: {directory / layout.METADATA} has a damaged manifest; use another "
                             "checkpoint")
    for name, expected in files.items():
        path = directory / name
        problem = _problem(path, expected, checksums)
        if problem:
            raise HfBackendError(f"load_state: {path} {problem}; the checkpoint is damaged, use another one")


def _problem(path: Path, expected: Any, checksums: bool) -> str | None:
    if not isinstance(expected, dict) or not {"size", "sha256"} <= set(expected):
        return "has a damaged manifest entry"
    if path.is_dir():
        return "is a directory where the manifest lists a file"
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != expected["size"]:
        return f"has {size} bytes where {expected['size']} were written (truncated or replaced)"
    if checksums:
        try:
            digest = sha256(path)
        except OSError as err:
            return f"cannot be read ({type(err).__name__})"
        if digest != expected["sha256"]:
            return "does not match its checksum (changed since it was written)"
    return None
