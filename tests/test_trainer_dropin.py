"""transformers' Trainer behaviour that hf_backend.Trainer keeps (issue 16): the numbers it reports, the accelerator
attributes it and its users read, the options it must not ignore and the error phrases code matches on."""

from __future__ import annotations

import pytest
import torch
from helpers import Regression
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from hf_backend import Accelerator, HfBackendError, Trainer, TrainingArguments
from hf_backend.config.options import GradientAccumulationPlugin

ROWS, BATCH = 66, 8  # the last batch holds 2 rows




class Stream(IterableDataset):
    """A dataset without random access (a stream), here with a known length."""

    def __init__(self, rows: int = ROWS) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(rows, 4, generator=generator)
        self.y = torch.randn(rows, generator=generator)

    def __iter__(self):
        for x, y in zip(self.x, self.y):
            yield {"x": x, "labels": y}

    def __len__(self) -> int:
        return len(self.x)


def _arguments(tmp_path, **kwargs) -> TrainingArguments:
    kwargs.setdefault("output_dir", str(tmp_path / "out"))
    return TrainingArguments(report_to="none", per_device_eval_batch_size=BATCH, disable_tqdm=True, **kwargs)


def test_eval_loss_on_a_stream_with_a_short_last_batch_is_the_mean_over_rows(tmp_path):
    data = Stream()
    model = Regression()
    with torch.no_grad():
        expected = ((model(data.x)["logits"] - data.y) ** 2).mean().item()  # every row counts once
    metrics = Trainer(model=model, args=_arguments(tmp_path), eval_dataset=data).evaluate()
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-6)


def test_gather_for_metrics_cuts_a_streams_short_last_batch():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(Stream(), batch_size=BATCH))
    sizes = [len(acc.gather_for_metrics(batch["labels"].mean().repeat(BATCH))) for batch in loader]
    assert sizes == [BATCH] * (ROWS // BATCH) + [ROWS % BATCH]
    full = acc.prepare(DataLoader(Stream(64), batch_size=BATCH))  # a multiple of the batch: nothing is cut
    assert [len(acc.gather_for_metrics(b["labels"])) for b in full] == [BATCH] * 8


def test_the_accelerator_shows_what_the_trainer_was_given(tmp_path):
    config = {"split_batches": False, "dispatch_batches": False, "even_batches": True, "use_seedable_sampler": True,
              "gradient_accumulation_kwargs": {"sync_each_batch": True, "adjust_scheduler": False}}
    trainer = Trainer(model=Regression(), args=_arguments(tmp_path, accelerator_config=config))
    acc = trainer.accelerator
    assert acc.dispatch_batches is False and acc.use_seedable_sampler is True
    assert acc.gradient_state.plugin_kwargs == {"num_steps": 1, "sync_each_batch": True, "adjust_scheduler": False}
    loader = trainer.get_eval_dataloader(Stream())
    assert loader.total_batch_size == BATCH and loader.batch_size == BATCH
    assert acc.unwrap_model(nn.DataParallel(trainer.model)) is trainer.model


def test_plugin_kwargs_is_the_live_record_as_in_accelerate():
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    assert acc.gradient_state.plugin_kwargs == {"num_steps": 2}
    acc.gradient_state.plugin_kwargs["num_steps"] = 3  # what scripts and libraries do
    assert acc.gradient_accumulation_steps == 3
    model, opt = acc.prepare(nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
    pattern = []
    for _ in range(6):
        with acc.accumulate(model):
            pattern.append(acc.sync_gradients)
    assert pattern == [False, False, True] * 2


def test_sync_each_batch_still_accumulates():
    """Accelerate's sync_each_batch all-reduces every micro step but steps the optimizer every num_steps."""
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True))
    model = acc.prepare(nn.Linear(2, 1))
    pattern = []
    for _ in range(4):
        with acc.accumulate(model):
            pattern.append(acc.sync_gradients)
    assert pattern == [False, True, False, True]


def test_use_configured_state_without_a_state_is_an_error(tmp_path, monkeypatch):
    import hf_backend.runtime.process as state

    monkeypatch.setattr(state, "_STATE", None)
    with pytest.raises(ValueError, match="requires a pre-configured `AcceleratorState` or `PartialState`") as err:
        _arguments(tmp_path, accelerator_config={"use_configured_state": True}).device  # noqa: B018
    assert isinstance(err.value, HfBackendError) and "\n" not in str(err.value)
    monkeypatch.setattr(state, "_STATE", None)
    Accelerator()  # a configured state: accepted
    assert _arguments(tmp_path, accelerator_config={"use_configured_state": True}).device.type == "cpu"


def test_errors_keep_transformers_phrases(tmp_path):
    with pytest.raises(ValueError, match=r"No valid checkpoint found in output directory") as err:
        Trainer(model=Regression(), args=_arguments(tmp_path), train_dataset=Stream()).train(
            resume_from_checkpoint=True)
    assert isinstance(err.value, HfBackendError)
    config = {"gradient_accumulation_kwargs": {"num_steps": 4}}
    with pytest.raises(ValueError, match=r"The `AcceleratorConfig`'s `num_steps` is set but "
                                         r"`gradient_accumulation_steps` is greater than 1"):
        Trainer(model=Regression(), args=_arguments(tmp_path, accelerator_config=config,
                                                    gradient_accumulation_steps=2))


def test_accelerates_parallelism_config_is_read_once_into_ours(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig  # what transformers' docs pass

    import hf_backend

    args = _arguments(tmp_path, parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2))
    assert isinstance(args.parallelism_config, hf_backend.ParallelismConfig)
    assert (args.parallelism_config.tp_size, args.parallelism_config.dp_shard_size) == (2, 2)
    assert args.to_dict()["parallelism_config"]["tp_size"] == 2
    # Accelerate's sequence parallelism (sp_backend "deepspeed", its default) runs as hf_backend's Ulysses
    args = _arguments(tmp_path, parallelism_config=ParallelismConfig(sp_size=2))
    assert (args.parallelism_config.sp_size, args.parallelism_config.sp_backend) == (2, "deepspeed")
    with pytest.raises(ValueError, match=r"^ParallelismConfig sp_backend='megatron': use 'deepspeed' or 'hf_backend'"):
        _arguments(tmp_path, parallelism_config={"sp_size": 2, "sp_backend": "megatron"})


def test_deepspeed_in_one_process_names_the_sections_it_does_not_use(tmp_path, monkeypatch):
    notes: list[str] = []
    monkeypatch.setattr("hf_backend.strategies.note", notes.append)
    config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}}
    Trainer(model=Regression(), args=_arguments(tmp_path, deepspeed=config))
    assert any("the config's optimizer (Lamb) and scheduler (WarmupDecayLR) sections are not used" in n
               for n in notes), notes


class OrderLogging(nn.Module):
    """transformers' test_resume_batch_order model: a buffer logs the rows it saw (so it grows), and the module's own
    `load_state_dict` (without torch's `assign` parameter) resizes it before loading."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3, bias=False)
        self.register_buffer("seen", torch.empty(0, dtype=torch.long))

    def load_state_dict(self, state_dict, strict=True):
        if "seen" in state_dict and state_dict["seen"].shape != self.seen.shape:
            self.seen = state_dict["seen"].clone()
        return super().load_state_dict(state_dict, strict=strict)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        self.seen = torch.cat([self.seen, x[:, 0].long()])
        return {"loss": nn.functional.cross_entropy(self.fc(x), labels)}


def test_a_model_with_its_own_load_state_dict_resumes_mid_epoch_in_the_same_order(tmp_path):
    rows = [{"x": torch.tensor([float(i), 1.0, 2.0, 3.0]), "labels": torch.tensor(i % 3)} for i in range(10)]

    def train(output_dir: str, resume: str | None = None) -> torch.Tensor:
        torch.manual_seed(42)
        args = _arguments(tmp_path, output_dir=str(tmp_path / output_dir), per_device_train_batch_size=2,
                          num_train_epochs=3, save_steps=1, learning_rate=0.1, optim="sgd", seed=42)
        trainer = Trainer(model=OrderLogging(), args=args, train_dataset=rows)
        trainer.train(resume_from_checkpoint=resume)
        return trainer.model.seen

    whole = train("whole")
    resumed = train("resumed", resume=str(tmp_path / "whole" / "checkpoint-6"))  # inside the second epoch
    assert len(whole) == 30 and torch.equal(whole, resumed)


def test_resuming_from_a_missing_checkpoint_says_transformers_phrase(tmp_path):
    trainer = Trainer(model=Regression(), args=_arguments(tmp_path, max_steps=2), train_dataset=Stream())
    missing = tmp_path / "out" / "checkpoint-5-bogus"
    with pytest.raises(HfBackendError, match=f"Can't find a valid checkpoint at {missing}: no such directory"):
        trainer.train(resume_from_checkpoint=str(missing))
    with pytest.raises(HfBackendError, match=r"No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)
