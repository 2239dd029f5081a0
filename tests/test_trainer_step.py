"""The Trainer's per-step work around the model: what it reports stays transformers' numbers while the work that
does not change them is done once (benchmarks/trainer.py measures the step; docs/benchmarks.md has the figures)."""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch
import transformers
from helpers import Regression, bert_rows, tiny_bert

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


class Spiking(Regression):
    """Regression whose training loss has `spikes[n]` added at its n-th training forward: a NaN or
    infinite loss on that step with the gradients unchanged (a constant added to the loss)."""

    def __init__(self, spikes: dict[int, float]) -> None:
        super().__init__()
        self.spikes, self.calls = spikes, 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = super().forward(x, labels)
        if self.training and labels is not None:
            self.calls += 1
            out["loss"] = out["loss"] + self.spikes.get(self.calls, 0.0)
        return out


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=generator), torch.randn(n, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


def _run_with_spikes(module, tmp_path, host_reads: list[str], **kwargs):
    """8 steps, logged every 2, with NaN and infinite losses first and last in a logging window and
    over a whole window; `host_reads` gets each read of a tensor by the epoch loop itself."""
    args = module.TrainingArguments(output_dir=str(tmp_path / module.__name__), max_steps=8,
                                    per_device_train_batch_size=8, use_cpu=True, save_strategy="no",
                                    report_to="none", disable_tqdm=True, logging_steps=2, **kwargs)
    spikes = {1: math.nan, 4: math.inf, 5: -math.inf, 6: math.nan, 7: 0.0}
    trainer = module.Trainer(model=Spiking(spikes), args=args, train_dataset=Rows())
    with _host_reads_in("_run_epoch", host_reads):
        trainer.train()
    return [entry.get("loss", entry.get("train_loss")) for entry in trainer.state.log_history]


@contextlib.contextmanager
def _host_reads_in(function: str, found: list[str]):
    """Records `bool(tensor)` and `tensor.item()` called directly from a function named `function`:
    on a GPU each waits for the device to finish its queued work."""
    originals = {name: getattr(torch.Tensor, name) for name in ("__bool__", "item")}

    def recording(name):
        original = originals[name]

        def read(tensor, *args, **kwargs):
            if sys._getframe(1).f_code.co_name == function:
                found.append(name)
            return original(tensor, *args, **kwargs)
        return read

    for name in originals:
        setattr(torch.Tensor, name, recording(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize("nan_inf_filter", [True, False])
def test_nan_inf_filter_logs_transformers_numbers_on_the_device(tmp_path, nan_inf_filter):
    """logging_nan_inf_filter: transformers' loop tests every step's loss on the host
    (`torch.isnan(loss) or torch.isinf(loss)`), hf_backend.Trainer on the device (no wait for it);
    the logged losses are the same numbers."""
    ours, theirs = [], []
    given = {"logging_nan_inf_filter": nan_inf_filter}
    logged = _run_with_spikes(hf_backend, tmp_path, ours, **given)
    reference = _run_with_spikes(transformers, tmp_path, theirs, **given)
    assert len(logged) == 5 and [repr(x) for x in logged] == [repr(x) for x in reference]
    assert all(math.isfinite(x) for x in logged) is nan_inf_filter
    assert ours == []
    assert (len(theirs) >= 8) is nan_inf_filter  # transformers reads the loss back at every step


def test_the_loss_check_leaves_each_module_in_its_own_mode(tmp_path):
    """The one-time check of whether the loss divides by `num_items_in_batch` also runs inside evaluation (its
    prediction_step asks for the count), where the model is in eval mode but its DDP wrapper may still say training:
    afterwards every module is in the mode it was in (it once set the whole model back to training there, so the
    first evaluation of a 2-process run ran with dropout on)."""

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    args = hf_backend.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = hf_backend.Trainer(model=model, args=args)
    class Wrapper(torch.nn.Module):  # as DDP: left in training mode around a model put in eval mode
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    wrapper = Wrapper(model)
    model.eval()
    trainer.model_wrapped = wrapper
    ids = torch.randint(0, 32, (2, 6))
    assert trainer._loss_divides_by_item_count({"input_ids": ids, "labels": ids})  # a causal LM: a sum / count
    assert wrapper.training and not any(module.training for module in model.modules())
