"""hf_backend.Trainer's checkpoints are verified (issue 18, item 3): each `checkpoint-{step}` carries a manifest of
every file in it, transformers' included; `train(resume_from_checkpoint=path)` refuses a damaged one in one line
naming the file before loading anything, and `resume_from_checkpoint=True` passes over it and resumes the one before
(in one process exactly as the uninterrupted run). Runs in this process: a linear regression, 6 steps."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import Regression
from transformers import TrainerCallback

from hf_backend import HfBackendError, Trainer, TrainingArguments
from hf_backend.checkpoint import read_index

STEPS, EVERY = 6, 2




def rows() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 4, generator=generator), torch.randn(48, generator=generator)
    return [{"x": a, "labels": b} for a, b in zip(x, y)]


class StartStep(TrainerCallback):
    """The global step training starts from (after a checkpoint's trainer state was loaded)."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def trainer(output_dir: Path, **kwargs) -> Trainer:
    args = TrainingArguments(output_dir=str(output_dir), report_to="none", disable_tqdm=True, max_steps=STEPS,
                             per_device_train_batch_size=8, save_steps=EVERY, learning_rate=0.1, seed=3, **kwargs)
    return Trainer(model=Regression(), args=args, train_dataset=rows(), callbacks=[StartStep()])


def weights(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[torch.Tensor]]:
    """An uninterrupted run: its checkpoints 2, 4, 6 and its final weights."""
    out = tmp_path_factory.mktemp("reference") / "out"
    t = trainer(out)
    t.train()
    return out, weights(t)


def test_every_file_of_a_trainer_checkpoint_is_in_its_manifest(reference):
    out, _ = reference
    for step in range(EVERY, STEPS + 1, EVERY):
        folder = out / f"checkpoint-{step}"
        meta = read_index(folder).meta
        on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
        assert set(meta["files"]) == on_disk - {"hf_backend_checkpoint.json"}
        assert {"trainer_state.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                "training_args.bin", "dataloader.bin"} <= set(meta["files"])
        assert meta["strategy"] == "NO" and meta["num_processes"] == 1


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def step_changed(path: Path) -> None:
    """A trainer state that still reads as JSON, with another step."""
    path.write_text(path.read_text().replace('"global_step": 4', '"global_step": 5'))


def replace_by_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


DAMAGED = "; the checkpoint is damaged, use another one"
CASES = {  # file, damage, what is said
    "flipped weights": ("model.safetensors", flip, r"\{file\} does not match its checksum \(changed since it was "
                                                   r"written\)" + DAMAGED),
    "truncated optimizer": ("optimizer.pt", lambda p: p.write_bytes(p.read_bytes()[:-9]),
                            r"\{file\} has \d+ bytes where \d+ were written \(truncated or replaced\)" + DAMAGED),
    "changed trainer state": ("trainer_state.json", step_changed,
                              r"\{file\} does not match its checksum \(changed since it was written\)" + DAMAGED),
    "deleted random state": ("rng_state.pth", lambda p: p.unlink(), r"\{file\} is missing" + DAMAGED),
    "directory for the scheduler": ("scheduler.pt", replace_by_directory,
                                    r"\{file\} is a directory where the manifest lists a file" + DAMAGED),
    "deleted metadata": ("hf_backend_checkpoint.json", lambda p: p.unlink(),
                         r"\{file\} is missing though hf_backend wrote the checkpoint \(it holds dataloader.bin\)"
                         + DAMAGED),
    "deleted trainer state": ("trainer_state.json", lambda p: p.unlink(), r"\{file\} is missing" + DAMAGED),
}


@pytest.mark.parametrize("kind", CASES)
def test_a_damaged_trainer_checkpoint_is_refused_and_the_one_before_resumed(reference, tmp_path, kind):
    source, final = reference
    out = tmp_path / "out"
    for step in (2, 4):
        shutil.copytree(source / f"checkpoint-{step}", out / f"checkpoint-{step}")
    newest = out / "checkpoint-4"
    name, damage, said = CASES[kind]
    damage(newest / name)
    t = trainer(out)
    before = weights(t)
    with pytest.raises(HfBackendError) as refused:
        t.train(resume_from_checkpoint=str(newest))
    expected = said.replace(r"\{file\}", re.escape(str(newest / name)))
    assert re.fullmatch(f"resume_from_checkpoint: {expected}", str(refused.value)), str(refused.value)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(t)))

    notes = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("hf_backend").addHandler(handler)
    try:
        t = trainer(out)
        t.train(resume_from_checkpoint=True)
    finally:
        logging.getLogger("hf_backend").removeHandler(handler)
    start = next(c for c in t.callback_handler.callbacks if isinstance(c, StartStep))
    assert start.step == 2
    assert [n for n in notes if str(newest) in n][:1] == [f"passing over {newest}: {refused.value}"] or \
        kind == "deleted trainer state"  # an incomplete one: passed over with the note it always had
    assert all(torch.equal(a, b) for a, b in zip(weights(t), final))


def test_save_only_model_checkpoints_are_sealed_and_resume_only_as_such(tmp_path):
    out = tmp_path / "out"
    trainer(out, save_only_model=True).train()
    folder = out / "checkpoint-4"
    assert "trainer_state.json" in read_index(folder).meta["files"]
    assert not (folder / "optimizer.pt").exists()
    with pytest.raises(HfBackendError, match=rf"^resume_from_checkpoint: {re.escape(str(folder))} holds no optimizer "
                                             r"state \(no optimizer.pt, and hf_backend_checkpoint.json lists none: "
                                             r"saved with save_only_model\); pass save_only_model=True"):
        trainer(out).train(resume_from_checkpoint=str(folder))
    t = trainer(out, save_only_model=True)
    t.train(resume_from_checkpoint=str(folder))
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == STEPS


def resave_as_shards(folder: Path, drop_shard: bool = False) -> None:
    """What transformers' own tests do to a checkpoint: its weights written again by save_pretrained's sharding
    (an index and one file per tensor), model.safetensors removed."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_torch_state_dict(state, folder, max_shard_size=1)
    if drop_shard:
        sorted(folder.glob("model-*-of-*.safetensors"))[0].unlink()


def test_weights_resharded_by_transformers_still_resume(reference, tmp_path):
    """transformers' test_resume_training_with_shard_checkpoint: accepted with a note, resumed exactly; the other
    files are still verified, and an incomplete replacement is refused as the missing file it leaves."""
    source, final = reference
    out = tmp_path / "out"
    shutil.copytree(source / "checkpoint-4", out / "checkpoint-4")
    folder = out / "checkpoint-4"
    resave_as_shards(folder)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) == 2
    t = trainer(out)
    t.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(a, b) for a, b in zip(weights(t), final))

    flip(folder / "optimizer.pt")  # still checked
    with pytest.raises(HfBackendError, match=r"optimizer.pt does not match its checksum"):
        trainer(out).train(resume_from_checkpoint=str(folder))

    shutil.rmtree(out)
    shutil.copytree(source / "checkpoint-4", folder)
    resave_as_shards(folder, drop_shard=True)
    with pytest.raises(HfBackendError, match=r"model.safetensors is missing; the checkpoint is damaged"):
        trainer(out).train(resume_from_checkpoint=str(folder))


def test_a_stock_deepspeed_checkpoint_is_one_line(reference, tmp_path):
    """transformers.Trainer under DeepSpeed writes DeepSpeed's own global_step*/ (no optimizer.pt, none of our
    files), which this Trainer does not read: refused before anything is loaded, unless only its weights are asked."""
    source, _ = reference
    folder = tmp_path / "out" / "checkpoint-4"
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "trainer_state.json"):
        if (source / "checkpoint-4" / name).is_file():
            shutil.copyfile(source / "checkpoint-4" / name, folder / name)
    (folder / "global_step4").mkdir()
    (folder / "latest").write_text("global_step4")
    with pytest.raises(HfBackendError, match=r"holds DeepSpeed's own checkpoint \(global_step\*/, as transformers"
                                             r".Trainer writes it under DeepSpeed\), which hf_backend.Trainer does "
                                             r"not read; resume it with transformers.Trainer, or pass "
                                             r"save_only_model=True"):
        trainer(tmp_path / "out").train(resume_from_checkpoint=str(folder))
    t = trainer(tmp_path / "out", save_only_model=True)
    t.train(resume_from_checkpoint=str(folder))
    assert t.state.global_step == STEPS
