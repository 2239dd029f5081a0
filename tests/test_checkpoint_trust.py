"""A damaged or incomplete checkpoint is never loaded: the manifest `save_state` writes is verified first, and each
kind of damage is one line naming the file; resuming from the newest checkpoint passes over a damaged one."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from hf_backend import Accelerator, HfBackendError, ProjectConfiguration
from hf_backend.checkpoint import last_complete_trainer_checkpoint


def setup(project_dir=None):
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=True) if project_dir else None)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer


def step(accelerator, model, optimizer):
    accelerator.backward(model(torch.ones(2, 4)).square().sum())
    optimizer.step()
    optimizer.zero_grad()


def truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def flip(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def replace_by_directory(path):
    path.unlink()
    path.mkdir()


DAMAGE = {
    "truncated weights": ("model.safetensors", truncate,
                          r"has \d+ bytes where \d+ were written \(truncated or replaced\)"),
    "flipped optimizer bytes": ("optimizer.bin", flip, r"does not match its checksum \(changed since it was written\)"),
    "deleted random state": ("rng_state_0.pt", lambda p: p.unlink(), "is missing"),
    "directory for a file": ("scheduler.bin", replace_by_directory, "is a directory where the manifest lists a file"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damage_is_one_line_and_nothing_is_loaded(tmp_path, kind):
    accelerator, model, optimizer = setup()
    step(accelerator, model, optimizer)
    accelerator.save_state(tmp_path / "ckpt")
    name, damage, problem = DAMAGE[kind]
    damage(tmp_path / "ckpt" / name)
    step(accelerator, model, optimizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = re.escape(str(tmp_path / "ckpt" / name))
    with pytest.raises(HfBackendError, match=rf"^load_state: {path} {problem}; the checkpoint is damaged, use another "
                                             "one$"):
        accelerator.load_state(tmp_path / "ckpt")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_newest_usable_automatic_checkpoint_is_resumed(tmp_path, caplog):
    accelerator, model, optimizer = setup(tmp_path)
    saved = []
    for _ in range(3):
        step(accelerator, model, optimizer)
        saved.append({k: v.clone() for k, v in model.state_dict().items()})
        accelerator.save_state()
    newest = tmp_path / "checkpoints" / "checkpoint_2"
    flip(newest / "model.safetensors")
    step(accelerator, model, optimizer)
    accelerator.load_state()
    assert all(torch.equal(saved[1][k], v) for k, v in model.state_dict().items())
    assert f"passing over {newest}: load_state: {newest / 'model.safetensors'} does not match its checksum" in \
        caplog.text


def test_a_save_killed_between_its_renames_still_loads(tmp_path, caplog):
    accelerator, model, optimizer = setup()
    step(accelerator, model, optimizer)
    accelerator.save_state(tmp_path / "ckpt")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    (tmp_path / "ckpt").rename(tmp_path / "ckpt.previous")  # the first rename of an overwriting save, then the kill
    (tmp_path / "ckpt.incomplete").mkdir()
    step(accelerator, model, optimizer)
    accelerator.load_state(tmp_path / "ckpt")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert "holds the checkpoint an interrupted save was replacing" in caplog.text


def test_a_torn_trainer_state_is_passed_over(tmp_path):
    for step_number, text in ((4, '{"global_step": 4}'), (8, '{"global_st')):
        folder = tmp_path / f"checkpoint-{step_number}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(text)
    assert last_complete_trainer_checkpoint(str(tmp_path)) == tmp_path / "checkpoint-4"
    json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    shutil.rmtree(tmp_path / "checkpoint-4")
    assert last_complete_trainer_checkpoint(str(tmp_path)) is None
