"""`FsdpOptions`: the FSDP options as one frozen value, the only shape the FSDP strategy runs from.

Three ways in, each converted into it once, where it enters:
- a `FullyShardedDataParallelPlugin`, ours or Accelerate's (`plugins.fsdp_options`);
- a config file's `fsdp_config:` section (`FsdpOptions.from_section`);
- TrainingArguments' `fsdp` / `fsdp_config` (config/training_arguments.py).

Fields carry Accelerate's plugin names and the config schema's canonical values: each names its
key in schema.FsdpSection, which gives its default and, for a plugin's values, its checks.
`accelerator.state.fsdp_plugin` and `TrainingArguments.fsdp_plugin` show this value itself:
nothing is converted back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.errors import HfBackendError
from ..core.notes import note
from .schema import FsdpSection, default_of, fields_of

_SECTION = fields_of(FsdpSection)
# the FSDP1 strategies that free gathered parameters after forward
_RESHARDING = ("FULL_SHARD", "HYBRID_SHARD")
_NO_ORIG_PARAMS = ("fsdp use_orig_params=False has no FSDP2 meaning: parameters stay as they are "
                   "(sharded as DTensors)")
_SCHEMAS = object()
_FIXED_TYPE = ("fsdp_plugin.set_state_dict_type({asked!r}): the options in effect are fixed when "
               "the Accelerator is built (state dict type {current}); pass "
               "fsdp_state_dict_type={asked!r} to the plugin or the config instead")


def _keyed(key: str, default: Any = _SCHEMAS) -> Any:
    """A field that the config key `key` sets, with that key's default unless another is given."""
    default = default_of(_SECTION[key]) if default is _SCHEMAS else default
    return dataclasses.field(default=default, metadata={"key": key})


@dataclass(frozen=True)
class FsdpOptions:
    """What the FSDP strategy runs from; made only where the options enter (see above)."""

    sharding_strategy: str = _keyed("fsdp_sharding_strategy")
    # None: as the sharding strategy says (see _RESHARDING)
    reshard_after_forward: bool = _keyed("fsdp_reshard_after_forward", None)
    cpu_offload: bool = _keyed("fsdp_offload_params")
    auto_wrap_policy: str = _keyed("fsdp_auto_wrap_policy")
    # comma-separated block class names; None: the model's _no_split_modules
    transformer_cls_names_to_wrap: str | None = _keyed("fsdp_transformer_layer_cls_to_wrap")
    min_num_params: int = _keyed("fsdp_min_num_params")
    backward_prefetch: str = _keyed("fsdp_backward_prefetch")
    forward_prefetch: bool | None = _keyed("fsdp_forward_prefetch")
    state_dict_type: str = _keyed("fsdp_state_dict_type")
    cpu_ram_efficient_loading: bool = _keyed("fsdp_cpu_ram_efficient_loading")
    sync_module_states: bool = _keyed("fsdp_sync_module_states")
    use_orig_params: bool = _keyed("fsdp_use_orig_params")
    activation_checkpointing: bool = _keyed("fsdp_activation_checkpointing")
    # a MixedPrecisionPolicy (or its dtypes); None: autocast, as in the other strategies
    mixed_precision_policy: Any = None
    # FSDP2 (fully_shard), the only implementation
    fsdp_version: int = dataclasses.field(default=2, init=False)

    # Accelerate's plugin attributes that FSDP2 has no use for, for code that reads this value as
    # Accelerate's plugin (TRL's prepare_fsdp reads ignored_modules); a plugin that sets them gets
    # a note or an error.
    ignored_modules: ClassVar[Any] = None
    param_init_fn: ClassVar[Any] = None
    limit_all_gathers: ClassVar[bool] = True
    state_dict_config: ClassVar[Any] = None
    optim_state_dict_config: ClassVar[Any] = None
    activation_checkpointing_offload: ClassVar[Any] = None

    def __post_init__(self) -> None:
        if self.reshard_after_forward is None:
            resharding = self.sharding_strategy in _RESHARDING
            object.__setattr__(self, "reshard_after_forward", resharding)
        if not self.use_orig_params:
            note(_NO_ORIG_PARAMS)

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Accelerate's plugin method, which transformers' FSDP docs call before `save_model` to
        get full weights. `save_model` writes full weights whatever the state dict type, so asking
        for FULL_STATE_DICT, or for the type in effect, changes nothing; another is one line."""
        asked = getattr(state_dict_type, "name", state_dict_type)
        if asked not in (None, "FULL_STATE_DICT", self.state_dict_type):
            raise HfBackendError(_FIXED_TYPE.format(asked=asked, current=self.state_dict_type))

    @classmethod
    def from_section(cls, keys: Mapping[str, Any]) -> FsdpOptions:
        """A validated `fsdp_config:` section: the keys it gives (FsdpSection's names, canonical
        values); the others keep their defaults."""
        return cls(**given_in_section(keys))

    def to_dict(self) -> dict[str, Any]:
        """The options as plain values under their own names (`TrainingArguments.fsdp_config`,
        which is serialized and reads back as a section); the mixed precision policy, a torch
        object, is left out."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "mixed_precision_policy"}


def given_in_section(keys: Mapping[str, Any]) -> dict[str, Any]:
    """The options a section gives (its keys: FsdpSection's names), under the options' names."""
    return {name: keys[f.name] for name, f in section_fields().items() if f.name in keys}


def section_fields() -> dict[str, dataclasses.Field]:
    """Each option a config key sets, with that key's schema field (its checks and choices)."""
    return {f.name: _SECTION[f.metadata["key"]]
            for f in dataclasses.fields(FsdpOptions) if "key" in f.metadata}
