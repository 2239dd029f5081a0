"""No code in a checkpoint runs on load (issue 18, item 4): each kind of file hf_backend reads, replaced by a pickle
whose `__reduce__` would create a marker file, with the manifest re-sealed so that its checksums do not catch it
first (whoever can replace a file can rewrite the manifest): the load is one line naming the file and what it
refused, the marker does not appear, and the model keeps its weights."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, TensorDataset

from hf_backend import Accelerator, HfBackendError
from hf_backend.checkpoint import manifest
from hf_backend.checkpoint.consolidate import convert
from hf_backend.checkpoint.safe_load import SafeEmptyPlanner, dcp_load, read_dcp_metadata


class Payload:
    """Unpickled in full, this creates `marker` (the stand-in for any code an attacker's pickle runs)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@dataclasses.dataclass
class Note:
    text: str


class Progress:
    def __init__(self) -> None:
        self.seen = 0
        self.note = Note("x")

    def state_dict(self) -> dict:
        return {"seen": self.seen, "note": self.note, "numpy": np.arange(3.0), "scalar": np.int64(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.note = state["seen"], state["note"]
        assert state["numpy"].tolist() == [0.0, 1.0, 2.0] and state["scalar"] == self.seen  # numpy: allowed as is


class Counter:
    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def setup(custom=None, model=None):
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = model or torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.ones(8, 4)), batch_size=2)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    accelerator.register_for_checkpointing(custom or Counter())
    return accelerator, model, optimizer


def step(accelerator, model, optimizer):
    accelerator.backward(model(torch.ones(2, 4)).square().sum())
    optimizer.step()
    optimizer.zero_grad()


def poison(path: Path, marker: Path) -> None:
    """`path` replaced by a pickle of the payload, in the format a loader of that file expects."""
    if path.name == ".metadata":  # DCP pickles its metadata with plain pickle
        import pickle

        path.write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save(Payload(marker), path)
    manifest.seal(path.parent if (path.parent / "hf_backend_checkpoint.json").is_file() else path.parent.parent)


def assert_refused(accelerator, model, checkpoint: Path, path: Path, marker: Path) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HfBackendError) as caught:
        accelerator.load_state(checkpoint)
    message = str(caught.value)
    assert "\n" not in message
    assert re.match(rf"^load_state: {re.escape(str(path))} holds a pickled (io|_io|builtins)?\.?open\b", message), \
        message
    assert "use another checkpoint" in message
    assert ("add_safe_globals" in message) != path.name.endswith("metadata")  # no advice that would not help
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


FILES = ["optimizer.bin", "scheduler.bin", "dataloader.bin", "custom_checkpoint_0.pkl", "rng_state_0.pt"]


@pytest.mark.parametrize("name", [*FILES, "model.bin"])
def test_a_torch_file_holding_code_is_refused(tmp_path, name):
    accelerator, model, optimizer = setup()
    step(accelerator, model, optimizer)
    accelerator.save_state(tmp_path / "ckpt", safe_serialization=name != "model.bin")
    poison(tmp_path / "ckpt" / name, tmp_path / "marker")
    step(accelerator, model, optimizer)
    assert_refused(accelerator, model, tmp_path / "ckpt", tmp_path / "ckpt" / name, tmp_path / "marker")


def fsdp_checkpoint(tmp_path: Path) -> tuple:
    """A sharded checkpoint (model_dcp/, optimizer_dcp/, as FSDP's SHARDED_STATE_DICT writes it: here converted from
    a full one), and the model it was written from."""
    accelerator, model, optimizer = setup(None, torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                                                    torch.nn.Linear(8, 2)))
    step(accelerator, model, optimizer)
    accelerator.save_state(tmp_path / "full")
    convert(tmp_path / "full", tmp_path / "ckpt", "sharded")
    return accelerator, model, optimizer


@pytest.mark.parametrize("name", ["model_dcp/.metadata", "optimizer_dcp/.metadata"])
def test_a_dcp_metadata_holding_code_is_refused(tmp_path, name):
    """Resealed after the change: the manifest checks out, and the reader is what refuses."""
    accelerator, model, _ = fsdp_checkpoint(tmp_path)
    accelerator.load_state(tmp_path / "ckpt")  # loads as it is
    path = tmp_path / "ckpt" / name
    poison(path, tmp_path / "marker")
    with torch.no_grad():
        model[0].weight.add_(1)
    assert_refused(accelerator, model, tmp_path / "ckpt", path, tmp_path / "marker")


def test_a_value_in_dcp_shards_holding_code_is_refused(tmp_path):
    """DCP stores non-tensor values (the optimizer's learning rate) as pickles; torch's planner loads them in full."""
    accelerator, model, _ = fsdp_checkpoint(tmp_path)
    shards = tmp_path / "ckpt" / "optimizer_dcp"
    state: dict = {}
    dcp_load(state, shards, no_dist=True, empty=True)
    state["optimizer"]["param_groups"][0]["lr"] = Payload(tmp_path / "marker")
    shutil.rmtree(shards)
    dcp.save(state, checkpoint_id=str(shards), no_dist=True)
    manifest.seal(tmp_path / "ckpt")  # the manifest checks out: the reader is what refuses
    with torch.no_grad():
        model[0].weight.add_(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HfBackendError, match=rf"^load_state: {re.escape(str(shards))}/__0_0.distcp \(value "
                                             r"optimizer.param_groups.0.lr\) holds a pickled (io|_io)?\.?open\b"):
        accelerator.load_state(tmp_path / "ckpt")
    assert not (tmp_path / "marker").exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(HfBackendError, match=r"value optimizer.param_groups.0.lr\) holds a pickled"):
        dcp_load({}, shards, no_dist=True, empty=True)  # the planner itself refuses too (the Trainer's path)
    assert not (tmp_path / "marker").exists()
    assert isinstance(SafeEmptyPlanner(), dcp.DefaultLoadPlanner)


def test_a_dcp_directory_the_manifest_does_not_list_is_not_read(tmp_path):
    """A checkpoint written with full weights, then given a model_dcp/ (with code in it): the loader reads the
    files the manifest lists, the planted directory not at all."""
    accelerator, model, optimizer = setup()
    step(accelerator, model, optimizer)
    accelerator.save_state(tmp_path / "ckpt")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    planted = tmp_path / "ckpt" / "model_dcp"
    planted.mkdir()
    (planted / ".metadata").write_bytes(__import__("pickle").dumps(Payload(tmp_path / "marker")))
    step(accelerator, model, optimizer)
    with pytest.raises(HfBackendError, match="model_dcp/.metadata holds a pickled"):
        read_dcp_metadata(planted)
    accelerator.load_state(tmp_path / "ckpt")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "marker").exists()


def test_a_registered_object_of_other_types_loads_once_allowed(tmp_path):
    progress = Progress()
    accelerator, model, optimizer = setup(progress)
    progress.note = Note("kept")
    accelerator.save_state(tmp_path / "ckpt")
    progress.note = Note("changed")
    path = re.escape(str(tmp_path / "ckpt" / "custom_checkpoint_0.pkl"))
    with pytest.raises(HfBackendError, match=rf"^load_state: {path} holds a pickled test_no_pickle.Note, which is not "
                                             r"plain data .* torch.serialization.add_safe_globals\(\[test_no_pickle."
                                             r"Note\]\) before loading, else use another checkpoint$"):
        accelerator.load_state(tmp_path / "ckpt")
    assert progress.note == Note("changed")
    with torch.serialization.safe_globals([Note]):
        accelerator.load_state(tmp_path / "ckpt")
    assert progress.note == Note("kept")


def test_the_scaler_file_holding_code_is_refused(tmp_path):
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    if accelerator.scaler is None:
        pytest.skip("no fp16 gradient scaler on this device")
    model = torch.nn.Linear(4, 2)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(tmp_path / "ckpt")
    poison(tmp_path / "ckpt" / "scaler.pt", tmp_path / "marker")
    assert_refused(accelerator, model, tmp_path / "ckpt", tmp_path / "ckpt" / "scaler.pt", tmp_path / "marker")
