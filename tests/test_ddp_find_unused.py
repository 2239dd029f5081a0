"""find_unused_parameters=None (hf_backend.Trainer's default under DDP): DDP finds the unused parameters on the first
synchronized step and searches again on every step only if that step had some. Checked against find_unused=True
(DDP's search on every step, transformers' default) in 2 processes: the same parameters, bit for bit."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_backend.trainer import trainer as trainer_module


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    from helpers import run_report

    return run_report("find_unused.py", tmp_path_factory.mktemp("find_unused") / "r.json", [], nproc=2)


def test_every_parameter_used_stops_the_search_after_the_first_step(report):
    case = report["all_used"]
    assert case == {"difference": 0.0, "ranks_agree": True, "searching": False}


@pytest.mark.parametrize("case", ["never_used", "rank0_only"])
def test_unused_parameters_keep_the_search_and_train_as_with_it(report, case):
    """A parameter no rank uses keeps no gradient; one only rank 0 uses gets rank 1's zeros: as DDP's search does."""
    assert report[case] == {"difference": 0.0, "ranks_agree": True, "searching": True}


def test_trainer_defaults_find_once_and_train_as_transformers_default(report):
    case = report["trainer"]
    assert case["steps"] == 6 and case["difference"] == 0.0 and case["loss_difference"] == 0.0
    assert case["searching"] is False, "a BERT classifier uses every parameter: no search after the first step"


def test_models_whose_graph_varies_keep_transformers_default():
    def bert(**extra):
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8, **extra))

    assert not trainer_module._graph_may_vary(bert())
    assert trainer_module._graph_may_vary(bert(layerdrop=0.1))  # layers dropped at random in training
    assert trainer_module._graph_may_vary(bert(num_local_experts=4))  # routed experts
    assert trainer_module._graph_may_vary(bert().bert.encoder)  # not a PreTrainedModel: anything may branch


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        return {"loss": self.linear(x).sum()}


@pytest.mark.parametrize("model, extra, expected", [
    ("bert", {}, None),  # found once
    ("bert", {"gradient_checkpointing": True}, False),  # transformers' False: the search breaks reentrant checkpoints
    ("bert_layerdrop", {}, True),
    ("plain", {"gradient_checkpointing": True}, True),  # not a PreTrainedModel: transformers' True, checkpointing too
    ("bert", {"ddp_find_unused_parameters": True}, True),
])
def test_the_trainer_default_reaches_the_engine(tmp_path, model, extra, expected):
    from hf_backend import Trainer, TrainingArguments

    config = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                     intermediate_size=8, layerdrop=0.1 if model == "bert_layerdrop" else 0.0)
    net = _Plain() if model == "plain" else transformers.BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **extra)
    trainer = Trainer(model=net, args=args)
    assert trainer.accelerator.strategy.handlers.ddp.find_unused_parameters is expected
