"""hf_backend.Trainer across the transformers versions it supports (hf_backend/trainer/transformers_compat.py): the
epoch loop it borrows is the one recorded for the installed version, and the names that changed resolve."""

from __future__ import annotations

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from hf_backend.core import enums as hf_backend_enums  # noqa: E402
from hf_backend.trainer import Trainer, accelerate_names  # noqa: E402
from hf_backend.trainer import transformers_compat as compat  # noqa: E402


def test_the_installed_transformers_is_supported():
    release = tuple(int(part) for part in compat.minor().split("."))
    assert compat.OLDEST <= release <= compat.NEWEST, f"transformers {transformers.__version__} is not supported"
    assert set(compat.RUN_EPOCH_FINGERPRINTS) == {f"5.{m}" for m in range(compat.OLDEST[1], compat.NEWEST[1] + 1)}


def test_the_borrowed_epoch_loop_is_the_recorded_one():
    """Fails when transformers changes Trainer._run_epoch: read the change (`git diff` of the two releases' trainer.py,
    or pip download both wheels), make sure the engine still provides what the new loop calls, then record the new
    fingerprint in RUN_EPOCH_FINGERPRINTS."""
    found = compat.fingerprint(transformers.Trainer._run_epoch)
    recorded = compat.RUN_EPOCH_FINGERPRINTS.get(compat.minor())
    assert found == recorded, (f"transformers {transformers.__version__}: Trainer._run_epoch has fingerprint {found}, "
                               f"recorded for {compat.minor()}: {recorded}")


def test_the_epoch_loop_runs_with_the_engines_skip_first_batches():
    borrowed = Trainer._run_epoch
    theirs = transformers.Trainer._run_epoch.__code__
    # transformers' code, with one statement in its device form (the next test)
    assert borrowed.__code__.co_filename == theirs.co_filename
    assert borrowed.__code__.co_firstlineno == theirs.co_firstlineno
    assert borrowed.__globals__["skip_first_batches"] is accelerate_names._skip_first_batches
    # every name it imports from accelerate is the engine's (accelerate_names.unmapped passes over
    # the methods hf_backend.Trainer overrides, this one included)
    for name in accelerate_names._accelerate_names(transformers.Trainer._run_epoch):
        assert borrowed.__globals__[name] is accelerate_names.ENGINE_OBJECTS[name], name
    assert transformers.Trainer._run_epoch.__globals__.get("skip_first_batches") is not borrowed.__globals__[
        "skip_first_batches"]


def test_the_logged_loss_statement_is_replaced():
    """The installed transformers' `_run_epoch` holds the statement that adds the step's loss to the
    logged sum exactly as recorded (transformers_compat._LOGGED_LOSS): the Trainer runs its device
    form; everything else in the loop is transformers' code."""
    ours, theirs = Trainer._run_epoch.__code__, transformers.Trainer._run_epoch.__code__
    assert set(ours.co_names) - set(theirs.co_names) == {"_loss_to_log"}
    assert set(theirs.co_names) - set(ours.co_names) == {
        "logging_nan_inf_filter", "isnan", "isinf", "ValueError", "_globalstep_last_logged"}

    def loop(self):
        self._tr_loss += tr_loss_step  # noqa: F821 - never run
    assert compat.loss_filter_on_device(loop) is loop  # not found: unchanged


def test_every_name_transformers_imports_from_accelerate_has_the_engines_object():
    """transformers' Trainer and TrainingArguments methods that hf_backend inherits look up no accelerate name that
    the engine does not provide: without the accelerate package none of them ends in a NameError (the clean install,
    tests/install/check.py, runs them)."""
    from hf_backend import TrainingArguments

    trainer_names = accelerate_names.imported_from_accelerate("transformers.trainer")
    assert {"DistributedType", "skip_first_batches", "clear_device_cache", "AcceleratorState"} <= trainer_names
    assert "AcceleratorConfig" in accelerate_names.imported_from_accelerate("transformers.training_args")
    assert accelerate_names.unmapped(transformers.Trainer, Trainer) == {}
    assert accelerate_names.unmapped(transformers.TrainingArguments, TrainingArguments) == {}
    from hf_backend.trainer.pipeline_steps import PipelineSteps

    step = super(PipelineSteps, Trainer).training_step  # what it runs without pipeline stages
    assert step.__code__ is transformers.Trainer.training_step.__code__
    assert step.__globals__["DistributedType"] is hf_backend_enums.DistributedType
    parallel_mode = TrainingArguments.parallel_mode.fget
    assert parallel_mode.__globals__["DistributedType"] is hf_backend_enums.DistributedType


def test_an_accelerator_config_is_read_without_accelerate(tmp_path):
    """transformers builds AcceleratorConfig only when accelerate is installed; the engine's arguments always do."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    from hf_backend import TrainingArguments
    from hf_backend.core.errors import ConfigError

    path = tmp_path / "accelerator.json"
    path.write_text('{"split_batches": true}')
    for given, split in ((None, False), ({"split_batches": True}, True), (str(path), True),
                         (AcceleratorConfig(split_batches=True), True)):
        args = TrainingArguments(output_dir=str(tmp_path), accelerator_config=given, report_to="none")
        assert isinstance(args.accelerator_config, AcceleratorConfig)
        assert args.accelerator_config.split_batches is split
        assert args.to_dict()["accelerator_config"]["split_batches"] is split
    # transformers' test_accelerator_config_not_instantiated: the class, given or as a subclass's field default, is
    # NotImplementedError with transformers' message (and a ConfigError, as the engine's other config errors)
    @dataclasses.dataclass
    class CustomAcceleratorConfig(AcceleratorConfig):
        pass

    @dataclasses.dataclass
    class CustomTrainingArguments(TrainingArguments):
        accelerator_config: dict = dataclasses.field(default=CustomAcceleratorConfig)

    for make in (lambda: TrainingArguments(output_dir=str(tmp_path), accelerator_config=AcceleratorConfig),
                 lambda: CustomTrainingArguments(output_dir=str(tmp_path))):
        with pytest.raises(NotImplementedError, match="^Tried passing in a callable to `accelerator_config`") as err:
            make()
        assert isinstance(err.value, ConfigError) and "fully constructed `AcceleratorConfig`" in str(err.value)
    with pytest.raises(ConfigError, match=r"accelerator_config: 3 is neither a dict"):
        TrainingArguments(output_dir=str(tmp_path), accelerator_config=3, report_to="none")


def test_the_fingerprint_ignores_comments_and_blank_lines_only():
    one = """
        def loop(x):
            y = x + 1  # a comment
            return y
    """
    same = """
            def loop(x):
                # another comment

                y = x + 1
                return y
    """
    changed = one.replace("x + 1", "x + 2")
    assert compat.source_fingerprint(one) == compat.source_fingerprint(same) != compat.source_fingerprint(changed)


def test_the_names_that_changed_resolve():
    fields = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    assert compat.ACTIVATION_CHECKPOINTING_ARGUMENT in fields
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=1, intermediate_size=8))
    assert compat.model_activation_checkpointing(model) is False
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable  # <5.23
    enable()
    assert compat.model_activation_checkpointing(model) is True
