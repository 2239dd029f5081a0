"""DCP shards read where they lie in the page cache, straight into the tensors that hold them.

torch's `FileSystemReader` `torch.load`s every stored tensor (each one a small `torch.save` zip
inside a `.distcp` file) into fresh memory, then copies the part a rank needs into its shard: two
copies, and most of a sharded `load_state` (docs/benchmarks.md). `MappedReader` maps each file once
and reads each stored tensor's zip itself: its `data.pkl` through an unpickler that builds nothing
but the tensor's layout (dtype, size, stride, offset: no code can run), its storage as a view of the
mapping; the part the rank needs is then copied once into the live tensor. A stored item in any
other form (a DCP extension's transform, a storage type this unpickler does not know, a big- endian
file) is read as torch reads it. The files are those torch writes: nothing changes on disk.
"""

from __future__ import annotations

import io
import mmap
import pickle
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future


class _Layout(pickle.Unpickler):
    """A `torch.save`d tensor's `data.pkl`, down to (storage key, dtype, storage offset, size, stride).
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: (*storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return dict  # backward hooks / metadata: always empty for a tensor DCP stores
        if module != "torch" or name not in _STORAGE_DTYPES:
            raise _NotPlain(f"{module}.{name}")
        # stands for its storage class: the dtype is all that is used of it
        return _STORAGE_DTYPES[name]

    def persistent_load(self, pid: Any) -> Any:
        kind, dtype, key, _location, _numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise _NotPlain(str(kind))
        return key, dtype


# torch.save names a storage's dtype by its legacy storage class (read by name: touching the classes
# warns)
_STORAGE_DTYPES = {"DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool}


class _NotPlain(Exception):
    """Not a plain tensor in torch's zip format: read it as torch does."""


class _Window(io.RawIOBase):
    """A seekable, read-only file over a memoryview (what zipfile needs, without copying the bytes).
    """

    def __init__(self, view: memoryview) -> None:
        self.view, self.position = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.view)}[whence]
        self.position = base + offset
        return self.position

    def readinto(self, buffer: Any) -> int:
        data = self.view[self.position:self.position + len(buffer)]
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


def stored_tensor(mapping: mmap.mmap, view: memoryview, start: int, length: int) -> torch.Tensor:
    """The tensor `torch.save` wrote at `mapping[start:start + length]` (`view`: a memoryview of it),
    as a view of the mapping; `_NotPlain` if it is not a plain little-endian tensor record."""
    window = view[start:start + length]
    try:
        with zipfile.ZipFile(_Window(window)) as archive:
            records = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
            if "byteorder" in records and archive.read(records["byteorder"]) != b"little":
                raise _NotPlain("byteorder")
            key, dtype, offset, size, stride = _Layout(io.BytesIO(archive.read(records["data.pkl"]))).load()
            record = records[f"data/{key}"]
            if record.compress_type != zipfile.ZIP_STORED:
                raise _NotPlain("compressed")
            header = window[record.header_offset:record.header_offset + 30]
            data = record.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
                int.from_bytes(header[28:30], "little")
    except _NotPlain:
        raise
    except Exception as err:  # noqa: BLE001 - anything unexpected in the record: torch's reading reports it
        raise _NotPlain(type(err).__name__) from None
    finally:
        window.release()
    if data + record.file_size > length:
        raise _NotPlain("a record past the item's end")
    # the records start 64-byte aligned in the zip, which
    itemsize = torch.empty(0, dtype=dtype).element_size()
    try:  # DCP packs at any offset: frombuffer takes it unaligned
        storage = torch.frombuffer(mapping, dtype=dtype, count=record.file_size // itemsize, offset=start + data) \
            if record.file_size >= itemsize else torch.empty(0, dtype=dtype)
        return storage.as_strided(size, stride, offset)
    # a layout the bytes cannot hold: torch's own reading reports it
    except (RuntimeError, ValueError) as err:
        raise _NotPlain(str(err)) from None


@contextmanager
def _mapped(path: Path) -> Iterator[tuple[mmap.mmap, memoryview]]:
    with open(path, "rb") as f:
        # copy-on-write (never written): a writable mapping makes torch views of it without a
        # read-only warning
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = memoryview(mapping)
    try:
        yield mapping, view
    finally:
        view.release()
        try:
            mapping.close()
        # a view still held by an exception on its way out: unmapped when that goes
        except BufferError:
            pass


class MappedReader(FileSystemReader):
    """torch's `FileSystemReader`, each stored tensor read from the mapped file into the live tensor
    (module docstring)."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        slow = []
        for relative_path, items in per_file.items():
            with _mapped(Path(self.path) / relative_path) as (mapping, view):
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    if item.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                        slow.append(item)
                        continue
                    try:
                        stored = stored_tensor(mapping, view, info.offset, info.length)
                    except _NotPlain:
                        slow.append(item)
                        continue
                    target = planner.resolve_tensor(item).detach()
                    part = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
                    if target.size() != part.size():
                        raise ValueError(f"{relative_path}: {item.storage_index.fqn} "
                                         f"has size {tuple(part.size())} where "
                                         f"{tuple(target.size())} was expected")
                    target.copy_(part)
                    planner.commit_tensor(item, target)
                    del stored, part
        if slow:  # values, and tensors in a form read as torch reads them
            super().read_data(LoadPlan(slow, plan.storage_data, plan.planner_data), planner).wait()
        future: Future[None] = Future()
        future.set_result(None)
        return future


__all__ = ["MappedReader", "stored_tensor"]
