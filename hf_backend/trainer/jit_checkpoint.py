"""`enable_jit_checkpoint=True`: on SIGTERM (a preemption, `kill`, the launcher shutting down) save a
checkpoint and stop training cleanly, on every process at once.

transformers' own callback acts per process: each one that received SIGTERM waits 3 s, then saves at
its next step boundary. With several processes they reach that point at different steps, and a save
that runs collectives (FSDP, DeepSpeed, the engine's loader positions) hangs or mixes steps. Here
SIGTERM only raises a flag; at the end of every optimizer step the processes all-reduce it (one
1-element all-reduce per step, only with this option on), so either all of them save the same step
and stop, or none does. No grace period: torch elastic gives the workers 30 s between SIGTERM and
SIGKILL, and the save must fit in it.

The callback and its manager are subclasses of transformers' `JITCheckpointCallback` and
`CheckpointManager`, with the same attributes (`trainer`, `jit_manager`, `is_checkpoint_requested`,
`_original_sigterm_handler`), so code that looks for transformers' callback among the Trainer's
callbacks finds this one. What differs: the signal handler only raises the flag (no timer), the
decision is taken at step end only and together, and the save is hf_backend's (staged and renamed
into place, so transformers' "checkpoint-is-incomplete.txt" marker is not needed).
"""

from __future__ import annotations

import signal
from typing import Any

from transformers.trainer_jit_checkpoint import CheckpointManager, JITCheckpointCallback

from ..core.notes import note
from ..training.trigger import Trigger


class CoordinatedCheckpointManager(CheckpointManager):
    """transformers' `CheckpointManager`, with SIGTERM raising a flag that every process reads at the
    same point. `is_checkpoint_requested` says whether this process got SIGTERM (and has not saved
    since); `checkpoint_agreed()` is the collective decision."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer, kill_wait=0)
        self.requested = Trigger(trainer.accelerator.process)

    def _sigterm_handler(self, signum: int, frame: Any) -> None:
        self.is_checkpoint_requested = True
        self.requested.set()

    def checkpoint_agreed(self) -> bool:
        """Collective: call it on every process at the same point. True everywhere when any process got
        SIGTERM."""
        return self.requested.check()

    def execute_jit_checkpoint(self) -> None:
        self.is_checkpoint_requested = False
        note(f"SIGTERM: saving checkpoint-{self.trainer.state.global_step} and stopping "
             "(enable_jit_checkpoint)")
        self.trainer._save_checkpoint(self.trainer.model_wrapped, trial=None)

    def restore_signal_handler(self) -> None:
        if self._original_sigterm_handler is not None:
            signal.signal(signal.SIGTERM, self._original_sigterm_handler)


class JITCheckpoint(JITCheckpointCallback):
    """transformers' `JITCheckpointCallback` acting on every process together (module docstring)."""

    jit_manager: CoordinatedCheckpointManager | None

    def __init__(self, trainer: Any = None) -> None:
        super().__init__()
        if trainer is not None:
            self.set_trainer(trainer)

    def set_trainer(self, trainer: Any) -> None:
        self.trainer = trainer
        if trainer.args.enable_jit_checkpoint:
            self.jit_manager = CoordinatedCheckpointManager(trainer)
            self.jit_manager.setup_signal_handler()

    # transformers' callback also checks at step begin, before the optimizer step and at epoch end,
    # each process on its own flag: here the one check is collective, at the end of each optimizer
    # step.
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return control

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        manager = self.jit_manager
        # every process is at the end of the same step
        if manager is not None and manager.checkpoint_agreed():
            control.should_save = False  # this save replaces the scheduled one of the same step
            manager.execute_jit_checkpoint()
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.jit_manager is not None:
            self.jit_manager.restore_signal_handler()
        return control
