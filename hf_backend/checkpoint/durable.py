"""Bytes written once, hashed while they are written, and fsynced.

The manifest (manifest.py) needs every file's checksum. Hashing after writing would read every byte
back; here each buffer is hashed as it is written (XXH3 runs at memory speed, so inline). Full
weights are written as safetensors straight from the tensors' memory (no serialized copy of the
whole state dict, as `safetensors.torch.save` and huggingface_hub make); the optimizer's torch file
goes through the same hashing file. Each file is fsynced when closed, and the checkpoint's
directories after its renames (`fsync_tree`, `fsync_dir`): a completed save survives a power cut,
not only a killed process.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from . import manifest

Digests = dict[Path, tuple[int, str]]  # path -> (size, checksum), for manifest.seal

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class HashingFile:
    """A binary file open for writing whose checksum is computed as it is written; `close()` fsyncs it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.digest = manifest.new_digest()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.file.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> tuple[int, str]:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.size, self.digest.hexdigest()



def torch_file(obj: Any, path: Path) -> Digests:
    """`torch.save(obj, path)`, hashed while written and fsynced."""
    out = HashingFile(path)
    try:
        torch.save(obj, out)  # type: ignore[arg-type]  # torch.save needs only write and flush
    finally:
        entry = out.close()
    return {path: entry}


def safetensors_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> Digests:
    """`tensors` as one safetensors file (the format `safetensors.torch.load_file` reads), written from
    the tensors' own memory. Tensors must be on the CPU and of a dtype safetensors knows
    (`writable`)."""
    # as safetensors aligns them
    ordered = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in ordered:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    out = HashingFile(path)
    try:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for _, tensor in ordered:
            if tensor.numel():
                out.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    finally:
        entry = out.close()
    return {path: entry}


def writable(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether `safetensors_file` can write these (CPU tensors of known dtypes)."""
    return all(t.device.type == "cpu" and t.dtype in _DTYPES for t in tensors.values())


def without_aliases(tensors: dict[str, torch.Tensor], tied_keys: list[str] | None) -> dict[str, torch.Tensor]:
    """One name per tensor that several names view (tied weights): the names in `tied_keys` are dropped
    first, as huggingface_hub does; loading accepts a missing tied alias."""
    tied = set(tied_keys or [])
    kept: dict[tuple, str] = {}
    for name in sorted(tensors, key=lambda n: (n in tied, n)):
        t = tensors[name]
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else (name,)
        kept.setdefault(key, name)
    names = set(kept.values())
    return {k: v for k, v in tensors.items() if k in names}


def hash_tree(directory: Path) -> Digests:
    """Every file under `directory` hashed (read back): for files another writer (DCP) wrote."""
    return {p: (p.stat().st_size, manifest.file_digest(p)) for p in sorted(directory.rglob("*")) if p.is_file()}


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory under `directory` (cheap for files already fsynced) and
    `directory` itself."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    """Make the entries of `directory` (a rename into it) durable; a no-op where directories cannot be
    opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        # some filesystems refuse fsync on a directory; their renames are as durable as they get
        pass
    finally:
        os.close(fd)
