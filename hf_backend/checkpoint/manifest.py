"""The manifest a checkpoint carries: every file with its size and checksum, and a checksum of the metadata itself,
written into the metadata once every process has written its part, and verified before anything is loaded. A
damaged or incomplete checkpoint is one line naming the file and what is wrong, never weights loaded from damaged
bytes. `save_state` checkpoints carry one, and so do hf_backend.Trainer's `checkpoint-{step}` directories (over
transformers' files too).

The files' checksum is XXH3-128: it catches what damages checkpoints (truncation, flipped bits, a torn or replaced
file) and runs at memory speed (about 26 GB/s on one core here, against 1.7 GB/s for SHA-256, which would make
verifying a checkpoint slower than reading it). A cryptographic hash would buy nothing: the manifest is not signed,
so whoever can change a file can rewrite the manifest too (safe_load.py is what keeps a changed file from running
code)."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from ..errors import HfBackendError
from ..log import note
from . import layout

SELF_CHECKSUM = "metadata_sha256"  # of the metadata's other keys: a changed count or a dropped manifest shows
DIGEST = "xxh3_128"  # the key of a file's checksum in a manifest entry


def new_digest() -> Any:
    """An incremental checksum (`update(bytes)`, `hexdigest()`) of the kind `seal` records."""
    return xxhash.xxh3_128()


def file_digest(path: Path) -> str:
    """The file hashed where it lies in the page cache (mapped: about twice the speed of reading it into a buffer,
    which copies every byte first)."""
    digest = new_digest()
    with open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                digest.update(mapped)
    return digest.hexdigest()


def metadata_checksum(meta: dict[str, Any]) -> str:
    """SHA-256 of the metadata's keys but the checksum itself, in a canonical form (sorted keys, no spaces)."""
    body = {k: v for k, v in meta.items() if k != SELF_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(directory: Path, digest: Callable[[Path], str] = file_digest) -> None:
    """Add the manifest of every file under `directory` to its metadata (main process, after all have written). A
    directory without metadata (another process's part, when each process names its own directory) has none.
    `digest`: a file's checksum (the writer's, when it hashed the bytes as it wrote them)."""
    meta_path = directory / layout.METADATA
    if not meta_path.is_file():
        return
    meta = json.loads(meta_path.read_text())
    meta["files"] = {str(p.relative_to(directory)): {"size": p.stat().st_size, DIGEST: digest(p)}
                     for p in sorted(directory.rglob("*")) if p.is_file() and p != meta_path}
    meta[SELF_CHECKSUM] = metadata_checksum(meta)
    temporary = meta_path.with_name(meta_path.name + ".tmp")
    with open(temporary, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, meta_path)


def check_metadata(meta_path: Path, meta: dict[str, Any], caller: str = "load_state") -> None:
    """The metadata's own checksum (every sealed checkpoint of format 2 has one)."""
    if meta.get(SELF_CHECKSUM) != metadata_checksum(meta):
        raise HfBackendError(f"{caller}: {meta_path} does not match its checksum (changed since it was written); "
                             "the checkpoint is damaged, use another one")


def verify(directory: Path, files: Any, checksums: bool = True, caller: str = "load_state") -> None:
    """Every file the manifest lists is there with its size (and, with `checksums`, its checksum). One exception:
    full model weights (`model.safetensors`, its shards and index) that are gone, where weights in that layout were
    written again in their place (transformers' `save_pretrained(max_shard_size=...)` re-sharding a checkpoint's
    weights, as its own tests do), are accepted with a note once the replacement is complete: its index names only
    files that are there, each readable. Their bytes are then not checksummed."""
    if not isinstance(files, dict):
        raise HfBackendError(f"{caller}: {directory / layout.METADATA} has a damaged manifest; use another "
                             "checkpoint")
    weights = {name for name in files if layout.PRETRAINED_WEIGHTS.match(name)}
    resaved = weights and not all((directory / name).exists() for name in weights) and _resaved_weights(directory)
    for name, expected in files.items():
        if resaved and name in weights:
            continue
        path = directory / name
        problem = _problem(path, expected, checksums)
        if problem:
            raise HfBackendError(f"{caller}: {path} {problem}; the checkpoint is damaged, use another one")
    if resaved:
        note(f"{caller}: the weights in {directory} were written again after the checkpoint was sealed ({resaved}); "
             "they are checked for completeness, not against the manifest's checksums")


def _resaved_weights(directory: Path) -> str | None:
    """The weights file or index that replaced the sealed weights, when the replacement is complete, else None."""
    from safetensors import safe_open

    for index in layout.PRETRAINED_INDEXES:
        path = directory / index
        if not path.is_file():
            continue
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
            shards = {str(name) for name in weight_map.values()}
            for shard in shards:
                if Path(shard).name != shard or not (directory / shard).is_file():
                    return None
                if shard.endswith(".safetensors"):
                    with safe_open(directory / shard, "pt") as f:
                        if not {k for k, v in weight_map.items() if v == shard} <= set(f.keys()):
                            return None
        except Exception:  # unreadable: not JSON, no weight_map, a damaged safetensors header
            return None
        return index
    return next((name for name in layout.PRETRAINED_SINGLE if (directory / name).is_file()), None)


def _problem(path: Path, expected: Any, checksums: bool) -> str | None:
    if not isinstance(expected, dict) or DIGEST not in expected or "size" not in expected:
        return "has a damaged manifest entry"
    try:
        if path.is_dir():
            return "is a directory where the manifest lists a file"
        if not path.is_file():
            return "is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"has {size} bytes where {expected['size']} were written (truncated or replaced)"
        if checksums and file_digest(path) != expected[DIGEST]:
            return "does not match its checksum (changed since it was written)"
    except OSError as err:  # a directory on the way that this process may not enter, a file it may not read
        return f"cannot be read ({type(err).__name__})"
    return None
