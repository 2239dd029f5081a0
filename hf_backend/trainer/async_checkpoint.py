"""hf_backend.Trainer's async checkpoints (`TrainingArguments(async_save=True)`).

transformers' `_save_checkpoint` runs as usual, except that its large writes (the weights, the
optimizer state; under FSDP the engine's shards) are snapshotted into host memory and queued on
checkpoint/async_save.py's writer, and the two steps that make a Trainer checkpoint count are held
back until every rank's files are written: the `trainer_state.json` that marks a `checkpoint-{step}`
complete (resume passes over one without it) and the rotation of old checkpoints
(`save_total_limit`), so a failed async save never costs an older complete checkpoint. They run in
`TrainerCheckpoint.commit`, on the main thread, at the next save, at the end of `train()`, before
the best model is loaded, or at `accelerator.wait_for_checkpoint()` / `end_training()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import transformers

from ..checkpoint import durable, layout, manifest
from ..checkpoint.async_save import PendingSave, Writes
from ..checkpoint.directories import Staging

# trainer_state.json is written under this suffix and renamed when every file is in place
_HELD = ".incomplete"


@dataclasses.dataclass
class TrainerCheckpoint(Staging):
    """A `checkpoint-{step}` written in place in the background (`path` is `target`), which
    `PendingSave` commits or abandons: its trainer_state.json, held back until then, marks it
    complete."""

    rotate: Callable[[], None] = lambda: None

    def finish(self, seal: Callable[[Path], None]) -> None:
        """The main process, every file written and fsynced: trainer_state.json put in place, the
        manifest of every file sealed (as a synchronous Trainer checkpoint has), old checkpoints
        rotated."""
        held = self.path / (layout.TRAINER_STATE + _HELD)
        if held.is_file():
            os.replace(held, self.path / layout.TRAINER_STATE)
            durable.fsync_dir(self.path)
        seal(self.path)
        self.rotate()


@contextlib.contextmanager
def deferred(trainer: Any, trial: Any) -> Iterator[Writes]:
    """Around transformers' `_save_checkpoint`: the writes it routes through the returned `Writes` run
    in the background; its trainer_state.json and rotation wait for them (module docstring)."""
    io = trainer.accelerator.checkpoint_io
    io.wait()  # one checkpoint under way at a time
    writes = Writes(True, io.save_group() if io.sharded else None)
    run_dir = Path(trainer._get_output_dir(trial=trial))
    path = run_dir / f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    args, state = trainer.args, trainer.state
    limit, save_to_json = args.save_total_limit, state.save_to_json
    state.save_to_json = lambda json_path: save_to_json(str(json_path) + _HELD)
    # transformers' rotation now could count this unfinished checkpoint
    args.save_total_limit = None
    trainer._async_writes = writes
    try:
        yield writes
    finally:
        trainer._async_writes = None
        args.save_total_limit = limit
        del state.save_to_json

    def rotate() -> None:
        if limit is not None:
            _rotate(trainer, run_dir, limit)

    checkpoint = TrainerCheckpoint(path, path, io.process, io.process, rotate)
    io.saves.put(PendingSave(checkpoint, writes, manifest.seal, None))


def _rotate(trainer: Any, run_dir: Path, limit: int) -> None:
    rotate = getattr(transformers.trainer, "rotate_checkpoints", None)
    if rotate is not None:
        rotate(output_dir=str(run_dir), save_total_limit=limit,
               best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
    else:  # transformers before the module function: the Trainer's method
        trainer._rotate_checkpoints(use_mtime=True, output_dir=str(run_dir))

