"""`FullyShardedDataParallelPlugin` and `DeepSpeedPlugin`: options with the field names users know from
Accelerate.

Each FSDP field may be given as Accelerate and transformers spell it (strings, 1-5 for sharding
strategies, torch enums, FSDP1 config objects); `resolved()` converts a plugin, once, into
`FsdpOptions` (config/fsdp.py), the frozen value the FSDP strategy runs from. A plugin object from
`accelerate` is read by its fields (`from_object`), never imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.errors import ConfigError
from ..core.notes import note
from .fsdp import FsdpOptions, section_fields
from .loader import coerce, read_mapping
from .schema import DeepSpeedSection, FsdpSection, fields_of

_POLICY_FUNCTION = ("FullyShardedDataParallelPlugin(auto_wrap_policy=<function>): give the policy "
                    "by name (TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP)")
_NO_PARAM_INIT = ("FullyShardedDataParallelPlugin.param_init_fn is not called: FSDP2 materializes "
                  "meta-device modules with to_empty() and receives rank 0's weights")
_NO_IGNORED_MODULES = ("FullyShardedDataParallelPlugin.ignored_modules is "
                       "not supported by hf_backend's FSDP2 strategy; freeze "
                       "those parameters (requires_grad=False) instead")


@dataclass
class FullyShardedDataParallelPlugin:
    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: bool | None = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: Any = None
    min_num_params: int | None = None

    def given_options(self) -> dict[str, Any]:
        """The options this plugin sets, by FsdpOptions' field names, checked and in canonical
        form; raises ConfigError naming a bad field. FSDP1 fields get a note or an error."""
        given: dict[str, Any] = {}
        for name, field in section_fields().items():
            value = _plain(getattr(self, name))
            if value is None:
                continue
            if name == "auto_wrap_policy" and callable(value):
                raise ConfigError(_POLICY_FUNCTION)
            given[name] = coerce(value, field, f"FullyShardedDataParallelPlugin.{name}")
        if self.fsdp_version is not None:  # 1 or 2: both run as FSDP2
            coerce(self.fsdp_version, fields_of(FsdpSection)["fsdp_version"],
                   "FullyShardedDataParallelPlugin.fsdp_version")
        if self.mixed_precision_policy is not None:
            given["mixed_precision_policy"] = self.mixed_precision_policy
        _check_fsdp1_fields(self)
        return given

    def resolved(self) -> FsdpOptions:
        """The options this plugin asks for, converted once where it enters; changing the plugin
        afterwards changes nothing resolved."""
        return FsdpOptions(**self.given_options())

    @classmethod
    def from_object(cls, obj: Any) -> FullyShardedDataParallelPlugin:
        """Read another plugin object (Accelerate's) by its field names."""
        if isinstance(obj, cls):
            return obj
        return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)})

    # Accelerate's public plugin methods, for scripts that call them before handing the plugin over.
    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """The checkpoint kind: the value given, else FSDP_STATE_DICT_TYPE from the environment, else
        full."""
        self.state_dict_type = state_dict_type or self.state_dict_type or os.environ.get(
            "FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
        self.given_options()

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """The policy set, else FSDP_AUTO_WRAP_POLICY from the environment (with
        FSDP_TRANSFORMER_CLS_TO_WRAP and FSDP_MIN_NUM_PARAMS, as Accelerate reads them), else
        transformer-based; for transformer-based wrapping without layer classes named, the model's
        `_no_split_modules`."""
        policy = _plain(self.auto_wrap_policy) or os.environ.get("FSDP_AUTO_WRAP_POLICY") or "TRANSFORMER_BASED_WRAP"
        if not self.transformer_cls_names_to_wrap and os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
            self.transformer_cls_names_to_wrap = os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",")
        if self.min_num_params is None and os.environ.get("FSDP_MIN_NUM_PARAMS"):
            self.min_num_params = coerce(os.environ["FSDP_MIN_NUM_PARAMS"], fields_of(FsdpSection)[
                "fsdp_min_num_params"], "environment variable FSDP_MIN_NUM_PARAMS")
        policy = coerce(policy, fields_of(FsdpSection)["fsdp_auto_wrap_policy"], "set_auto_wrap_policy")
        if policy == "TRANSFORMER_BASED_WRAP" and not self.transformer_cls_names_to_wrap:
            names = list(getattr(model, "_no_split_modules", None) or [])
            if not names:
                raise ConfigError(f"set_auto_wrap_policy: {type(model).__name__} names no layer "
                                  "classes (_no_split_modules); set "
                                  "transformer_cls_names_to_wrap=[...]")
            self.transformer_cls_names_to_wrap = names
        self.auto_wrap_policy = policy

    def set_mixed_precision(self, mixed_precision: str | torch.dtype, buffer_autocast: bool = False,
                            override: bool = False) -> None:
        """FSDP2's policy for `mixed_precision` ("fp16", "bf16" or "fp32"): parameters in that dtype,
        gradients reduced in fp32. Kept when one is set, unless `override`."""
        from ..core.dtypes import dtype_of

        dtype = dtype_of("fp32" if mixed_precision == "no" else mixed_precision, "set_mixed_precision")
        if self.mixed_precision_policy is None or override:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            self.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def validate_mixed_precision_policy(self) -> None:
        self.given_options()

    def set_cpu_offload(self) -> None:
        if self.cpu_offload is None:
            self.cpu_offload = False

    def validate_cpu_offload(self) -> None:
        self.given_options()


def fsdp_options(source: Any) -> FsdpOptions:
    """What `Accelerator(fsdp_plugin=...)` was given, as options: FsdpOptions as they are
    (TrainingArguments made them), a plugin (ours or Accelerate's) converted once."""
    if isinstance(source, FsdpOptions):
        return source
    return FullyShardedDataParallelPlugin.from_object(source).resolved()


def _check_fsdp1_fields(plugin: FullyShardedDataParallelPlugin) -> None:
    """The plugin's FSDP1 fields that FSDP2 has no use for: a note for each one set, an error for
    ignored_modules."""
    if plugin.limit_all_gathers is False:
        note_limit_all_gathers("FullyShardedDataParallelPlugin")
    if plugin.param_init_fn is not None:
        note(_NO_PARAM_INIT)
    if plugin.ignored_modules:
        raise ConfigError(_NO_IGNORED_MODULES)
    for name in ("state_dict_config", "optim_state_dict_config"):
        config = getattr(plugin, name)
        if config is not None and getattr(config, "rank0_only", False):
            note(f"FullyShardedDataParallelPlugin.{name}(rank0_only=True): full states are "
                 "gathered to rank 0 for saving in any case")


def note_limit_all_gathers(where: str) -> None:
    """limit_all_gathers=False (a plugin field, and a key of transformers' flat options) has
    nothing to turn off."""
    note(f"{where}: limit_all_gathers=False: FSDP2 always limits in-flight all-gathers")


# torch's FSDP1 wrap-policy functions, which Accelerate's plugin turns policy names into
_POLICY_FUNCTIONS = {"transformer_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                     "size_based_auto_wrap_policy": "SIZE_BASED_WRAP"}


def _plain(value: Any) -> Any:
    """Enums (torch's or Accelerate's) by name, offload objects by their flag, torch's wrap policies by
    name."""
    if hasattr(value, "offload_params"):
        return value.offload_params
    if value.__class__.__name__ in ("CPUOffloadPolicy", "OffloadPolicy"):
        return value.__class__.__name__ == "CPUOffloadPolicy"
    if callable(value) and getattr(value, "__name__", None) in _POLICY_FUNCTIONS:
        return _POLICY_FUNCTIONS[value.__name__]
    if hasattr(value, "name") and hasattr(value, "value") and not isinstance(value, (str, int)):
        return value.name
    return value


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed options with Accelerate's field names. `hf_ds_config` (a dict or a JSON path) is the
    base config; a field given here fills the matching key where the config lacks it or says "auto",
    and contradicting a concrete value in the config is an error."""

    hf_ds_config: Any = None
    zero_stage: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None

    @classmethod
    def from_section(cls, section: DeepSpeedSection) -> DeepSpeedPlugin:
        if section.deepspeed_moe_layer_cls_names:
            raise ConfigError("deepspeed_config deepspeed_moe_layer_cls_names: "
                              "mixture-of-experts leaf modules are not supported "
                              "by hf_backend's DeepSpeed strategy; remove the key")
        steps = section.gradient_accumulation_steps
        return cls(hf_ds_config=section.deepspeed_config_file, zero_stage=section.zero_stage,
                   # 1 (the default): the file's, if any
                   gradient_accumulation_steps=steps if steps != 1 else None,
                   gradient_clipping=section.gradient_clipping,
                   offload_optimizer_device=section.offload_optimizer_device,
                   offload_param_device=section.offload_param_device, zero3_init_flag=section.zero3_init_flag,
                   zero3_save_16bit_model=section.zero3_save_16bit_model,
                   offload_optimizer_nvme_path=section.offload_optimizer_nvme_path,
                   offload_param_nvme_path=section.offload_param_nvme_path)

    @classmethod
    def from_object(cls, obj: Any) -> DeepSpeedPlugin:
        """Read another plugin object (Accelerate's) by its field names."""
        if isinstance(obj, cls):
            return obj
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)}
        config = getattr(obj, "hf_ds_config", None)
        # Accelerate wraps it in HfDeepSpeedConfig
        values["hf_ds_config"] = getattr(config, "config", config)
        return cls(**values)

    # Accelerate's public plugin methods that read the config; the config is resolved when the
    # strategy is built.
    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The config value at a dotted key ("zero_optimization.stage"), or `default`."""
        value: Any = self.config()
        for key in ds_key_long.split("."):
            if not isinstance(value, dict) or key not in value:
                return default
            value = value[key]
        return value

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """Accelerate's attribute: the config in effect, as `config()` gives it (with transformers'
        "auto" values filled from the TrainingArguments when it came through them). TRL reads it to
        build its reference model's engine; the strategy resolves what is still "auto" when it
        builds the training engine."""
        return self.config()

    def is_auto(self, ds_key_long: str) -> bool:
        return self.get_value(ds_key_long) == "auto"

    def is_zero3_init_enabled(self) -> bool:
        return bool(self.zero3_init_flag) and self.get_value("zero_optimization.stage") == 3

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Turn on fp16 or bf16 in the config where it says nothing (or "auto")."""
        if mixed_precision not in ("fp16", "bf16", "no"):
            raise ConfigError("DeepSpeedPlugin.set_mixed_precision: "
                              f"{mixed_precision!r} is not fp16, bf16 or no")
        if mixed_precision != "no":
            config = self.config()
            if config.get(mixed_precision, {}).get("enabled", "auto") == "auto":
                config.setdefault(mixed_precision, {})["enabled"] = True
                self.hf_ds_config = config

    def set_deepspeed_weakref(self) -> None:
        """Accelerate registers the config with transformers here; hf_backend's strategy does that when
        it builds the engine, so there is nothing to do yet."""

    def select(self, _from_accelerator_state: bool = False) -> None:
        """One plugin per Accelerator here: it is always the selected one."""

    def deepspeed_config_process(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError("DeepSpeedPlugin.deepspeed_config_process: hf_backend fills the config's "
                          "\"auto\" values when the engine is built, from the prepared model, "
                          "optimizer and loader; do not call it")

    fill_match = deepspeed_config_process

    def zero3_init_context_manager(self, enable: bool = False) -> Any:
        raise ConfigError("DeepSpeedPlugin.zero3_init_context_manager: set zero3_init_flag=True "
                          "and build the model after Accelerator(); hf_backend's strategy enters "
                          "deepspeed.zero.Init itself")

    def set_moe_leaf_modules(self, model: torch.nn.Module) -> None:
        raise ConfigError("DeepSpeedPlugin.set_moe_leaf_modules: mixture-of-experts leaf modules "
                          "are not supported by hf_backend's DeepSpeed strategy")

    def config(self) -> dict[str, Any]:
        """The DeepSpeed config before "auto" values are resolved against the prepared objects."""
        base = self.hf_ds_config
        # transformers' HfDeepSpeedConfig holds the dict as `.config`
        base = getattr(base, "config", base)
        if base is None:
            config: dict[str, Any] = {}
        elif isinstance(base, dict):
            config = json.loads(json.dumps(base))  # a deep copy the engine may fill in
        else:
            if not Path(base).is_file():
                raise ConfigError(f"DeepSpeedPlugin(hf_ds_config={str(base)!r}): no such file; "
                                  "pass a dict or a path")
            config = read_mapping(base, json_only=True)
        zero = config.setdefault("zero_optimization", {})
        fields = fields_of(DeepSpeedSection)
        for where, key, value in (
            (zero, "stage", self.zero_stage),
            (config, "gradient_accumulation_steps", self.gradient_accumulation_steps),
            (config, "gradient_clipping", self.gradient_clipping),
            (zero, "stage3_gather_16bit_weights_on_model_save", self.zero3_save_16bit_model),
        ):
            if value is None:
                continue
            field = fields.get({"stage": "zero_stage"}.get(key, key))
            if field is not None:
                value = coerce(value, field, f"DeepSpeedPlugin.{key}")
            current = where.get(key, "auto")
            if current != "auto" and current != value:
                raise ConfigError(f"DeepSpeedPlugin: {key}={value!r} contradicts {current!r} in "
                                  "hf_ds_config; keep one")
            where[key] = value
        for kind, device, nvme_path in (
                ("offload_optimizer", self.offload_optimizer_device, self.offload_optimizer_nvme_path),
                ("offload_param", self.offload_param_device, self.offload_param_nvme_path)):
            if device not in (None, "none"):
                zero.setdefault(kind, {})["device"] = device
            if nvme_path not in (None, "none"):  # Accelerate's plugin says "none"
                if zero.get(kind, {}).get("device") != "nvme":
                    raise ConfigError(f"DeepSpeed {kind}_nvme_path={nvme_path!r} needs "
                                      f"{kind}_device 'nvme'; set it or remove the path")
                zero[kind].setdefault("nvme_path", nvme_path)
        zero.setdefault("stage", 2)
        return config


__all__ = ["ConfigError", "DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "fsdp_options"]
