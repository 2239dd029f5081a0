"""`FullyShardedDataParallelPlugin` and `DeepSpeedPlugin`: options with the field names users know from Accelerate.

Each field may be given as Accelerate and transformers spell it (strings, 1-5 for sharding strategies, torch enums,
FSDP1 config objects); `resolved()` turns them into the settings the FSDP2 strategy uses. A plugin object from
`accelerate` is read by its fields (`from_object`), never imported.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..log import note
from .loader import ConfigError, coerce
from .schema import DeepSpeedSection, FsdpSection, fields_of

# plugin field -> config key (FsdpSection), for the fields that have one
_KEYS = {
    "fsdp_version": "fsdp_version", "sharding_strategy": "fsdp_sharding_strategy",
    "reshard_after_forward": "fsdp_reshard_after_forward", "backward_prefetch": "fsdp_backward_prefetch",
    "auto_wrap_policy": "fsdp_auto_wrap_policy", "state_dict_type": "fsdp_state_dict_type",
    "use_orig_params": "fsdp_use_orig_params", "sync_module_states": "fsdp_sync_module_states",
    "forward_prefetch": "fsdp_forward_prefetch", "activation_checkpointing": "fsdp_activation_checkpointing",
    "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "transformer_cls_names_to_wrap": "fsdp_transformer_layer_cls_to_wrap", "min_num_params": "fsdp_min_num_params",
    "cpu_offload": "fsdp_offload_params",
}


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

    @classmethod
    def from_section(cls, section: FsdpSection, keys: set[str] | None = None) -> FullyShardedDataParallelPlugin:
        """The plugin holding `section`'s options (only those named in `keys`, when given; the rest stay unset)."""
        return cls(**_plugin_fields(section, keys))

    def given_options(self) -> set[str]:
        """The config keys (FsdpSection names) of the fields set on this plugin."""
        return {key for field, key in _KEYS.items() if getattr(self, field) is not None}

    @classmethod
    def from_object(cls, obj: Any) -> FullyShardedDataParallelPlugin:
        """Read another plugin object (Accelerate's) by its field names."""
        if isinstance(obj, cls):
            return obj
        return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)})

    def canonical(self, section: FsdpSection) -> FullyShardedDataParallelPlugin:
        """This plugin with its options as the FSDP2 strategy runs them (what `accelerator.state.fsdp_plugin` shows)."""
        return dataclasses.replace(self, **{**_plugin_fields(section), "fsdp_version": 2})

    def resolved(self) -> FsdpSection:
        """The options in canonical form; raises ConfigError naming a bad field."""
        values: dict[str, Any] = {}
        fields = fields_of(FsdpSection)
        for name, key in _KEYS.items():
            value = _plain(getattr(self, name))
            if value is None:
                continue
            if name == "auto_wrap_policy" and callable(value):
                raise ConfigError("FullyShardedDataParallelPlugin(auto_wrap_policy=<function>): give the policy by "
                                  "name (TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP)")
            values[key] = coerce(value, fields[key], f"FullyShardedDataParallelPlugin.{name}")
        section = FsdpSection(**values)
        if "fsdp_reshard_after_forward" not in values:  # derive FSDP2's switch from the FSDP1 strategy
            section.fsdp_reshard_after_forward = section.fsdp_sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")
        if self.limit_all_gathers is False:
            note("FullyShardedDataParallelPlugin.limit_all_gathers=False: FSDP2 always limits in-flight all-gathers")
        if self.param_init_fn is not None:
            note("FullyShardedDataParallelPlugin.param_init_fn is not called: FSDP2 materializes meta-device modules "
                 "with to_empty() and receives rank 0's weights")
        if self.ignored_modules:
            raise ConfigError("FullyShardedDataParallelPlugin.ignored_modules is not supported by hf_backend's FSDP2 "
                              "strategy; freeze those parameters (requires_grad=False) instead")
        for name in ("state_dict_config", "optim_state_dict_config"):
            config = getattr(self, name)
            if config is not None and getattr(config, "rank0_only", False):
                note(f"FullyShardedDataParallelPlugin.{name}(rank0_only=True): full states are gathered to rank 0 "
                     "for saving in any case")
        if self.use_orig_params is False:
            note("FullyShardedDataParallelPlugin.use_orig_params=False has no FSDP2 meaning: parameters stay as they "
                 "are (sharded as DTensors)")
        return section


def _plugin_fields(section: FsdpSection, keys: set[str] | None = None) -> dict[str, Any]:
    """Plugin field -> value for the options of `section` (those named in `keys`, when given)."""
    return {field: getattr(section, key) for field, key in _KEYS.items() if keys is None or key in keys}


# torch's FSDP1 wrap-policy functions, which Accelerate's plugin turns policy names into
_POLICY_FUNCTIONS = {"transformer_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                     "size_based_auto_wrap_policy": "SIZE_BASED_WRAP"}


def _plain(value: Any) -> Any:
    """Enums (torch's or Accelerate's) by name, offload objects by their flag, torch's wrap policies by name."""
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
    """DeepSpeed options with Accelerate's field names. `hf_ds_config` (a dict or a JSON path) is the base config;
    a field given here fills the matching key where the config lacks it or says "auto", and contradicting a concrete
    value in the config is an error."""

    hf_ds_config: Any = None
    zero_stage: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None

    @classmethod
    def from_section(cls, section: DeepSpeedSection) -> DeepSpeedPlugin:
        return cls(hf_ds_config=section.deepspeed_config_file, zero_stage=section.zero_stage,
                   gradient_clipping=section.gradient_clipping,
                   offload_optimizer_device=section.offload_optimizer_device,
                   offload_param_device=section.offload_param_device, zero3_init_flag=section.zero3_init_flag,
                   zero3_save_16bit_model=section.zero3_save_16bit_model)

    @classmethod
    def from_object(cls, obj: Any) -> DeepSpeedPlugin:
        """Read another plugin object (Accelerate's) by its field names."""
        if isinstance(obj, cls):
            return obj
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)}
        config = getattr(obj, "hf_ds_config", None)
        values["hf_ds_config"] = getattr(config, "config", config)  # Accelerate wraps it in HfDeepSpeedConfig
        return cls(**values)

    def config(self) -> dict[str, Any]:
        """The DeepSpeed config before "auto" values are resolved against the prepared objects."""
        base = self.hf_ds_config
        base = getattr(base, "config", base)  # transformers' HfDeepSpeedConfig holds the dict as `.config`
        if base is None:
            config: dict[str, Any] = {}
        elif isinstance(base, dict):
            config = json.loads(json.dumps(base))  # a deep copy the engine may fill in
        else:
            path = Path(base)
            if not path.is_file():
                raise ConfigError(f"DeepSpeedPlugin(hf_ds_config={str(base)!r}): no such file; pass a dict or a path")
            try:
                config = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}: line {err.lineno}: malformed JSON ({err.msg})") from None
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
                raise ConfigError(f"DeepSpeedPlugin: {key}={value!r} contradicts {current!r} in hf_ds_config; keep one")
            where[key] = value
        for kind, device in (("offload_optimizer", self.offload_optimizer_device),
                             ("offload_param", self.offload_param_device)):
            if device not in (None, "none"):
                zero.setdefault(kind, {})["device"] = device
        zero.setdefault("stage", 2)
        return config


def plugins_in_effect(fsdp_plugin: Any, deepspeed_plugin: Any, launch_config: Any) -> tuple[
        FullyShardedDataParallelPlugin | None, DeepSpeedPlugin | None]:
    """The plugins an Accelerator uses: those given to it (ours or Accelerate's objects), else the launcher's."""
    if fsdp_plugin is not None and deepspeed_plugin is not None:
        raise ConfigError("Accelerator(): pass fsdp_plugin or deepspeed_plugin, not both")
    if fsdp_plugin is not None or deepspeed_plugin is not None:
        return (FullyShardedDataParallelPlugin.from_object(fsdp_plugin) if fsdp_plugin is not None else None,
                DeepSpeedPlugin.from_object(deepspeed_plugin) if deepspeed_plugin is not None else None)
    kind = launch_config.distributed_type if launch_config is not None else None
    return (FullyShardedDataParallelPlugin.from_section(launch_config.fsdp) if kind == "FSDP" else None,
            DeepSpeedPlugin.from_section(launch_config.deepspeed) if kind == "DEEPSPEED" else None)


__all__ = ["ConfigError", "DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "plugins_in_effect"]
