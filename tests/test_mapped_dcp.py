"""DCP shards read mapped (hf_backend/checkpoint/mapped_dcp.py): each stored tensor from the mapped file into the
live tensor, equal to what torch's FileSystemReader reads; other forms read as torch reads them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_backend.checkpoint import mapped_dcp
from hf_backend.checkpoint.safe_load import dcp_load


def _state() -> dict:
    torch.manual_seed(0)
    big = torch.randn(10, 12)
    return {"plain": torch.randn(5, 7), "transposed": torch.randn(7, 5).t(), "bf16": torch.randn(33).bfloat16(),
            "int64": torch.arange(10), "view": big[2:5, 3:9], "scalar": torch.tensor(3.5),
            "fp16": torch.randn(4, 4).half(), "bool": torch.rand(6) > 0.5, "int8": torch.randint(-9, 9, (13,)).char(),
            "fp8": torch.randn(8).to(torch.float8_e4m3fn), "step": 7}


def _save(path) -> dict:
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def _load(path, state: dict) -> dict:
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(target, path, no_dist=True)
    return target


def test_every_tensor_equals_what_was_saved_and_plain_ones_come_from_the_mapping(tmp_path, monkeypatch):
    state = _save(tmp_path / "ckpt")
    mapped, built = [], []
    original = mapped_dcp.stored_tensor

    def counting(*args):
        mapped.append(args[2])
        tensor = original(*args)
        built.append(tensor)
        return tensor

    monkeypatch.setattr(mapped_dcp, "stored_tensor", counting)
    loaded = _load(tmp_path / "ckpt", state)
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[name].dtype == value.dtype and torch.equal(loaded[name].reshape(-1).view(torch.uint8),
                                                                     value.reshape(-1).view(torch.uint8)), name
        else:
            assert loaded[name] == value
    assert len(mapped) == 10  # every tensor tried; fp8 (torch's _rebuild_tensor_v3) then read as torch reads it
    assert len(built) == 9  # the other nine came from the mapping, not from torch's reader


class _Payload:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_tensor_record_holding_code_is_not_built_and_nothing_runs(tmp_path):
    """A stored tensor whose data.pkl holds a call: the mapped reader's unpickler builds only tensor layouts, so it
    hands the record to torch's weights_only reading (which refuses it: tests/test_no_pickle.py) and runs nothing."""
    import io
    import mmap
    import pickle
    import zipfile

    saved = io.BytesIO()
    torch.save(torch.randn(4), saved)
    crafted = io.BytesIO()
    with zipfile.ZipFile(saved) as original, zipfile.ZipFile(crafted, "w") as out:
        for info in original.infolist():
            data = original.read(info)
            if info.filename.endswith("data.pkl"):
                data = pickle.dumps(_Payload(tmp_path / "marker"), protocol=2)
            out.writestr(info, data)
    (tmp_path / "item").write_bytes(b"x" * 5 + crafted.getvalue())  # at an offset, as DCP packs items
    with open(tmp_path / "item", "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = memoryview(mapping)
    with pytest.raises(mapped_dcp._NotPlain):
        mapped_dcp.stored_tensor(mapping, view, 5, len(crafted.getvalue()))
    view.release()
    mapping.close()
    assert not (tmp_path / "marker").exists()
