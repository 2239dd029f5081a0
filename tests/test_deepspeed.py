"""DeepSpeed ZeRO through the engine, 2 gloo processes: parity with DDP, accumulation, checkpoints, auto values."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import BERT_LOOP, BERT_TRAIN, relative_difference, run_report

from hf_backend import DeepSpeedPlugin, HfBackendError
from hf_backend.config.options import GradientAccumulationPlugin, Handlers
from hf_backend.state import ProcessState
from hf_backend.training.gradient_state import GradientState
from hf_backend.training.precision import Precision

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
from bert_loop import CONFIG, data  # noqa: E402 - tests/scripts, on pytest's `pythonpath` (pyproject)

from hf_backend.strategies import DeepSpeedStrategy  # noqa: E402

LOOP, TRAIN, _relative = BERT_LOOP, BERT_TRAIN, relative_difference


def _tracks_fp32(run: dict, bert_ddp: dict) -> None:
    """A bf16 run of the loop's defaults (16 steps of 2 ranks x 8 samples) against the fp32 DDP run's first epoch,
    which steps on the same 16 samples each time (2 ranks x 4, 2 accumulated; the fp32 ZeRO-3 run of the defaults
    matches it): a few bf16 roundings apart (its spacing near 0.69 is 0.004), and learning."""
    losses, reference = run["losses"], bert_ddp["losses"][:16]
    assert len(losses) == 16 and max(abs(a - b) for a, b in zip(losses, reference)) <= 0.02, (losses, reference)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_ddp(bert_ddp, tmp_path, stage):
    run = run_report(LOOP, tmp_path / "r.json", [*TRAIN, "--zero", str(stage)], nproc=2)
    assert run["distributed_type"] == "DEEPSPEED" and len(run["losses"]) == 32
    assert _relative(run["losses"], bert_ddp["losses"]) <= 1e-4
    assert abs(run["grad_norm"] - bert_ddp["grad_norm"]) <= 1e-4 * bert_ddp["grad_norm"]
    # ZeRO partitions the optimizer state over the 2 ranks.
    assert run["per_rank"][0]["bytes_optim"] <= 0.55 * bert_ddp["per_rank"][0]["bytes_optim"]


def test_accumulation_two_by_eight_equals_one_by_sixteen(tmp_path):
    two = run_report(LOOP, tmp_path / "a.json", ["--zero", "2", "--batch-size", "8", "--grad-accum", "2"], nproc=2)
    one = run_report(LOOP, tmp_path / "b.json", ["--zero", "2", "--batch-size", "16"], nproc=2)
    assert _relative(two["losses"], one["losses"]) <= 1e-5


def test_zero3_resume_and_save_model(bert_ddp, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run_report(LOOP, tmp_path / "a.json", [*TRAIN, "--zero", "3", "--stop-after", "11", "--checkpoint", ckpt],
                       nproc=2)
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and (tmp_path / "ckpt" / "optimizer.bin").is_file()
    second = run_report(LOOP, tmp_path / "b.json", [*TRAIN, "--zero", "3", "--resume", "--checkpoint", ckpt,
                                                    "--save-model", str(tmp_path / "model")], nproc=2)
    # stopped after step 11 of 32 and resumed: the uninterrupted run's losses (ZeRO-3 equals DDP, test above)
    assert len(first["losses"]) == 11 and _relative(first["losses"] + second["losses"], bert_ddp["losses"]) <= 1e-5
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        logits = loaded(input_ids=data(4).tensors[0]).logits
    torch.testing.assert_close(logits, torch.tensor(second["logits"]))


def test_bf16_zero3_trains_and_saves_bf16_weights(bert_ddp, tmp_path):
    run = run_report(LOOP, tmp_path / "r.json", ["--zero", "3", "--mixed-precision", "bf16",
                                                 "--save-model", str(tmp_path / "model")], nproc=2)
    _tracks_fp32(run, bert_ddp)
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        logits = loaded(input_ids=data(4).tensors[0]).logits
    assert next(loaded.parameters()).dtype == torch.bfloat16  # the gathered 16-bit weights
    torch.testing.assert_close(logits.float(), torch.tensor(run["logits"]), atol=0.05, rtol=0.05)  # bf16 precision


# The config dict of the Ray and Accelerate docs (ZeRO-3, CPU optimizer offload, "auto" sizes), with bf16 in place of
# its fp16: DeepSpeed's CPU accelerator is what runs here.
DOCS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "gather_16bit_weights_on_model_save": True, "round_robin_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 10,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_the_docs_dict_with_bf16_and_cpu_offload_trains_and_saves(bert_ddp, tmp_path):
    run = run_report(LOOP, tmp_path / "r.json", ["--zero", "3", "--mixed-precision", "bf16", "--ds-config",
                                                 json.dumps(DOCS_CONFIG), "--save-model", str(tmp_path / "model")],
                     nproc=2, timeout=400)  # the first use compiles DeepSpeed's CPU Adam
    _tracks_fp32(run, bert_ddp)
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        logits = loaded(input_ids=data(4).tensors[0]).logits
    torch.testing.assert_close(logits.float(), torch.tensor(run["logits"]), atol=0.05, rtol=0.05)


def test_the_docs_dict_as_written_with_fp16_names_what_works():
    fp16 = {**DOCS_CONFIG, "fp16": {"enabled": True}}
    fp16.pop("bf16")
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**CONFIG))
    strategy = _strategy(hf_ds_config=fp16)
    with pytest.raises(HfBackendError, match="fp16.enabled: DeepSpeed's CPU accelerator does not run fp16"):
        strategy._resolve(strategy.config, model, _loader())


def _strategy(precision: str = "no", steps: int = 1, **plugin) -> DeepSpeedStrategy:
    state = ProcessState(torch.device("cpu"), 2, 0, 0, 2, "gloo")
    return DeepSpeedStrategy(state, Precision(precision, state.device), Handlers(), DeepSpeedPlugin(**plugin),
                             GradientState(GradientAccumulationPlugin(num_steps=steps)))


def _loader(batch: int = 8) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data(32), batch_size=batch)


def test_auto_values_are_resolved_from_the_prepared_objects():
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**CONFIG))
    docs_like = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                 "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                       "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                       "stage3_param_persistence_threshold": "auto", "round_robin_gradients": True,
                                       "stage3_gather_16bit_weights_on_model_save": True}}
    strategy = _strategy("bf16", steps=2, hf_ds_config=docs_like, gradient_clipping=0.5)
    config = strategy._resolve(strategy.config, model, _loader(8))
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (8, 2, 32)
    assert config["gradient_clipping"] == 0.5 and config["bf16"]["enabled"] is True
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (32 * 32, int(0.9 * 32 * 32), 320)


@pytest.mark.parametrize(("config", "message"), [
    ({"zero_optimization": {"stage": 2}, "wall_clock_breakdown": "auto"}, "wall_clock_breakdown is \"auto\""),
])
def test_unresolvable_auto_values_are_named(config, message):
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**CONFIG))
    strategy = _strategy(hf_ds_config=config)
    with pytest.raises(HfBackendError, match=message):
        strategy._resolve(strategy.config, model, _loader())


def test_micro_batch_needs_the_loader_and_plugin_contradictions_fail():
    model = torch.nn.Linear(2, 2)
    strategy = _strategy()
    with pytest.raises(HfBackendError, match="pass the training DataLoader to the same prepare"):
        strategy._resolve(strategy.config, model, None)
    with pytest.raises(HfBackendError, match=r"^DeepSpeedPlugin: stage=3 contradicts 1 in hf_ds_config; keep one$"):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}}, zero_stage=3).config()
    with pytest.raises(HfBackendError, match="fp16"):
        _strategy("fp16")
    with pytest.raises(HfBackendError, match="gradient_accumulation_steps is 2 in the Accelerator and 4"):
        _strategy(steps=2, hf_ds_config={"gradient_accumulation_steps": 4})._resolve(
            {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}, model, _loader())


def test_a_json_config_path_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert DeepSpeedPlugin(hf_ds_config=str(path)).config()["zero_optimization"]["stage"] == 3
    path.write_text("{oops")
    with pytest.raises(HfBackendError, match="ds.json: line 1: malformed JSON"):
        DeepSpeedPlugin(hf_ds_config=str(path)).config()


def test_zero3_init_flag_partitions_parameters_while_from_pretrained_builds(tmp_path):
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(transformers.BertConfig(**CONFIG)).save_pretrained(tmp_path / "m")
    args = ["--zero", "3", "--from-pretrained", str(tmp_path / "m")]
    plain = run_report(LOOP, tmp_path / "a.json", args, nproc=2)
    partitioned = run_report(LOOP, tmp_path / "b.json", [*args, "--zero3-init"], nproc=2)
    assert not plain["partitioned_before_prepare"] and partitioned["partitioned_before_prepare"]
    assert partitioned["losses"] == plain["losses"]


def test_config_optimizer_and_scheduler_through_placeholders(bert_ddp, tmp_path):
    own = run_report(LOOP, tmp_path / "b.json", [*TRAIN, "--zero", "2", "--ds-optimizer", "optimizer"], nproc=2)
    # DeepSpeed's AdamW with the "auto" lr / weight decay of DummyOptim trains what torch's AdamW trains under DDP
    assert _relative(own["losses"], bert_ddp["losses"]) <= 1e-5
    warm = run_report(LOOP, tmp_path / "c.json", ["--zero", "2", "--ds-optimizer", "optimizer+scheduler"], nproc=2)
    lrs = warm["lrs"]
    assert lrs[0] < lrs[2] < lrs[3] == pytest.approx(1e-3)  # warm-up over warmup_num_steps=4
    assert lrs[4:] == pytest.approx([1e-3] * len(lrs[4:]))


def test_placeholders_and_sections_must_go_together():
    from hf_backend.utils import DummyOptim, DummyScheduler

    model = torch.nn.Linear(2, 2)
    strategy = _strategy(hf_ds_config={"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    with pytest.raises(HfBackendError, match=r'config defines an "optimizer": prepare DummyOptim'):
        strategy._resolve_placeholders(strategy.config, torch.optim.SGD(model.parameters(), lr=0.1), None)
    dummy = DummyOptim(model.parameters(), lr=0.5)
    strategy._resolve_placeholders(strategy.config, dummy, None)
    assert strategy.config["optimizer"]["params"]["lr"] == 0.5
    with pytest.raises(HfBackendError, match=r'optimizer.params.momentum is "auto" and nothing here resolves it'):
        strategy._resolve_placeholders({"optimizer": {"type": "SGD", "params": {"momentum": "auto"}}}, dummy, None)
    with pytest.raises(HfBackendError, match='DummyOptim needs an "optimizer" section'):
        _strategy()._resolve_placeholders({"zero_optimization": {"stage": 2}}, dummy, None)
    with pytest.raises(HfBackendError, match='DummyScheduler needs a "scheduler" section'):
        _strategy()._resolve_placeholders({"zero_optimization": {"stage": 2}}, None, DummyScheduler(dummy))
    from hf_backend import Accelerator

    with pytest.raises(HfBackendError, match="DummyOptim stands in for a DeepSpeed config's optimizer"):
        Accelerator().prepare(model, DummyOptim(model.parameters()))


def test_an_accelerate_plugin_object_is_read_by_its_fields():
    accelerate = pytest.importorskip("accelerate")
    theirs = accelerate.DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}}, gradient_clipping=0.7)
    config = DeepSpeedPlugin.from_object(theirs).config()
    assert config["zero_optimization"]["stage"] == 3 and config["gradient_clipping"] == 0.7
