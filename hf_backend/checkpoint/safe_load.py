"""Reading a checkpoint runs no code from it.

A pickle can name any function and have the unpickler call it, so no file of a checkpoint is
unpickled in full:

* torch files (optimizer, scheduler, data loader, registered objects, scaler, random states, `.bin`
  weights) go through `torch.load(weights_only=True)`: plain data and the types torch allows, plus
  those the user allowed with `torch.serialization.add_safe_globals`;
* a DCP directory's `.metadata` (plain `pickle` in torch) through an unpickler that builds only
  DCP's metadata dataclasses, `torch.Size`, dtypes, layouts and paths, its shard files through
  `torch.load(weights_only=True)` for tensors and for the non-tensor values too (torch's own planner
  unpickles those in full);

and a refusal is one line naming the file, what it would have run, and the fix (torch's own is six
lines that do not name the file). The manifest's checksums do not make this unnecessary: whoever can
replace a file can rewrite the manifest too.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import io
import os
import pathlib
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ..core.errors import HfBackendError
from .mapped_dcp import MappedReader

_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")
_BLOCKED = re.compile(r"unsupported GLOBAL (\S+) whose module")
_REDUCE = re.compile(r"call reduce for unrecognized function (.+?)(?: which belongs|$)", re.M)


def torch_load(path: str | os.PathLike, what: str = "load_state", mmap: bool = False) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU; a refusal or an unreadable file is one
    HfBackendError line.
    `mmap`: tensors map the file (read from the page cache when used) instead of being read into
    fresh memory, for a caller that copies them into tensors that exist; a file in torch's legacy
    format is read whole."""
    path = Path(path)
    if not path.is_file():
        raise HfBackendError(f"{what}: {path} is missing; the checkpoint "
                             "is incomplete, use another one")
    try:
        with _numpy_arrays():
            if mmap and _zip_format(path):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise refusal(path, err, what) from None
    except (RuntimeError, EOFError, ValueError) as err:
        raise HfBackendError(f"{what}: {path} cannot be read as a torch file ({_first_line(err)}); "
                             "the checkpoint is damaged, use another one") from None


def _zip_format(path: Path) -> bool:
    """torch.save's zip format (the only one torch.load maps); the legacy format is a bare pickle.
    """
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


@contextlib.contextmanager
def _numpy_arrays() -> Iterator[None]:
    """numpy arrays and scalars allowed too, as Accelerate and transformers allow arrays (a registered
    object's state may hold some): rebuilt from their bytes, they run nothing. Only globals not
    allowed already are added, and removed after."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    wanted = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    wanted += sorted({type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"}, key=lambda t: t.__name__)
    have = set(torch.serialization.get_safe_globals())
    added = [g for g in wanted if g not in have]
    torch.serialization.add_safe_globals(added)
    try:
        yield
    finally:
        from torch import _weights_only_unpickler

        _weights_only_unpickler._remove_safe_globals(added)


def refusal(path: str | os.PathLike, err: BaseException, what: str = "load_state") -> HfBackendError:
    """What an unpickler refused, as one line naming the file and the fix."""
    message = str(err)
    if (found := _BLOCKED.search(message)) is not None:
        return HfBackendError(f"{what}: {path} holds a pickled call to {found.group(1)}, which "
                              "loading would run and which is never allowed; this is not a "
                              "checkpoint hf_backend wrote, use another one")
    if (found := _REFUSED_GLOBAL.search(message)) is not None:
        name = found.group(1)
        return HfBackendError(
            f"{what}: {path} holds a pickled {name}, which is not plain data and was not loaded "
            f"(unpickling it could run code); if {name} is a class of yours and you trust the "
            f"file, allow it with torch.serialization.add_safe_globals([{name}]) before loading, "
            "else use another checkpoint")
    if (found := _REDUCE.search(message)) is not None:
        return HfBackendError(f"{what}: {path} holds a pickled call to "
                              f"{found.group(1).strip()}, which was not run; this is "
                              "not a checkpoint hf_backend wrote, use another one")
    return HfBackendError(f"{what}: {path} holds pickled data that is not plain data "
                          f"({_first_line(err)}) and was not loaded; use another checkpoint")


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    wo = [line for line in lines if "WeightsUnpickler error:" in line]
    text = (wo[0].split("WeightsUnpickler "
                        "error:", 1)[1] if wo else lines[-1] if lines else type(err).__name__)
    return text.strip()[:200]


# -- DCP -------------------------------------------------------------------------------------------
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What DCP's `.metadata` pickles: its metadata dataclasses and enum, the storage info, torch.Size,
    dtypes, layouts (by name) and the checkpoint's path."""
    allowed: list[Any] = [value for value in vars(dcp_metadata).values()
                          if isinstance(value, type) and value.__module__ == dcp_metadata.__name__
                          and (hasattr(value, "__dataclass_fields__") or issubclass(value, enum.Enum))]
    allowed += [_StorageInfo, torch.Size, torch.serialization._get_layout]
    found = {(value.__module__, value.__qualname__): value for value in allowed}
    found.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    found.update({("pathlib", cls.__name__): cls for cls in (pathlib.PosixPath, pathlib.WindowsPath,
                                                             pathlib.PurePosixPath, pathlib.PureWindowsPath)})
    found[("collections", "OrderedDict")] = collections.OrderedDict
    return found


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: any other global is refused before it is looked up.
    """

    allowed = _metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError("Unsupported global: GLOBAL "
                                         f"{module}.{name} was not an allowed global")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id, which DCP's metadata never holds")


def read_dcp_metadata(directory: str | os.PathLike, what: str = "load_state") -> dcp_metadata.Metadata:
    """A DCP directory's `.metadata`, unpickled safely; its shard files must lie in the directory.
    """
    path = Path(directory) / ".metadata"
    if not path.is_file():
        raise HfBackendError(f"{what}: {path} is missing; the checkpoint "
                             "is incomplete, use another one")
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        found = _REFUSED_GLOBAL.search(str(err))
        held = f"a pickled {found.group(1)}" if found else "pickled data other than DCP's metadata"
        raise HfBackendError(f"{what}: {path} holds {held}, which DCP's metadata "
                             "never does, and was not loaded (unpickling it "
                             "could run code); use another checkpoint") from None
    except (EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError) as err:
        raise HfBackendError(f"{what}: {path} is not DCP metadata ({type(err).__name__}); the "
                             "checkpoint is damaged, use another one") from None
    if not isinstance(meta, dcp_metadata.Metadata) or not isinstance(meta.storage_data, dict):
        raise HfBackendError(f"{what}: {path} is not DCP metadata ({type(meta).__name__}); use "
                             "another checkpoint")
    for info in meta.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise HfBackendError(f"{what}: {path} points outside its directory ({name!r}); use "
                                 "another checkpoint")
    return meta


def check_dcp(directory: str | os.PathLike, what: str = "load_state") -> dcp_metadata.Metadata:
    """Read a DCP directory's metadata and every non-tensor value in it, safely, before anything is
    loaded from it: a refusal then leaves the model as it was (dcp.load writes tensors into the
    model as it reads them)."""
    directory = Path(directory)
    meta = read_dcp_metadata(directory, what)
    values = {fqn for fqn, kind in meta.state_dict_metadata.items()
              if isinstance(kind, dcp_metadata.BytesStorageMetadata)}
    for index, info in meta.storage_data.items():
        if getattr(index, "fqn", None) not in values or getattr(info, "transform_descriptors", None):
            # a tensor; or a value written through a DCP extension (hf_backend uses none): the
            # planner's
            continue
        path = directory / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                data = io.BytesIO(f.read(info.length))
            torch.load(data, weights_only=True)
        except pickle.UnpicklingError as err:
            raise refusal(f"{path} (value {index.fqn})", err, what) from None
        except (OSError, RuntimeError, EOFError, ValueError, TypeError) as err:
            raise HfBackendError(f"{what}: {path} (value {index.fqn}) cannot be "
                                 f"read ({_first_line(err)}); the checkpoint is "
                                 "damaged, use another one") from None
    return meta


class SafeFileSystemReader(MappedReader):
    """torch's FileSystemReader, its tensors read mapped (mapped_dcp.py), but for `.metadata`: read by
    `read_dcp_metadata` when the reader is made, so that a refusal is raised as it is (inside
    `dcp.load` torch would wrap it and try per-rank files instead)."""

    def __init__(self, path: str | os.PathLike, what: str = "load_state") -> None:
        super().__init__(path)
        self.metadata = read_dcp_metadata(path, what)

    # no **kwargs: DCP then never looks for per-rank metadata
    def read_metadata(self) -> dcp_metadata.Metadata:
        storage_meta = getattr(self.metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = self.metadata.storage_meta = dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        return self.metadata


class _SafeBytes:
    """A non-tensor value of a DCP checkpoint through `torch.load(weights_only=True)` (torch's planner:
    in full)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise refusal(f"{getattr(self, 'directory', 'a DCP directory')} "
                          f"(value {fqn})", err) from None
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[fqn] = obj  # type: ignore[attr-defined]


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """`dcp.load`'s default planner, non-tensor values loaded safely."""


class SafeEmptyPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata (one process, no model), non-tensor values
    loaded safely."""


def dcp_load(state_dict: dict[str, Any], directory: str | os.PathLike, *, no_dist: bool = False,
             empty: bool = False, what: str = "load_state") -> None:
    """`dcp.load` into `state_dict` from `directory`, every byte read safely; a refusal on any process
    is the same one line on every process. `empty`: fill the empty `state_dict` from the metadata
    (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeFileSystemReader(directory, what)
    planner: _SafeBytes = SafeEmptyPlanner() if empty else SafeLoadPlanner()
    planner.directory = str(directory)  # type: ignore[attr-defined]
    try:
        # dcp.load would fill a copy of the dict (torch's format_utils calls this one too)
        if empty:
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

            _load_state_dict(state_dict, storage_reader=reader, planner=planner, no_dist=True)  # type: ignore[arg-type]
        else:
            dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as err:
        failures = [exc for exc, _ in err.failures.values()]
        for exc in failures:
            if isinstance(exc, HfBackendError):
                raise HfBackendError(str(exc)) from None
        for exc in failures:
            if isinstance(exc, pickle.UnpicklingError):
                raise refusal(f"a shard file in {directory}", exc, what) from None
        raise


__all__ = ["SafeEmptyPlanner", "SafeFileSystemReader", "SafeLoadPlanner", "check_dcp", "dcp_load", "read_dcp_metadata",
           "refusal", "torch_load"]
