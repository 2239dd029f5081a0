"""Checkpoint directories: a save appears complete or not at all, automatic naming and rotation, which
of a Trainer's checkpoints is the newest complete one, and whether one can be resumed."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import HfBackendError
from ..core.notes import note
from ..runtime.collectives import gather_object
from ..runtime.process import ProcessState
from . import durable, layout, manifest
from .index import CheckpointIndex, read_index


@dataclasses.dataclass
class Staging:
    """A save under way in `<target>.incomplete` (`path`), which nothing loads: `commit` moves it to
    `target` in one rename once every process has written its part, `abandon` removes it."""

    target: Path
    path: Path
    # the processes sharing this directory (one, when each process names its own)
    process: ProcessState
    everyone: ProcessState  # every process

    def commit(self, seal: Callable[[Path], None]) -> None:
        """Every process: wait for all, then the main one fsyncs and `finish`es (durable once it
        returns)."""
        self.process.wait_for_everyone()
        if self.process.is_main_process:
            durable.fsync_tree(self.path)
            self.finish(seal)
        self.everyone.wait_for_everyone()

    def finish(self, seal: Callable[[Path], None]) -> None:
        """The main process, every file written and fsynced: seal the manifest, rename the directory
        into place."""
        seal(self.path)
        previous = layout.previous_dir(self.target)
        if self.target.exists():
            shutil.rmtree(previous, ignore_errors=True)
            self.target.rename(previous)
        self.path.rename(self.target)
        durable.fsync_dir(self.target.parent)
        shutil.rmtree(previous, ignore_errors=True)

    def abandon(self) -> None:
        """Every process: remove the staged files of a failed save (an older checkpoint at `target`
        stays)."""
        self.process.wait_for_everyone()
        if self.process.is_main_process:
            shutil.rmtree(self.path, ignore_errors=True)
        self.everyone.wait_for_everyone()


def stage(target: Path, process: ProcessState) -> Staging:
    """Every process: a fresh staging directory for `target`. When the processes name different
    directories (each its own, as Accelerate allows), each process stages, seals and renames its
    own, holding its part of the checkpoint."""
    own = process.distributed and len(set(gather_object(str(target.resolve())))) > 1
    sharing = dataclasses.replace(process, num_processes=1, process_index=0) if own else process
    staging = layout.staging_dir(target)
    if sharing.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    process.wait_for_everyone()
    return Staging(target, staging, sharing, process)


def automatic_dir(config: Any) -> Path:
    """Where `save_state()` without a directory writes: the next automatic checkpoint of a
    ProjectConfiguration."""
    if not config.automatic_checkpoint_naming:
        raise HfBackendError("save_state() needs a directory, or "
                             "ProjectConfiguration(automatic_checkpoint_naming=True, "
                             "project_dir=...)")
    if config.project_dir is None:
        raise HfBackendError("save_state(): automatic checkpoint naming needs project_dir; pass "
                             "Accelerator(project_dir=...) or "
                             "ProjectConfiguration(project_dir=...)")
    return layout.automatic_dir(config.project_dir, config.iteration)


def automatic_saved(config: Any, process: ProcessState) -> Callable[[], None]:
    """Count the automatic checkpoint being saved now (the next save gets the next name, while this one
    may still be written in the background); returns what runs once it is in place: rotation to the
    newest `total_limit`."""
    config.iteration += 1

    def rotate_now() -> None:
        if config.total_limit is not None and process.is_main_process:
            rotate(config.project_dir, config.total_limit)
        process.wait_for_everyone()

    return rotate_now


def latest_automatic_checkpoint(config: Any, sharing: manifest.Sharing | None = None) -> CheckpointIndex:
    """What `load_state()` without a directory reads: the newest automatic checkpoint that verifies (a
    damaged or incomplete one is passed over with a note). `sharing`: as `read_index` takes it."""
    found = layout.automatic_dirs(config.project_dir) if config.project_dir else []
    for path in reversed(found):
        try:
            return read_index(path, sharing=sharing)
        except HfBackendError as err:
            note(f"passing over {path}: {err}")
    where = f"{config.project_dir}/checkpoints"
    raise HfBackendError(f"load_state(): no {'usable ' if found else ''}checkpoint under {where}; "
                         "pass the directory save_state wrote")


def rotate(project_dir: str, total_limit: int) -> None:
    """Keep the newest `total_limit` automatic checkpoints."""
    for old in layout.automatic_dirs(project_dir)[:-total_limit]:
        shutil.rmtree(old, ignore_errors=True)


def last_complete_trainer_checkpoint(output_dir: str, usable: Callable[[Path], None] | None = None) -> Path | None:
    """The newest `checkpoint-{step}` in `output_dir` whose save finished (`trainer_state.json` is
    written last, and must read as JSON) and that `usable` accepts (it raises HfBackendError for a
    damaged one); newer, interrupted or damaged ones are passed over with a note. None when there is
    none."""
    root = Path(output_dir)
    found = sorted(((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                    if p.is_dir() and (m := layout.TRAINER_CHECKPOINT.match(p.name))), reverse=True)
    for _, path in found:
        state = path / layout.TRAINER_STATE
        try:
            if not state.is_file():
                note(f"{path} is incomplete (its save was interrupted: no {layout.TRAINER_STATE}); "
                     "resuming from an older one")
                continue
            json.loads(state.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            note(f"{state} is damaged or unreadable ({type(err).__name__}); "
                 "resuming from an older checkpoint")
            continue
        try:
            if usable is not None:
                usable(path)
            return path
        except HfBackendError as err:
            note(f"passing over {path}: {err}")
    return None


def check_trainer_checkpoint(directory: str | os.PathLike, fresh_optimizer: bool = False,
                             caller: str = "resume_from_checkpoint") -> CheckpointIndex | None:
    """Raise HfBackendError, one line naming the file, unless the Trainer checkpoint `directory` is
    complete, its manifest (when sealed) checks out, and it holds an optimizer state (or
    `fresh_optimizer`: save_only_model). Returns its index (None for a checkpoint
    transformers.Trainer wrote)."""
    directory = Path(directory)
    try:
        names = set(os.listdir(directory))
    except OSError as err:
        raise HfBackendError(f"{caller}: {directory} cannot be read ({type(err).__name__}); give "
                             "this process read access to it") from None
    index = read_index(directory, caller=caller, sharing=manifest.machine_sharing()) \
        if layout.METADATA in names else None
    meta = index.meta if index is not None else {}
    engine = sorted(names & {layout.dataloader_file(0), layout.sharded_dir("model"), layout.sharded_dir("optimizer")})
    # hf_backend wrote it (transformers.Trainer writes none of these): the metadata is lost
    if not meta and engine:
        raise HfBackendError(f"{caller}: {directory / layout.METADATA} is missing though "
                             f"hf_backend wrote the checkpoint (it holds {engine[0]}); the "
                             "checkpoint is damaged, use another one")
    state = directory / layout.TRAINER_STATE
    if layout.TRAINER_STATE not in names:
        raise HfBackendError(f"{caller}: {state} is missing (its save was interrupted); use "
                             "another checkpoint")
    try:
        json.loads(state.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HfBackendError(f"{caller}: {state} is damaged ({type(err).__name__}); "
                             "use another checkpoint") from None
    if fresh_optimizer or meta.get("counts", {}).get("optimizers", 0) > 0 or layout.holds_trainer_optimizer(directory):
        return index
    if not meta and any(directory.glob(layout.TRAINER_DEEPSPEED_GLOB)):
        raise HfBackendError(f"{caller}: {directory} holds DeepSpeed's own checkpoint "
                             "(global_step*/, as transformers.Trainer writes it under DeepSpeed), "
                             "which hf_backend.Trainer does not read; resume it with "
                             "transformers.Trainer, or pass save_only_model=True to start from "
                             "its weights with a fresh optimizer")
    what = (f"{directory / layout.METADATA} is missing, and so is "
            f"{layout.TRAINER_OPTIMIZER}" if not meta else
            f"no {layout.TRAINER_OPTIMIZER}, and {layout.METADATA} "
            "lists none: saved with save_only_model")
    raise HfBackendError(f"{caller}: {directory} holds no optimizer state ({what}); pass "
                         "save_only_model=True to resume its weights with a fresh optimizer, or "
                         "use another checkpoint")
