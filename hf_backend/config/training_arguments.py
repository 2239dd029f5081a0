"""transformers' TrainingArguments `fsdp`, `fsdp_config` and `deepspeed` values, read into hf_backend's
options.

`fsdp_config` may be:
- a path to transformers' flat JSON of FSDP options (`{"transformer_layer_cls_to_wrap": [...],
  ...}`), or to a config file that `hf-backend config` / `accelerate config` wrote (YAML or JSON,
  `distributed_type: FSDP`), whose `fsdp_config:` section is used: the Transformers docs pass
  exactly that file, which transformers itself cannot read;
- a dict of the flat options, or a FullyShardedDataParallelPlugin (ours or Accelerate's).
`fsdp` may hold transformers' legacy option words ("full_shard auto_wrap offload"); they fill what
the config leaves out and contradicting it is an error. `deepspeed` may be a DeepSpeed JSON path, a
dict, or a DeepSpeedPlugin.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..core.errors import ConfigError
from ..core.notes import note
from .fsdp import FsdpOptions, given_in_section
from .loader import read_mapping, validate, validate_section
from .plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin, note_limit_all_gathers
from .schema import FsdpSection

_FSDP_WORDS = {  # word: (options field, value)
    "full_shard": ("sharding_strategy", "FULL_SHARD"),
    "shard_grad_op": ("sharding_strategy", "SHARD_GRAD_OP"),
    "no_shard": ("sharding_strategy", "NO_SHARD"),
    "hybrid_shard": ("sharding_strategy", "HYBRID_SHARD"),
    "hybrid_shard_zero2": ("sharding_strategy", "HYBRID_SHARD_ZERO2"),
    "offload": ("cpu_offload", True),
    "auto_wrap": ("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"),
}
_XLA_KEYS = ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")


def fsdp_options_from_arguments(fsdp: Any, fsdp_config: Any) -> FsdpOptions | None:
    """The FSDP options TrainingArguments(fsdp=..., fsdp_config=...) ask for, converted once; None
    when FSDP is off."""
    if not fsdp and fsdp_config in (None, {}):
        return None
    source = str(fsdp_config) if isinstance(fsdp_config, (str, os.PathLike)) else "fsdp_config"
    given = _given_options(fsdp_config, source)
    return FsdpOptions(**{**given, **_word_options(fsdp, given, source)})


def _given_options(fsdp_config: Any, source: str) -> dict[str, Any]:
    """The options `fsdp_config` gives, checked, by FsdpOptions' field names."""
    if fsdp_config is None:
        return {}
    if isinstance(fsdp_config, (str, os.PathLike)):
        return _given_in_mapping(read_mapping(fsdp_config), source)
    if isinstance(fsdp_config, dict):
        return _given_in_mapping(fsdp_config, source)
    plugin = FullyShardedDataParallelPlugin.from_object(fsdp_config)  # ours, or Accelerate's
    return plugin.given_options()


def _given_in_mapping(raw: Any, source: str) -> dict[str, Any]:
    """The options a launch config's FSDP section gives (`hf-backend config`, `accelerate
    config`), or transformers' flat options."""
    if isinstance(raw, dict) and ("fsdp_config" in raw or "distributed_type" in raw):
        section = _launch_config_section(raw, source)
    else:
        section = validate_section(_split_flat(raw, source), FsdpSection, source)
    return given_in_section(section)


def _fsdp_words(fsdp: Any) -> list[str]:
    if isinstance(fsdp, str):
        return fsdp.split()
    if isinstance(fsdp, (list, tuple)):
        return [str(getattr(word, "value", word)) for word in fsdp]
    return []


def _word_options(fsdp: Any, given: dict[str, Any], source: str) -> dict[str, Any]:
    """transformers' option words as options: they fill what `given` leaves out; contradicting it
    is an error."""
    options = {}
    for word in _fsdp_words(fsdp):
        if word not in _FSDP_WORDS:
            raise ConfigError(f"fsdp={word!r} is not an FSDP option; use fsdp=True or one of "
                              f"{', '.join(_FSDP_WORDS)}")
        field, value = _FSDP_WORDS[word]
        if given.get(field, value) != value:
            raise ConfigError(f"fsdp={word!r} contradicts {source}'s "
                              f"{field}={given[field]!r}; keep one")
        options[field] = value
    return options


def _split_flat(raw: Any, source: str) -> dict[str, Any]:
    """transformers' flat options minus its XLA keys and the plugin-only keys (noted)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the FSDP options must be a mapping, not a "
                          f"{type(raw).__name__}")
    flat = {}
    for key, value in raw.items():
        bare = key.removeprefix("fsdp_") if isinstance(key, str) else key
        if bare in _XLA_KEYS:
            if value:
                raise ConfigError(f"{source}: {key} asks for PyTorch/XLA FSDP, which hf_backend "
                                  "does not run; remove it")
        elif bare == "limit_all_gathers":  # a plugin field without a config key
            if value is False:
                note_limit_all_gathers(source)
        else:
            flat[key] = value
    return flat


def _launch_config_section(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The keys the FSDP section of a launch config file gives (the others keep their defaults)."""
    config = validate(raw, source=source)
    if config.distributed_type != "FSDP":
        raise ConfigError(f"{source} sets distributed_type: {config.distributed_type}, not FSDP; "
                          "pass an FSDP config as fsdp_config")
    launch_only = [f"{key}: {value}" for key, value in (("mixed_precision", config.mixed_precision),
                                                         ("num_processes", config.num_processes)) if value not in
                   ("no", 1)]
    if launch_only:
        note(f"fsdp_config={source}: its FSDP section is used here; {', '.join(launch_only)} take "
             "effect when the file is given to `hf-backend launch --config_file`")
    return config.fsdp_config


def deepspeed_config_from_argument(deepspeed: Any) -> dict[str, Any]:
    """TrainingArguments(deepspeed=...) as a config dict whose batch sizes, accumulation and clipping
    default to "auto" (which transformers fills from the TrainingArguments)."""
    if isinstance(deepspeed, (str, os.PathLike)):
        config = read_mapping(deepspeed)
    elif isinstance(deepspeed, dict):
        config = json.loads(json.dumps(deepspeed))
    else:
        config = DeepSpeedPlugin.from_object(deepspeed).config()
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                "gradient_clipping"):
        config.setdefault(key, "auto")
    return config
