"""`enable_jit_checkpoint=True`: on SIGTERM (a preemption, `kill`, the launcher shutting down) save a checkpoint and
stop training cleanly, on every process at once.

transformers' own callback acts per process: each one that received SIGTERM waits 3 s, then saves at its next step
boundary. With several processes they reach that point at different steps, and a save that runs collectives (FSDP,
DeepSpeed, the engine's loader positions) hangs or mixes steps. Here SIGTERM only raises a flag; at the end of
every optimizer step the processes all-reduce it (one 1-element all-reduce per step, only with this option on), so
either all of them save the same step and stop, or none does. No grace period: torch elastic gives the workers 30 s
between SIGTERM and SIGKILL, and the save must fit in it.
"""

from __future__ import annotations

import signal
from typing import Any

from transformers import TrainerCallback

from ..log import note
from ..trigger import Trigger


class JITCheckpoint(TrainerCallback):
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.requested = Trigger(trainer.accelerator.process)
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.requested.set()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.requested.check():  # collective: every process is at the end of the same optimizer step
            note(f"SIGTERM: saving checkpoint-{state.global_step} and stopping (enable_jit_checkpoint)")
            control.should_save = False  # this save replaces the scheduled one of the same step
            self.trainer._save_checkpoint(self.trainer.model_wrapped, trial=None)
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        signal.signal(signal.SIGTERM, self._previous)
