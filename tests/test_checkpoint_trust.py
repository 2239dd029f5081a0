"""A damaged or incomplete checkpoint is never loaded: the manifest `save_state` writes is verified first, and each
kind of damage is one line naming the file; resuming from the newest checkpoint passes over a damaged one."""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import as_ordinary_user, run_report

from hf_backend import Accelerator, HfBackendError, ProjectConfiguration
from hf_backend.checkpoint import last_complete_trainer_checkpoint


class Counter:
    """A registered custom object (custom_checkpoint_0.pkl)."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def setup(project_dir=None):
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=True) if project_dir else None)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = torch.utils.data.DataLoader(torch.arange(8.0), batch_size=2)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    accelerator.register_for_checkpointing(Counter())
    return accelerator, model, optimizer


def step(accelerator, model, optimizer):
    accelerator.backward(model(torch.ones(2, 4)).square().sum())
    optimizer.step()
    optimizer.zero_grad()


def snapshot(model, optimizer) -> list[torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return [v.clone() for v in model.state_dict().values()] + \
        [v.clone() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


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


def rewrite_metadata(change):
    def damage(path):
        meta = json.loads(path.read_text())
        path.write_text(json.dumps(change(meta)))
    return damage


def without_files(meta):
    del meta["files"]
    return meta


def more_models(meta):
    meta["counts"]["models"] = 2
    return meta


def unreadable(path):
    path.chmod(0)


SIZE = r"has \d+ bytes where \d+ were written \(truncated or replaced\)"
PER_FILE = {  # the damage, and what is said of any file but the metadata
    "truncated": (truncate, SIZE),
    "flipped bytes": (flip, r"does not match its checksum \(changed since it was written\)"),
    "deleted": (lambda p: p.unlink(), "is missing"),
    "a directory in its place": (replace_by_directory, "is a directory where the manifest lists a file"),
    "empty": (lambda p: p.write_bytes(b""), "has 0 bytes where \\d+ were written \\(truncated or replaced\\)"),
    "unreadable": (unreadable, r"cannot be read \(PermissionError\)"),
}
FILES = ["model.safetensors", "optimizer.bin", "scheduler.bin", "dataloader.bin", "custom_checkpoint_0.pkl",
         "rng_state_0.pt"]
DAMAGED = "; the checkpoint is damaged, use another one"
METADATA = {  # the damage to hf_backend_checkpoint.json, and what is said (of it, or of the directory: "{dir}")
    "truncated": (truncate, r"\{file\} is corrupt \(line \d+\); use another checkpoint"),
    "flipped bytes": (flip, r"\{file\} is corrupt \(not UTF-8 text\); use another checkpoint"),
    "deleted": (lambda p: p.unlink(), r"\{dir\} is not an hf_backend checkpoint \(no hf_backend_checkpoint.json\); "
                                      "pass a directory written by Accelerator.save_state"),
    "a directory in its place": (replace_by_directory,
                                 r"\{file\} is a directory where the metadata file should be" + DAMAGED),
    "empty": (lambda p: p.write_bytes(b""), r"\{file\} is empty; use another checkpoint"),
    "unreadable": (unreadable, r"\{file\} cannot be read \(PermissionError\); give this process read access to it"),
    "{}": (lambda p: p.write_text("{}"), r"\{file\} has no valid 'format_version'" + DAMAGED),
    "its manifest dropped": (rewrite_metadata(without_files),
                             r"\{file\} does not match its checksum \(changed since it was written\)" + DAMAGED),
    "a count changed": (rewrite_metadata(more_models),
                        r"\{file\} does not match its checksum \(changed since it was written\)" + DAMAGED),
}
CASES = {f"{name} {kind}": (name, damage, rf"\{{file\}} {said}{DAMAGED}")
         for name in FILES for kind, (damage, said) in PER_FILE.items()}
CASES |= {f"metadata {kind}": ("hf_backend_checkpoint.json", damage, said) for kind, (damage, said) in METADATA.items()}
CASES["unreadable directory"] = (".", unreadable,
                                 r"\{dir\} cannot be read \(PermissionError\); give this process read access to it")


@pytest.fixture
def world_readable_tmp():
    """A directory every user may enter (pytest's tmp_path is its owner's only): the unreadable kinds of damage are
    checked as an ordinary user, who must reach the checkpoint."""
    root = Path(tempfile.mkdtemp(prefix="hf_backend_trust_"))
    root.chmod(0o755)
    yield root
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755)
    shutil.rmtree(root)


def attempt(accelerator, model, optimizer, newest):
    """load_state(newest), then load_state(): what each did (run as an ordinary user for the unreadable kinds)."""
    notes = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("hf_backend").addHandler(handler)
    before = snapshot(model, optimizer)
    try:
        accelerator.load_state(newest)
        error = None
    except HfBackendError as err:
        error = str(err)
    unchanged = same(before, snapshot(model, optimizer))
    accelerator.load_state()
    logging.getLogger("hf_backend").removeHandler(handler)
    return error, unchanged, notes, snapshot(model, optimizer)


@pytest.mark.parametrize("kind", CASES)
def test_damage_is_one_line_and_the_one_before_is_resumed(world_readable_tmp, kind):
    """load_state(dir) refuses the damaged checkpoint in one line naming the file and loads nothing; load_state()
    passes over it with a note and resumes the one before."""
    accelerator, model, optimizer = setup(world_readable_tmp)
    saved = []
    for _ in range(2):
        step(accelerator, model, optimizer)
        saved.append(snapshot(model, optimizer))
        accelerator.save_state()
    newest = world_readable_tmp / "checkpoints" / "checkpoint_1"
    name, damage, said = CASES[kind]
    damage(newest / name)
    step(accelerator, model, optimizer)
    accelerator.load_state(world_readable_tmp / "checkpoints" / "checkpoint_0")  # everything it needs is imported
    step(accelerator, model, optimizer)
    run = attempt if "unreadable" not in kind else lambda *a: as_ordinary_user(lambda: attempt(*a))
    error, unchanged, notes, resumed = run(accelerator, model, optimizer, newest)
    expected = said.replace(r"\{file\}", re.escape(str(newest / name))).replace(r"\{dir\}", re.escape(str(newest)))
    assert error is not None and re.fullmatch(f"load_state: {expected}", error), error
    assert unchanged, "the damaged checkpoint changed the model or optimizer"
    assert notes == [f"passing over {newest}: {error}"]
    assert same(resumed, saved[0])


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


def test_a_damaged_sharded_checkpoint_is_refused_on_every_process(tmp_path):
    """2 processes, FSDP with SHARDED_STATE_DICT: a damaged shard (or the DCP metadata, or rank 1's random state) is
    one line naming the file on both ranks, and neither loads anything."""
    report = run_report("damaged_shards.py", tmp_path / "report.json", ["--root", str(tmp_path / "ckpts")], nproc=2)
    said = {"flipped bytes": r"does not match its checksum \(changed since it was written\)",
            "truncated": r"has \d+ bytes where \d+ were written \(truncated or replaced\)", "deleted": "is missing"}
    assert len(report) == 4
    for kind, found in report.items():
        expected = rf"load_state: {re.escape(found['path'])} {said[kind.split(' ', 1)[1]]}; the checkpoint is " \
                   "damaged, use another one"
        assert len(found["seen"]) == 2, found
        for error, unchanged in found["seen"]:
            assert error is not None and re.fullmatch(expected, error), (kind, error)
            assert unchanged, kind
