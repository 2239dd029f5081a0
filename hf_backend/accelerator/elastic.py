"""Restarts and world-size changes under torch elastic (`hf-backend launch --max_restarts N`, `--nnodes
MIN:MAX`).

torch elastic restarts every worker of a job when one fails (up to `--max_restarts` times) or when
nodes join or leave a `--nnodes MIN:MAX` job; it tells each worker how many restarts came before it
(TORCHELASTIC_RESTART_COUNT). The script starts again from its first line, so it continues only if
it loads a checkpoint: `accelerator.resume_from_checkpoint()` (after `prepare` and
`register_for_checkpointing`) loads the newest complete automatic checkpoint when there is one, on a
restart or on a first start alike, and returns its directory.

A world of another size: the loaders continue at the same sample (their position is kept in
samples), and the scheduler steps once per process per optimizer step, as in Accelerate, so the
schedule follows the samples seen. The global batch is the per-process batch times the processes;
with `keep_global_batch=True` the gradient accumulation is scaled by saved world / new world (and
the scheduler's steps per update kept), so every optimizer step sees the same samples, the same
learning rate and the same accumulation as in the original world.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import checkpoint
from ..core.errors import HfBackendError
from ..core.notes import note

if TYPE_CHECKING:
    from ..checkpoint import CheckpointIO
    from ..config.options import ProjectConfiguration
    from ..training.prepared import PreparedObjects

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """How many times torch elastic restarted this job's workers before this one (0 on a first start or
    outside torch elastic)."""
    value = os.environ.get(RESTART_COUNT, "")
    return int(value) if value.isdigit() else 0


def under_elastic() -> bool:
    """Whether torch elastic (`hf-backend launch`, torchrun) started this process."""
    return RESTART_COUNT in os.environ


class ElasticMembers:
    """The Accelerator's members for restarts: `restart_count`, `is_restart`, `resume_from_checkpoint`,
    and the counters a checkpoint keeps for them."""

    # What the Accelerator this is mixed into holds (declared, not set here).
    _objects: PreparedObjects
    checkpoint_io: CheckpointIO
    project_configuration: ProjectConfiguration
    gradient_accumulation_steps: int
    load_state: Callable[..., None]
    if TYPE_CHECKING:  # the facade's read-only property (ProcessView's)
        @property
        def num_processes(self) -> int: ...

    @property
    def restart_count(self) -> int:
        """How many times torch elastic restarted the workers before this run (0 on a first start).
        """
        return restart_count()

    @property
    def is_restart(self) -> bool:
        return restart_count() > 0

    def resume_from_checkpoint(self, keep_global_batch: bool = False) -> str | None:
        """Load the newest complete automatic checkpoint when there is one (call after `prepare` and
        `register_for_checkpointing`); returns its directory, or None when training starts from the
        beginning.
        `keep_global_batch`: in a world of another size, scale the gradient accumulation to keep the
        global batch."""
        config = self.project_configuration
        if not (config.automatic_checkpoint_naming and config.project_dir):
            raise HfBackendError("resume_from_checkpoint() reads automatic checkpoints; pass "
                                 "Accelerator(project_config=ProjectConfiguration(project_dir=..., "
                                 "automatic_checkpoint_naming=True))")
        if not checkpoint.layout.automatic_dirs(config.project_dir):
            if self.restart_count:
                note(f"restart {self.restart_count}: no checkpoint under "
                     f"{config.project_dir}/checkpoints yet; starting from the beginning")
            return None
        # when every checkpoint is damaged it raises: starting over would hide that
        self.load_state()
        index = self.checkpoint_io.last_read
        assert index is not None  # load_state returned: it read a checkpoint
        if keep_global_batch:
            self._keep_global_batch(index.meta)
        note(f"resumed from {index.directory} (restart "
             f"{self.restart_count}, {self.num_processes} processes)")
        return str(index.directory)

    def _elastic_progress(self) -> dict[str, Any]:
        """Counters a checkpoint keeps: the automatic numbering, and what restores the global batch in
        another world (the accumulation, the scheduler's steps per optimizer step)."""
        schedulers = self._objects.schedulers
        per_update = getattr(schedulers[0], "steps_per_update", None) if schedulers else None
        return {"iteration": self.project_configuration.iteration,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "scheduler_steps_per_update": per_update}

    def _keep_global_batch(self, meta: dict[str, Any]) -> None:
        saved_world, world = int(meta["num_processes"]), self.num_processes
        saved_accumulation = int(meta.get("gradient_accumulation_steps") or 1)
        # per-process batches in one optimizer step, all processes
        micro_batches = saved_world * saved_accumulation
        if micro_batches % world:
            raise HfBackendError("resume_from_checkpoint(keep_global_batch=True): the "
                                 f"checkpoint's global batch is {micro_batches} per-process "
                                 f"batches, which {world} processes cannot split evenly; resume "
                                 "with a world size that divides it, or keep_global_batch=False")
        self.gradient_accumulation_steps = micro_batches // world
        per_update = meta.get("scheduler_steps_per_update")
        for scheduler in self._objects.schedulers:
            if per_update and hasattr(scheduler, "steps_per_update"):
                scheduler.steps_per_update = int(per_update)
        if saved_world != world:
            note(f"keep_global_batch: {saved_world} -> {world} processes, gradient accumulation "
                 f"{saved_accumulation} -> {self.gradient_accumulation_steps}")
