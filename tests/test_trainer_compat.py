"""hf_backend.Trainer across the transformers versions it supports (hf_backend/trainer/transformers_compat.py): the
epoch loop it borrows is the one recorded for the installed version, and the names that changed resolve."""

from __future__ import annotations

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from hf_backend.trainer import Trainer, trainer  # noqa: E402
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


def test_the_borrowed_loop_runs_with_the_engines_skip_first_batches():
    borrowed = Trainer._run_epoch
    assert borrowed.__code__ is transformers.Trainer._run_epoch.__code__  # transformers' code, unchanged
    for name in compat.RUN_EPOCH_REBOUND:
        assert name in borrowed.__code__.co_names
    assert borrowed.__globals__["skip_first_batches"] is trainer._skip_first_batches
    assert transformers.Trainer._run_epoch.__globals__["skip_first_batches"] is not trainer._skip_first_batches


def test_a_name_the_loop_no_longer_uses_is_an_error():
    with pytest.raises(ImportError, match="no longer uses"):
        compat.borrowed_run_epoch(skip_first_batches=None, not_a_global_of_the_loop=None)


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
