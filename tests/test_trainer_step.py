"""The Trainer's per-step work around the model: what it reports stays transformers' numbers while the work that
does not change them is done once (benchmarks/trainer.py measures the step; docs/benchmarks.md has the figures)."""

from __future__ import annotations

import transformers
from helpers import bert_rows, tiny_bert

import hf_backend


def _train(module, tmp_path, count: list[int]):
    model = tiny_bert()
    counted = model.num_parameters

    def num_parameters(*args, **kwargs):
        count.append(1)
        return counted(*args, **kwargs)

    model.num_parameters = num_parameters
    args = module.TrainingArguments(output_dir=str(tmp_path / module.__name__), per_device_train_batch_size=4,
                                    max_steps=6, use_cpu=True, save_strategy="no", report_to="none",
                                    disable_tqdm=True, logging_steps=3)
    trainer = module.Trainer(model=model, args=args, train_dataset=bert_rows(24))
    trainer.train()
    return trainer


def test_total_flos_is_transformers_number_with_the_parameters_counted_once(tmp_path):
    ours, theirs = [], []
    trained = _train(hf_backend, tmp_path, ours)
    reference = _train(transformers, tmp_path, theirs)
    assert trained.state.total_flos == reference.state.total_flos > 0
    assert [entry.get("total_flos") for entry in trained.state.log_history] == \
        [entry.get("total_flos") for entry in reference.state.log_history]
    assert len(theirs) >= 6  # transformers counts at every step
    assert len(ours) == 1
