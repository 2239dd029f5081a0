"""The Trainer in one replica group of a fault-tolerant run (docs/fault_tolerance.md).

transformers' loop counts its steps itself; across replica groups two of its counters need the engine's word:
- a step the quorum discarded was not applied: `global_step` does not count it (a run with failures makes as many
  optimizer steps as one without, and stops at `max_steps` of them);
- a restarted group receives the live group's `TrainerState` and learning-rate scheduler (which transformers builds
  after `prepare`) with the engine's state (healing), and its `epoch`
  follows the train loader's position, which healing moves, not the loop's own count of batches since the restart.
Only replica group 0 writes checkpoints and reports logs (trainer.py asks `writes_for_the_run`): every group holds the
same weights, and one writer keeps `output_dir` and the trackers whole.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

# TrainerState's fields a healed group takes from the live one
_HEALED = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "best_metric", "best_global_step",
           "best_model_checkpoint", "log_history")


def writes_for_the_run(args: Any) -> bool:
    """Whether this process's group writes checkpoints and reports: every group, or group 0 of replica groups."""
    return args.replica_group is None or args.replica_group.replica_id == 0


class ReplicaGroupSteps(TrainerCallback):
    """Runs right after DefaultFlowCallback (trainer.py places it): a discarded step takes back the decisions made
    on its count (log, save, evaluate, stop at max_steps), and the callbacks after it see the corrected state."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.replicas = trainer.accelerator.replica_groups
        self.discarded = self.replicas.discarded
        self.replicas.register_state("trainer", self._state, self._load)
        self._loss_before: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the logged loss's running sum before this step's losses join it
        self._loss_before = self.trainer._tr_loss.detach().clone()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.replicas.discarded > self.discarded:  # not applied: not counted, logged, saved or evaluated
            self.discarded = self.replicas.discarded
            state.global_step -= 1
            control.should_log = control.should_save = control.should_evaluate = False
            control.should_training_stop = control.should_training_stop and state.global_step >= state.max_steps
            self.trainer._tr_loss.copy_(self._loss_before)
        loader = self.trainer._train_loader
        if loader is not None and len(loader):
            position = loader.state_dict()
            state.epoch = position["epoch"] + position["steps"] / len(loader)

    def _state(self) -> dict[str, Any]:
        trainer = self.trainer
        # transformers builds its scheduler after `prepare`, so the engine's healing does not hold it
        return {"state": {name: getattr(trainer.state, name) for name in _HEALED if hasattr(trainer.state, name)},
                "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None}

    def _load(self, saved: dict[str, Any]) -> None:
        trainer = self.trainer
        for name, value in saved["state"].items():
            setattr(trainer.state, name, value)
        if saved["lr_scheduler"] is not None:
            trainer.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        # the logged loss averages over the steps since the last log: from here on
        trainer._globalstep_last_logged = trainer.state.global_step
