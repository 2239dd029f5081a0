"""The backend is chosen in one place (config/backend.py) and its FSDP options are resolved once on the way from
TrainingArguments to the strategy; launcher settings are read through one table; MULTI_CPU/MULTI_GPU comes from the
process state."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from helpers import DOCS_FSDP_YAML

from hf_backend import DeepSpeedPlugin, FullyShardedDataParallelPlugin, HfBackendError
from hf_backend.accelerator.connector import decided_backend
from hf_backend.config import backend as backend_module
from hf_backend.config import environment as env
from hf_backend.config.backend import ACCELERATOR, TRAINING_ARGUMENTS, choose_backend
from hf_backend.config.loader import validate
from hf_backend.config.options import Handlers
from hf_backend.config.plugins import fsdp_options
from hf_backend.core import notes
from hf_backend.core.enums import DistributedType
from hf_backend.state import ProcessState
from hf_backend.strategies import DDPStrategy, FSDPStrategy, select_strategy
from hf_backend.training.precision import Precision

TWO_CPU = ProcessState(torch.device("cpu"), 2, 0, 0, 2, "gloo")


def _launched(kind: str, **sections) -> object:
    return validate({"distributed_type": kind, **sections})


@pytest.fixture(autouse=True)
def own_notes(monkeypatch) -> None:
    """Notes are said once per process: these tests' own must not hide them from tests that assert on them."""
    monkeypatch.setattr(notes, "_said", set())


@pytest.fixture
def loading_variables(monkeypatch) -> None:
    """The variables an Accelerator with FSDP's cpu_ram_efficient_loading sets, unset now and after
    the test (processes that tests start inherit os.environ)."""
    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        monkeypatch.setenv(name, "")  # recorded, so the undo removes what the test's code sets
        monkeypatch.delenv(name)


@pytest.fixture
def resolutions(monkeypatch) -> list[FullyShardedDataParallelPlugin]:
    """Every FullyShardedDataParallelPlugin.resolved() call, by plugin."""
    calls: list[FullyShardedDataParallelPlugin] = []
    original = FullyShardedDataParallelPlugin.resolved

    def counting(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(FullyShardedDataParallelPlugin, "resolved", counting)
    return calls


def test_explicit_arguments_win_then_the_launcher_then_plain_data_parallelism(monkeypatch):
    notes: list[str] = []
    monkeypatch.setattr(backend_module, "note", notes.append)
    deepspeed_launch = _launched("DEEPSPEED", deepspeed_config={"zero_stage": 3})
    chosen = choose_backend(FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP"), None, deepspeed_launch)
    assert chosen.kind == "FSDP" and chosen.deepspeed is None
    assert chosen.fsdp.sharding_strategy == "SHARD_GRAD_OP" and chosen.fsdp.fsdp_version == 2
    assert notes == []  # the Accelerator overrides the launcher silently, as before
    chosen = choose_backend(True, None, deepspeed_launch, TRAINING_ARGUMENTS)
    assert (chosen.kind, chosen.fsdp, chosen.deepspeed) == ("FSDP", None, None)  # TrainingArguments read their own
    assert notes == ["TrainingArguments ask for FSDP; the launcher's distributed_type DEEPSPEED is not used"]

    launched = choose_backend(launch_config=deepspeed_launch)
    assert launched.kind == "DEEPSPEED" and launched.deepspeed.config()["zero_optimization"]["stage"] == 3
    fsdp_launch = _launched("FSDP", fsdp_config={"fsdp_state_dict_type": "SHARDED_STATE_DICT"})
    for caller in (ACCELERATOR, TRAINING_ARGUMENTS):  # the launcher's options are read here for both callers
        options = choose_backend(launch_config=fsdp_launch, caller=caller).fsdp
        assert options.state_dict_type == "SHARDED_STATE_DICT"
    assert choose_backend(launch_config=_launched("MULTI_CPU")).kind == "DATA_PARALLEL"
    assert choose_backend(launch_config=None) == backend_module.Backend("DATA_PARALLEL")


def test_both_backends_asked_for_is_each_callers_one_line_error():
    with pytest.raises(HfBackendError, match=r"^Accelerator\(\): pass fsdp_plugin or deepspeed_plugin, not both$"):
        choose_backend(FullyShardedDataParallelPlugin(), DeepSpeedPlugin(), None)
    with pytest.raises(HfBackendError, match="^TrainingArguments: fsdp and deepspeed are both set; keep one of them$"):
        choose_backend(True, {"zero_optimization": {}}, None, TRAINING_ARGUMENTS)


def test_the_launcher_environment_is_read_when_no_launch_config_is_passed(monkeypatch):
    monkeypatch.setenv(env.DISTRIBUTED_TYPE, "FSDP")
    monkeypatch.setenv(env.FSDP_CONFIG, json.dumps({"fsdp_transformer_layer_cls_to_wrap": "BertLayer"}))
    assert choose_backend().fsdp.transformer_cls_names_to_wrap == "BertLayer"


def test_the_docs_yaml_becomes_one_frozen_value_from_training_arguments_to_the_strategy(tmp_path, resolutions,
                                                                                     loading_variables,
                                                                                     two_fake_processes):
    """The file is read into FsdpOptions once, in TrainingArguments; the Trainer hands that value on, and the
    strategy runs from the same object (no plugin is resolved on the way)."""
    pytest.importorskip("transformers")
    from hf_backend import TrainingArguments

    config = tmp_path / "fsdp.yaml"
    config.write_text(DOCS_FSDP_YAML)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", fsdp_config=str(config))
    # What the Trainer does: Accelerator(backend=args.backend) takes the arguments' decision as it is.
    chosen = decided_backend(args.backend, None, None, None)
    assert chosen.kind == "FSDP"
    strategy = select_strategy(TWO_CPU, Precision("no", TWO_CPU.device), Handlers(), chosen)
    assert resolutions == []
    assert isinstance(strategy, FSDPStrategy) and strategy.options is args.fsdp_options is chosen.fsdp
    assert strategy.options.state_dict_type == args.fsdp_plugin.state_dict_type == "SHARDED_STATE_DICT"
    assert args.fsdp_config == strategy.options.to_dict()
    assert strategy.state_plugins()["fsdp_plugin"] is args.fsdp_plugin is args.fsdp_options
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.options.state_dict_type = "FULL_STATE_DICT"


def test_a_plugin_is_resolved_once_and_changing_it_afterwards_changes_nothing_resolved(resolutions):
    plugin = FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP")
    options = fsdp_options(plugin)
    assert fsdp_options(options) is options and len(resolutions) == 1
    assert (options.sharding_strategy, options.reshard_after_forward) == ("SHARD_GRAD_OP", False)
    plugin.activation_checkpointing = True
    assert not options.activation_checkpointing and fsdp_options(plugin).activation_checkpointing


def test_the_options_read_as_accelerates_plugin_and_back_from_their_dict(tmp_path):
    """`accelerator.state.fsdp_plugin` is the options themselves: code written for Accelerate's
    plugin finds every attribute it has (TRL's prepare_fsdp reads ignored_modules);
    `TrainingArguments.fsdp_config`, their plain dict, given back gives the same options."""
    plugin = FullyShardedDataParallelPlugin(sharding_strategy=2,
                                            transformer_cls_names_to_wrap=["BertLayer"])
    options = plugin.resolved()
    assert [f.name for f in dataclasses.fields(plugin) if not hasattr(options, f.name)] == []
    assert options.fsdp_version == 2 and options.ignored_modules is None
    assert options.reshard_after_forward is False  # SHARD_GRAD_OP's
    pytest.importorskip("transformers")
    from hf_backend import TrainingArguments

    out = str(tmp_path)
    args = TrainingArguments(output_dir=out, report_to="none", fsdp_config=plugin)
    again = TrainingArguments(output_dir=out, report_to="none", fsdp_config=args.fsdp_config)
    assert again.fsdp_options == args.fsdp_options == options


def test_one_process_reports_fsdp_without_resolving_again(resolutions):
    one = ProcessState(torch.device("cpu"), 1, 0, 0, 1, None)
    chosen = choose_backend(FullyShardedDataParallelPlugin(), None, None)
    strategy = select_strategy(one, Precision("no", one.device), Handlers(), chosen)
    assert strategy.distributed_type is DistributedType.NO and len(resolutions) == 1


def test_ddp_takes_multi_cpu_or_multi_gpu_from_the_process_state():
    for device, kind in (("cpu", DistributedType.MULTI_CPU), ("cuda", DistributedType.MULTI_GPU)):
        state = ProcessState(torch.device(device, 0) if device == "cuda" else torch.device(device), 2, 0, 0, 2, None)
        strategy = DDPStrategy(state, Precision("no", torch.device("cpu")), Handlers())
        assert strategy.distributed_type is state.distributed_type is kind


def test_each_launcher_setting_has_one_definition(monkeypatch):
    monkeypatch.delenv(env.MIXED_PRECISION, raising=False)
    monkeypatch.setenv(env.USE_CPU, "yes")
    monkeypatch.setenv(env.GRADIENT_ACCUMULATION_STEPS, "3")
    assert env.resolve("cpu") is True and env.resolve("gradient_accumulation_steps") == 3
    assert env.resolve("mixed_precision") == "no" and env.resolve("gradient_accumulation_steps", 2) == 2
    monkeypatch.setenv(env.USE_CPU, "maybe")
    with pytest.raises(HfBackendError, match="HF_BACKEND_USE_CPU='maybe' is not valid for cpu"):
        env.resolve("cpu")


def test_a_deepspeed_config_file_is_json_whatever_its_name(tmp_path):
    path = tmp_path / "ds_config"
    path.write_text(json.dumps({"optimizer": {"params": {"lr": 1e-5}}}))  # YAML would read 1e-05 as a string
    assert DeepSpeedPlugin(hf_ds_config=str(path)).config()["optimizer"]["params"]["lr"] == 1e-5
    with pytest.raises(HfBackendError, match=r"DeepSpeedPlugin\(hf_ds_config='.*nowhere.json'\): no such file"):
        DeepSpeedPlugin(hf_ds_config=str(tmp_path / "nowhere.json")).config()


@pytest.fixture
def no_process_state() -> None:
    """No process state before the test (one an earlier test left would be one process), so that
    the next fixture sets it up on its group and tears it down afterwards."""
    from hf_backend.state import reset_process_state

    reset_process_state()


def test_cpu_ram_efficient_loading_is_told_to_transformers_by_the_accelerator_keeping_a_launchers(
        loading_variables, monkeypatch, no_process_state, two_fake_processes):
    """Plugins, options and strategies write no environment; the Accelerator built with the
    option sets the variables transformers' from_pretrained reads, keeping a value a launcher or
    the user left."""
    from hf_backend import Accelerator

    variables = {"ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"}
    plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True)
    FSDPStrategy(TWO_CPU, Precision("no", TWO_CPU.device), Handlers(), plugin.resolved())
    assert not variables & set(os.environ)
    Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    assert not variables & set(os.environ)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # a launcher's or the user's
    Accelerator(fsdp_plugin=plugin)
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"


def test_a_config_files_fsdp_section_sets_only_the_keys_it_gives(tmp_path):
    """SHARD_GRAD_OP without a reshard key keeps parameters after forward, from a config file as from a dict; and
    transformers' fsdp words fill what the file leaves out instead of contradicting its defaults."""
    launched = _launched("FSDP", fsdp_config={"fsdp_sharding_strategy": "SHARD_GRAD_OP"})
    options = choose_backend(launch_config=launched).fsdp
    assert options.sharding_strategy == "SHARD_GRAD_OP" and options.reshard_after_forward is False
    pytest.importorskip("transformers")
    from hf_backend import TrainingArguments

    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n")
    args = TrainingArguments(output_dir=str(tmp_path), fsdp="shard_grad_op", fsdp_config=str(path))
    assert args.fsdp_plugin.sharding_strategy == "SHARD_GRAD_OP" and args.fsdp_plugin.reshard_after_forward is False


def test_set_auto_wrap_policy_reads_accelerates_environment(monkeypatch):
    """A size-based policy set through FSDP_AUTO_WRAP_POLICY (as `accelerate launch` exports it) stays size-based;
    a bad name is one line; a policy given on the plugin wins."""
    model = torch.nn.Linear(2, 2)  # no _no_split_modules: a transformer-based policy would need layer classes
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "2000")
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_auto_wrap_policy(model)
    assert (plugin.auto_wrap_policy, plugin.min_num_params) == ("SIZE_BASED_WRAP", 2000)
    assert plugin.resolved().auto_wrap_policy == "SIZE_BASED_WRAP"
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="NO_WRAP")
    plugin.set_auto_wrap_policy(model)
    assert plugin.auto_wrap_policy == "NO_WRAP"
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "BY_SIZE")
    with pytest.raises(HfBackendError, match=r"^set_auto_wrap_policy='BY_SIZE' is not one of TRANSFORMER_BASED_WRAP"):
        FullyShardedDataParallelPlugin().set_auto_wrap_policy(model)


def test_the_trainers_accelerator_takes_the_backend_its_arguments_decided(tmp_path, monkeypatch):
    """TrainingArguments decide the backend once (theirs over the launcher's, read before transformers loads a
    model); the Trainer's Accelerator takes that decision and never chooses again."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification

    from hf_backend import Accelerator, Trainer, TrainingArguments
    from hf_backend.accelerator import connector

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert args.backend.kind == "DATA_PARALLEL"
    monkeypatch.setattr(connector, "choose_backend", lambda *a, **k: pytest.fail("the backend was chosen again"))
    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=8))
    trainer = Trainer(model=model, args=args)
    assert trainer.accelerator.distributed_type is DistributedType.NO
    for given, message in ((dict(backend=args.backend, fsdp_plugin=FullyShardedDataParallelPlugin()), "not both"),
                           (dict(backend="FSDP"), "pass the Backend TrainingArguments decided")):
        with pytest.raises(HfBackendError) as err:
            Accelerator(cpu=True, **given)
        assert message in str(err.value) and "\n" not in str(err.value)
