"""Async `save_state`: it returns once the state is in host memory, the checkpoint appears (complete, renamed, rotated)
only when the background writes are done, the next save / load / end_training waits for it, and a failed write is
one line with no checkpoint left behind. Also: the writer that hashes while writing, and fsync."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest
import torch
from helpers import Regression, run_script
from safetensors.torch import load_file, save_file

from hf_backend import Accelerator, HfBackendError, ProjectConfiguration
from hf_backend.checkpoint import durable, manifest


def setup(config=None):
    accelerator = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    step(accelerator, model, optimizer)
    return accelerator, model, optimizer


def step(accelerator, model, optimizer):
    accelerator.backward(model(torch.ones(3, 6)).square().sum())
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture
def held(monkeypatch):
    """Background writes of optimizer files wait until `held.set()` (at most 20 s): the test sees a save under way.
    Synchronous saves (on the main thread) are not held."""
    gate = threading.Event()
    write = durable.torch_file

    def slow(obj, path):
        if threading.current_thread() is not threading.main_thread():
            gate.wait(20)
        return write(obj, path)

    monkeypatch.setattr(durable, "torch_file", slow)
    yield gate
    gate.set()


def loaded_state(directory):
    accelerator, model, optimizer = setup()
    accelerator.load_state(directory)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step(accelerator, model, optimizer)  # depends on the optimizer's moments and step count
    return before, model.state_dict()


def test_async_save_loads_as_the_sync_one_and_later_steps_do_not_leak(tmp_path, held):
    accelerator, model, optimizer = setup()
    accelerator.save_state(tmp_path / "sync")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert accelerator.save_state(tmp_path / "async", async_save=True) == str(tmp_path / "async")
    assert (tmp_path / "async.incomplete").is_dir() and not (tmp_path / "async").exists()
    step(accelerator, model, optimizer)  # while the save is held: the live tensors change
    held.set()
    accelerator.wait_for_checkpoint()
    assert not (tmp_path / "async.incomplete").exists()
    sync, asynchronous = loaded_state(tmp_path / "sync"), loaded_state(tmp_path / "async")
    for a, b in zip(sync, asynchronous):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(asynchronous[0][k], saved[k]) for k in saved)
    assert not torch.equal(model.state_dict()["0.weight"], saved["0.weight"])
    assert load_file(tmp_path / "async" / "model.safetensors").keys() == saved.keys()


def test_the_next_save_load_and_end_training_wait(tmp_path, held):
    accelerator, *_ = setup(ProjectConfiguration(async_save=True))  # the config key turns it on
    accelerator.save_state(tmp_path / "a")
    assert (tmp_path / "a.incomplete").is_dir()
    threading.Timer(0.5, held.set).start()
    accelerator.save_state(tmp_path / "b", async_save=False)  # waits for a first
    assert (tmp_path / "a" / "hf_backend_checkpoint.json").is_file() and (tmp_path / "b").is_dir()
    accelerator.save_state(tmp_path / "c")
    accelerator.load_state(tmp_path / "c")  # waits for c, then loads it
    accelerator.save_state(tmp_path / "d")
    accelerator.end_training()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "d"]
    assert accelerator.checkpoint_io.wait() is None


def test_a_failed_background_write_is_one_line_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator, model, optimizer = setup(config)
    accelerator.save_state()  # checkpoint_0, complete

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durable, "torch_file", full)
    accelerator.save_state(async_save=True)  # checkpoint_1 fails in the background
    step(accelerator, model, optimizer)
    with pytest.raises(HfBackendError) as raised:
        accelerator.wait_for_checkpoint()
    message = str(raised.value)
    assert "\n" not in message and re.match(
        rf"^async save of {re.escape(str(tmp_path))}/checkpoints/checkpoint_1 failed \(OSError: \[Errno 28\] No "
        r"space left on device\); no checkpoint was written there", message)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0"]
    accelerator.wait_for_checkpoint()  # raised once: nothing is pending now
    monkeypatch.undo()
    fresh, *_ = setup(ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    fresh.load_state()
    assert fresh.save_iteration == 1


def test_automatic_naming_and_rotation_run_after_the_rename(tmp_path, held):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2,
                                  async_save=True)
    accelerator, *_ = setup(config)
    held.set()
    accelerator.save_state()
    accelerator.save_state()
    accelerator.wait_for_checkpoint()
    held.clear()
    path = accelerator.save_state()
    assert path.endswith("checkpoint_2") and accelerator.save_iteration == 3
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0", "checkpoint_1", "checkpoint_2.incomplete"]
    held.set()
    accelerator.wait_for_checkpoint()
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    meta = json.loads((root / "checkpoint_2" / "hf_backend_checkpoint.json").read_text())
    assert meta["iteration"] == 2 and "optimizer.bin" in meta["files"]


def test_weights_file_reads_as_safetensors_and_its_digest_is_the_files(tmp_path):
    shared = torch.randn(4, 3)
    tensors = {"a": shared, "tied": shared, "b": torch.arange(5, dtype=torch.int64), "h": torch.ones(2, 2).bfloat16(),
               "empty": torch.zeros(0, 3), "flag": torch.tensor([True, False])}
    kept = durable.without_aliases(tensors, ["tied"])
    assert set(kept) == {"a", "b", "h", "empty", "flag"}
    digests = durable.safetensors_file(kept, tmp_path / "ours.safetensors", {"format": "pt"})
    save_file(kept, tmp_path / "theirs.safetensors", {"format": "pt"})
    ours, theirs = load_file(tmp_path / "ours.safetensors"), load_file(tmp_path / "theirs.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    size, digest = digests[tmp_path / "ours.safetensors"]
    assert (size, digest) == ((tmp_path / "ours.safetensors").stat().st_size,
                              manifest.file_digest(tmp_path / "ours.safetensors"))
    big = {"w": torch.randn(600, 600)}  # several writes
    (path, (_, digest)), = durable.torch_file(big, tmp_path / "big.bin").items()
    assert digest == manifest.file_digest(path) and torch.equal(torch.load(path)["w"], big["w"])


def test_a_completed_save_is_fsynced(tmp_path, monkeypatch):
    accelerator, *_ = setup()
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    accelerator.save_state(tmp_path / "ck")
    written = {str(p) for p in (tmp_path / "ck").iterdir()}
    staged = {p.replace(".incomplete", "") for p in synced}
    assert written <= staged, written - staged
    assert str(tmp_path) in synced  # the rename into the parent directory


@pytest.mark.parametrize("mode", ["ddp", "sharded", "zero2"])
def test_two_processes_async_save(tmp_path, mode):
    run_script("async_save.py", ["--mode", mode, "--root", str(tmp_path / "ck"), "--out", str(tmp_path / "r")],
               nproc=2, timeout=240)
    reports = [json.loads((tmp_path / f"r.rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert report["equal"] and report["saved_is_loaded"] and report["live_differs"], report
        assert report["last_complete"] and report["leftovers"] == []
    assert reports[0]["staged_only"]
    layout = {"ddp": "model.safetensors", "sharded": "model_dcp/__1_0.distcp", "zero2": "optimizer.bin"}[mode]
    assert layout in reports[0]["files"]




class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def test_trainer_async_save_writes_in_the_background_and_counts_once_complete(tmp_path, monkeypatch):
    from hf_backend import Trainer, TrainingArguments

    threads, states = [], []
    write = durable.torch_file

    def recording(obj, path):
        threads.append((path.name, threading.current_thread() is threading.main_thread()))
        states.append(sorted(p.name for p in path.parent.iterdir()))  # what the checkpoint holds while it is written
        return write(obj, path)

    monkeypatch.setattr(durable, "torch_file", recording)
    out = tmp_path / "out"

    def arguments(steps, **kwargs):
        return TrainingArguments(output_dir=str(out), report_to="none", disable_tqdm=True, max_steps=steps,
                                 per_device_train_batch_size=4, save_steps=2, save_total_limit=1, learning_rate=0.1,
                                 **kwargs)

    trainer = Trainer(model=Regression(), args=arguments(6, async_save=True), train_dataset=Rows())
    trainer.train()  # returns once the last checkpoint is complete
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6"]
    assert ("optimizer.pt", False) in threads  # in the writer thread; scheduler.pt, small, at once
    assert all("trainer_state.json" not in names for names in states)  # it appears last
    files = {p.name for p in (out / "checkpoint-6").iterdir()}
    assert {"trainer_state.json", "model.safetensors", "optimizer.pt", "scheduler.pt"} <= files
    assert not any(name.endswith(".incomplete") for name in files)
    sealed = json.loads((out / "checkpoint-6" / "hf_backend_checkpoint.json").read_text())["files"]
    assert set(sealed) == files - {"hf_backend_checkpoint.json"}  # the manifest, sealed once the files were in place
    saved, reloaded = trainer.model.state_dict(), load_file(out / "checkpoint-6" / "model.safetensors")
    assert all(torch.equal(reloaded[k], saved[k]) for k in saved)
    resumed = Trainer(model=Regression(), args=arguments(8), train_dataset=Rows())
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 8
