"""Config files: the formats Accelerate and Transformers document, validation errors, precedence, the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import DOCS_FSDP_YAML, assert_valid_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_backend.cli.launch import effective_config
from hf_backend.cli.main import build_parser
from hf_backend.config import reference
from hf_backend.config.loader import load_config, validate, write_config
from hf_backend.core.errors import ConfigError


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_docs_fsdp_yaml_validates_with_every_value(tmp_path, caplog):
    config = load_config(_write(tmp_path, DOCS_FSDP_YAML))
    assert config.distributed_type == "FSDP" and config.mixed_precision == "bf16" and config.num_processes == 2
    fsdp = config.fsdp
    assert fsdp.fsdp_sharding_strategy == "FULL_SHARD"  # written as 1
    assert fsdp.fsdp_backward_prefetch == "BACKWARD_PRE"  # written under its older name
    assert fsdp.fsdp_transformer_layer_cls_to_wrap == "BertLayer"
    assert fsdp.fsdp_state_dict_type == "SHARDED_STATE_DICT" and fsdp.fsdp_cpu_ram_efficient_loading
    assert fsdp.fsdp_forward_prefetch and fsdp.fsdp_sync_module_states and fsdp.fsdp_use_orig_params
    # Keys that mean nothing here are accepted with one note that names them.
    notes = [r.getMessage() for r in caplog.records if "no effect in hf_backend" in r.getMessage()]
    assert len(notes) == 1 and "tpu_env" in notes[0] and "downcast_bf16" in notes[0]


def test_a_file_written_by_accelerate_config_default_validates(tmp_path):
    utils = pytest.importorskip("accelerate.utils")
    path = tmp_path / "default_config.yaml"
    utils.write_basic_config(mixed_precision="bf16", save_location=str(path))
    config = load_config(path)
    assert config.mixed_precision == "bf16"


def test_transformers_style_keys_without_prefix_and_json(tmp_path):
    path = _write(tmp_path, json.dumps({"distributed_type": "FSDP", "fsdp_config": {
        "version": 2, "reshard_after_forward": True, "cpu_offload": False, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["BertLayer"], "state_dict_type": "FULL_STATE_DICT",
        "cpu_ram_efficient_loading": True, "activation_checkpointing": True}}), "c.json")
    fsdp = load_config(path).fsdp
    assert fsdp.fsdp_transformer_layer_cls_to_wrap == "BertLayer" and fsdp.fsdp_activation_checkpointing


@pytest.mark.parametrize(("text", "message"), [
    ("mixed_precison: bf16\n", "c.yaml: unknown key 'mixed_precison'; did you mean 'mixed_precision'?"),
    ("fsdp_config:\n  fsdp_offload_parms: true\n",
     "c.yaml: unknown key 'fsdp_config.fsdp_offload_parms'; did you mean 'fsdp_config.fsdp_offload_params'?"),
    ("mixed_precision: fp8\n", "c.yaml: mixed_precision='fp8' is not one of no, fp16, bf16"),
    ("num_processes: two\n", "c.yaml: num_processes='two' is not valid; use a whole number"),
    ("num_processes: 0\n", "c.yaml: num_processes=0 must be at least 1"),
    ("num_processes: 1000000000000000000000000000000\n",
     "c.yaml: num_processes=1000000000000000000000000000000 must be at most 1048576"),
    ("main_process_port: 70000\n", "c.yaml: main_process_port=70000 must be at most 65535"),
    ("use_cpu: maybe\n", "c.yaml: use_cpu='maybe' is not valid; use true or false"),
    ("fsdp_config:\n  fsdp_sharding_strategy: 9\n", "c.yaml: fsdp_config.fsdp_sharding_strategy=9 is not one of 1, 2"),
    ("mixed_precision: [bf16\n", "c.yaml: line 2: malformed YAML"),
    ("- a\n- b\n", "c.yaml: the top level must be a mapping of keys to values, not a list"),
    ("num_machines: 2\nnum_processes: 2\n", "num_machines=2 needs main_process_ip"),
    ("num_processes: 3\nnum_machines: 2\nmain_process_ip: 10.0.0.1\n", "does not divide over num_machines=2"),
    ("tpu_env: [1, 2]\n", "c.yaml: tpu_env=[1, 2] must be a list of strings (names)"),
])
def test_bad_files_are_one_line_errors_naming_file_key_and_fix(tmp_path, text, message):
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, text))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_malformed_json_names_the_line(tmp_path):
    with pytest.raises(ConfigError, match=r"c.json: line 3: malformed JSON"):
        load_config(_write(tmp_path, '{\n  "mixed_precision": "bf16",\n  oops\n}', "c.json"))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_written_files_read_back_identically(tmp_path):
    config = load_config(_write(tmp_path, DOCS_FSDP_YAML))
    for name in ("out.yaml", "out.json"):
        again = load_config(write_config(config, tmp_path / name))
        assert again == config


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.integers(), max_size=3),
                    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_config_files_load_or_fail_with_one_config_error_line(tmp_path, data):
    raw = yaml.safe_load(DOCS_FSDP_YAML)
    for _ in range(data.draw(st.integers(1, 3))):
        section = raw.get("fsdp_config")
        use_section = isinstance(section, dict) and section and data.draw(st.booleans())
        target = section if use_section else raw
        if not target:
            break
        key = data.draw(st.sampled_from(sorted(target)))
        action = data.draw(st.sampled_from(["value", "rename", "delete"]))
        if action == "value":
            target[key] = data.draw(_VALUES)
        elif action == "rename":
            target[key[:-1] + data.draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=0, max_size=2))] = \
                target.pop(key)
        else:
            target.pop(key)
    text = yaml.safe_dump(raw)
    if data.draw(st.booleans()):  # break the text itself
        cut = data.draw(st.integers(0, len(text)))
        text = text[:cut] + data.draw(st.sampled_from(["", ":", "[", "{", "\t", "'", " - ", "&a *a"])) + text[cut:]
    path = _write(tmp_path, text)
    try:
        config = load_config(path)
    except ConfigError as err:
        assert "\n" not in str(err) and str(path) in str(err)
    else:
        assert_valid_config(config)
        assert load_config(write_config(config, tmp_path / "again.yaml")) == config


def _launch_args(*argv: str):
    return build_parser().parse_args(["launch", *argv, "train.py"])


def test_precedence_flags_over_environment_over_file_over_defaults(tmp_path, monkeypatch):
    path = _write(tmp_path, "mixed_precision: fp16\ngradient_accumulation_steps: 4\nnum_processes: 2\n")
    config, _ = effective_config(_launch_args("--config_file", str(path)))
    assert (config.mixed_precision, config.gradient_accumulation_steps, config.num_processes) == ("fp16", 4, 2)
    assert config.distributed_type == "MULTI_CPU"  # 2 processes on a CPU-only machine
    monkeypatch.setenv("HF_BACKEND_MIXED_PRECISION", "bf16")
    config, _ = effective_config(_launch_args("--config_file", str(path)))
    assert config.mixed_precision == "bf16" and config.gradient_accumulation_steps == 4
    config, _ = effective_config(_launch_args("--config_file", str(path), "--mixed_precision", "no",
                                              "--gradient_accumulation_steps", "2"))
    assert (config.mixed_precision, config.gradient_accumulation_steps) == ("no", 2)
    monkeypatch.delenv("HF_BACKEND_MIXED_PRECISION")
    config, _ = effective_config(_launch_args("--config_file", str(path), "--use_fsdp",
                                              "--fsdp_transformer_layer_cls_to_wrap", "BertLayer"))
    assert config.distributed_type == "FSDP" and config.fsdp.fsdp_transformer_layer_cls_to_wrap == "BertLayer"
    with pytest.raises(ConfigError, match=r"^command line: fsdp_config\.fsdp_offload_params='maybe' is not valid; "
                                          r"use true or false$"):
        effective_config(_launch_args("--use_fsdp", "--fsdp_offload_params", "maybe"))


def test_default_config_file_is_under_hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "hf_backend").mkdir()
    (tmp_path / "hf_backend" / "default_config.yaml").write_text("mixed_precision: bf16\n")
    config, path = effective_config(_launch_args())
    assert config.mixed_precision == "bf16" and path == str(tmp_path / "hf_backend" / "default_config.yaml")


def test_the_reference_doc_is_generated_from_the_schema():
    doc = Path(__file__).parent.parent / "docs" / "config.md"
    assert doc.read_text() == reference.render(), "run: python -m hf_backend.config.reference > docs/config.md"


def test_validate_accepts_a_plain_mapping():
    assert validate({}).distributed_type == "NO"


def test_every_deepspeed_section_key_reaches_the_config_or_is_refused():
    from hf_backend.config.plugins import DeepSpeedPlugin

    section = {"zero_stage": 3, "gradient_accumulation_steps": 4, "offload_optimizer_device": "nvme",
               "offload_optimizer_nvme_path": "/nvme/opt", "offload_param_device": "nvme",
               "offload_param_nvme_path": "/nvme/param"}
    config = validate({"distributed_type": "DEEPSPEED", "deepspeed_config": section})
    ds = DeepSpeedPlugin.from_section(config.deepspeed).config()
    zero = ds["zero_optimization"]
    assert ds["gradient_accumulation_steps"] == 4 and zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/nvme/opt"}
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/nvme/param"}
    moe = validate({"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_moe_layer_cls_names": "Expert"}})
    with pytest.raises(ConfigError, match="^deepspeed_config deepspeed_moe_layer_cls_names: mixture-of-experts"):
        DeepSpeedPlugin.from_section(moe.deepspeed)
    stray = validate({"distributed_type": "DEEPSPEED",
                      "deepspeed_config": {"offload_param_nvme_path": "/nvme/param"}})
    with pytest.raises(ConfigError, match="offload_param_nvme_path='/nvme/param' needs offload_param_device 'nvme'"):
        DeepSpeedPlugin.from_section(stray.deepspeed).config()


def test_a_launch_configs_dynamo_backend_compiles_unless_the_script_says_otherwise(monkeypatch):
    """`dynamo_backend` in a launch config reaches every process (HF_BACKEND_DYNAMO_BACKEND), where Accelerator()
    compiles with it as Accelerate does; the script's own dynamo_backend or dynamo_plugin wins."""
    from hf_backend.accelerator.compat import dynamo_plugin
    from hf_backend.config.environment import DYNAMO_BACKEND, to_environment
    from hf_backend.config.options import TorchDynamoPlugin

    monkeypatch.delenv(DYNAMO_BACKEND, raising=False)
    assert not dynamo_plugin(None, None).enabled
    monkeypatch.setenv(DYNAMO_BACKEND, to_environment(validate({"dynamo_backend": "EAGER"}))[DYNAMO_BACKEND])
    assert dynamo_plugin(None, None).backend_name == "eager"
    assert dynamo_plugin("no", None).backend_name == "no"
    assert dynamo_plugin(None, TorchDynamoPlugin(backend="aot_eager")).backend_name == "aot_eager"
    monkeypatch.delenv(DYNAMO_BACKEND)
    config, _ = effective_config(_launch_args("--dynamo_backend", "INDUCTOR"))
    assert to_environment(config)[DYNAMO_BACKEND] == "INDUCTOR"


def test_the_options_in_effect_take_transformers_docs_full_state_dict_call():
    """transformers' FSDP docs call `accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")` before
    `save_model`: on the frozen options in effect it changes nothing (save_model writes full weights anyway); asking
    for another type than the one in effect is one line."""
    from hf_backend.config.fsdp import FsdpOptions
    from hf_backend.core.errors import HfBackendError

    options = FsdpOptions(state_dict_type="SHARDED_STATE_DICT")
    options.set_state_dict_type("FULL_STATE_DICT")
    options.set_state_dict_type("SHARDED_STATE_DICT")
    options.set_state_dict_type()
    assert options.state_dict_type == "SHARDED_STATE_DICT"
    with pytest.raises(HfBackendError, match=r"set_state_dict_type\('LOCAL_STATE_DICT'\): the options in effect"):
        options.set_state_dict_type("LOCAL_STATE_DICT")
