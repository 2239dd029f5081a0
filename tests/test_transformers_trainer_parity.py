"""What transformers' own Trainer tests (tests/trainer, CPU part) expect of the accelerator and the Trainer, which
hf_backend.Trainer failed (issue 31, item 8): the gradient-accumulation record, Accelerate's `_reset_state`, and
the JIT checkpoint callback being a transformers `JITCheckpointCallback`. All in this process, a few seconds."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
from helpers import Regression
from torch.utils.data import Dataset
from transformers import TrainerCallback
from transformers.trainer_jit_checkpoint import CheckpointManager, JITCheckpointCallback

import hf_backend.accelerator.states as accelerator_states
import hf_backend.runtime.process as process
from hf_backend import Accelerator, Trainer, TrainingArguments
from hf_backend.config.options import GradientAccumulationPlugin
from hf_backend.state import AcceleratorState, GradientState, PartialState
from hf_backend.trainer.jit_checkpoint import JITCheckpoint


class Rows(Dataset):
    def __init__(self, n: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = torch.randn(n, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


def _arguments(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", disable_tqdm=True, **kwargs)


@pytest.fixture
def fresh_state(monkeypatch):
    """The process state as before any Accelerator; whatever a test sets up is put back afterwards."""
    for name in ("_STATE", "_OUR_GROUP"):
        monkeypatch.setattr(process, name, None)
    monkeypatch.setattr(accelerator_states, "_CURRENT_ACCELERATOR_STATE", None)


# -- 1. gradient_state.plugin_kwargs keeps num_steps, as Accelerate's does ------------------------------------------
# Accelerate 1.15's plugin has no default for num_steps, so its to_kwargs() (which GradientState keeps) holds the
# value given, 1 included; the other options only when they differ from their defaults. The expected dicts below are
# what Accelerate 1.15 gives for the same arguments.
@pytest.mark.parametrize(("given", "expected"), [
    ({"num_steps": 1}, {"num_steps": 1}),
    ({"num_steps": 4, "sync_each_batch": True}, {"num_steps": 4, "sync_each_batch": True}),
    ({"num_steps": 1, "sync_each_batch": True, "adjust_scheduler": False},
     {"num_steps": 1, "adjust_scheduler": False, "sync_each_batch": True}),
])
def test_plugin_kwargs_keep_num_steps(given, expected):
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(**given))
    assert acc.gradient_state.plugin_kwargs == expected
    assert Accelerator(gradient_accumulation_steps=3).gradient_state.plugin_kwargs == {"num_steps": 3}
    assert Accelerator().gradient_state.plugin_kwargs == {"num_steps": 1}


def test_trainer_with_num_steps_1_in_accelerator_config(tmp_path):
    config = {"gradient_accumulation_kwargs": {"num_steps": 1}}
    trainer = Trainer(model=Regression(), args=_arguments(tmp_path, gradient_accumulation_steps=1,
                                                           accelerator_config=config))
    assert trainer.accelerator.gradient_state.plugin_kwargs["num_steps"] == 1
    assert "sync_each_batch" not in trainer.accelerator.gradient_state.plugin_kwargs
    GradientState._reset_state()  # Accelerate's test scripts call it; one state per Accelerator here: nothing to do
    assert trainer.accelerator.gradient_state.plugin_kwargs["num_steps"] == 1


# -- 2. Accelerate's _reset_state ------------------------------------------------------------------------------------
def test_use_configured_state_after_reset_state(tmp_path, fresh_state):
    Accelerator()
    AcceleratorState._reset_state(reset_partial_state=True)
    assert not process.process_state_is_set_up()
    with pytest.raises(ValueError, match="requires a pre-configured `AcceleratorState` or `PartialState`"):
        _arguments(tmp_path, accelerator_config={"use_configured_state": True})
    Accelerator()
    assert _arguments(tmp_path, accelerator_config={"use_configured_state": True}).device.type == "cpu"
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState()  # a PartialState configures it too
    assert _arguments(tmp_path, accelerator_config={"use_configured_state": True}).device.type == "cpu"


def test_state_reset_state_between_runs(fresh_state):
    acc = Accelerator(mixed_precision="bf16")
    assert AcceleratorState().mixed_precision == "bf16"
    acc.state._reset_state()  # as Accelerate's test scripts call it between runs
    assert AcceleratorState().mixed_precision == "no" and AcceleratorState().fsdp_plugin is None
    assert process.process_state_is_set_up()  # without reset_partial_state the process state stays
    assert acc.state.mixed_precision == "bf16" and acc.mixed_precision == "bf16"  # objects keep their state
    assert Accelerator(mixed_precision="no").state.mixed_precision == "no"
    PartialState._reset_state()
    assert not process.process_state_is_set_up()
    assert PartialState().num_processes == 1 and process.process_state_is_set_up()


def test_reset_state_keeps_the_process_group_and_who_tears_it_down(fresh_state):
    """The group stays (as in Accelerate); one hf_backend created is still torn down by hf_backend at exit, one
    someone else created is not."""
    assert not dist.is_initialized()
    try:
        for ours in (True, False):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            process._OUR_GROUP = dist.group.WORLD if ours else None  # as get_process_state records its own group
            first = PartialState().process
            AcceleratorState._reset_state(reset_partial_state=True)
            assert dist.is_initialized() and not process.process_state_is_set_up()
            again = PartialState().process
            assert again is not first and again.backend == "gloo" and again.owns_group is ours
            AcceleratorState._reset_state(reset_partial_state=True)
            process.shutdown_process_group()  # what runs at exit
            assert dist.is_initialized() is not ours
            if dist.is_initialized():
                dist.destroy_process_group()
            process._STATE = None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- 3. enable_jit_checkpoint: the coordinated callback is a transformers JITCheckpointCallback --------------------
@pytest.fixture
def sigterm_guard():
    """A SIGTERM handler of the test's own while it runs, so a signal that the callback did not take ends nothing."""
    got = []
    previous = signal.signal(signal.SIGTERM, lambda *_: got.append(1))
    yield got
    signal.signal(signal.SIGTERM, previous)


def test_trainer_has_one_jit_callback_and_it_is_the_coordinated_one(tmp_path, sigterm_guard):
    guard = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(model=Regression(), args=_arguments(tmp_path, enable_jit_checkpoint=True),
                      train_dataset=Rows())
    found = [c for c in trainer.callback_handler.callbacks if isinstance(c, JITCheckpointCallback)]
    assert len(found) == 1 and type(found[0]) is JITCheckpoint
    manager = found[0].jit_manager
    assert isinstance(manager, CheckpointManager) and found[0].trainer is trainer
    assert signal.getsignal(signal.SIGTERM) == manager._sigterm_handler  # transformers' handler is not left in
    assert manager._original_sigterm_handler is guard
    found[0].on_train_end(trainer.args, trainer.state, trainer.control)
    assert signal.getsignal(signal.SIGTERM) is guard
    plain = Trainer(model=Regression(), args=_arguments(tmp_path), train_dataset=Rows())
    assert not any(isinstance(c, JITCheckpointCallback) for c in plain.callback_handler.callbacks)


def test_per_process_hooks_do_not_save_only_the_step_end_decides(tmp_path, sigterm_guard):
    trainer = Trainer(model=Regression(), args=_arguments(tmp_path, enable_jit_checkpoint=True),
                      train_dataset=Rows())
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, JITCheckpointCallback))
    saved = []
    trainer._save_checkpoint = lambda model, trial: saved.append(trainer.state.global_step)
    callback.jit_manager._sigterm_handler(signal.SIGTERM, None)
    assert callback.jit_manager.is_checkpoint_requested  # this process got the signal
    control = trainer.control
    for hook in (callback.on_step_begin, callback.on_pre_optimizer_step, callback.on_epoch_end):
        hook(trainer.args, trainer.state, control)
    assert saved == [] and not control.should_training_stop
    control.should_save = True
    callback.on_step_end(trainer.args, trainer.state, control)
    assert saved == [0] and control.should_training_stop and not control.should_save
    assert not callback.jit_manager.is_checkpoint_requested
    control.should_training_stop = False
    callback.on_step_end(trainer.args, trainer.state, control)  # the flag was cleared: no second save
    assert saved == [0] and not control.should_training_stop
    callback.on_train_end(trainer.args, trainer.state, control)


class SigtermAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_the_step_and_stops(tmp_path, sigterm_guard):
    trainer = Trainer(model=Regression(), args=_arguments(tmp_path, enable_jit_checkpoint=True, max_steps=8,
                                                          save_steps=100, per_device_train_batch_size=8),
                      train_dataset=Rows(), callbacks=[SigtermAt(2)])
    trainer.train()
    assert trainer.state.global_step == 3 and sigterm_guard == []  # saved at the end of the step it came in
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert (out / "checkpoint-3" / "trainer_state.json").is_file()
    assert not (out / "checkpoint-3" / "checkpoint-is-incomplete.txt").exists()
    os.kill(os.getpid(), signal.SIGTERM)  # after train() the test's own handler is back
    assert sigterm_guard == [1]
