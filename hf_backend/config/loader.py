"""Reading, validating and writing config files (YAML or JSON, the layout `accelerate config` writes).

Every problem is one `ConfigError` line naming the file, the key and the fix: an unknown key (with the closest valid
one), a bad value (with the allowed values), malformed YAML/JSON (with the line). Nothing is silently ignored: keys
that exist in Accelerate but mean nothing here are accepted with one note listing them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from ..errors import HfBackendError
from ..log import note
from .schema import SECTIONS, LaunchConfig, default_of, fields_of


class ConfigError(HfBackendError, ValueError):
    """A config file or setting is wrong; the message is one line naming the file, the key and the fix."""


def default_config_path() -> Path:
    """`$HF_HOME/hf_backend/default_config.yaml` (HF_HOME defaults to ~/.cache/huggingface)."""
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(hf_home) / "hf_backend" / "default_config.yaml"


def read_mapping(path: str | os.PathLike, json_only: bool = False) -> dict[str, Any]:
    """The raw key/value mapping of a YAML or JSON file (JSON is read by its extension, or always with `json_only`:
    DeepSpeed's configs are JSON whatever their name; YAML otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file; create one with `hf-backend config` or fix the path")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read ({type(err).__name__}); pass a UTF-8 YAML or JSON file") from None
    if json_only or path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: line {err.lineno}: malformed JSON ({err.msg})") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            problem = str(getattr(err, "problem", None) or "not YAML").replace("\n", " ")
            raise ConfigError(f"{path}: {where}malformed YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, not a {type(data).__name__}")
    return data


def load_config(path: str | os.PathLike) -> LaunchConfig:
    return validate(read_mapping(path), source=str(path))


def validate(raw: dict[str, Any], source: str = "<config>") -> LaunchConfig:
    """Check and normalize a raw mapping into a LaunchConfig."""
    values, unused = _check_keys(raw, LaunchConfig, source, prefix="")
    for section, model in SECTIONS.items():
        if section in values:
            if values[section] is None:
                values[section] = {}
            if not isinstance(values[section], dict):
                raise ConfigError(f"{source}: {section} must be a mapping, got {_show(values[section])}")
            values[section], more = _check_keys(values[section], model, source, prefix=section + ".")
            unused += more
    config = LaunchConfig(**values)
    _check_together(config, source)
    if unused:
        note(f"{source}: {', '.join(unused)} accepted from Accelerate's format; they have no effect in hf_backend")
    return config


def validate_section(raw: dict[str, Any], model: type, source: str) -> tuple[Any, set[str]]:
    """One section on its own (transformers' flat `fsdp_config`, say), checked like the same keys in a config file;
    returns it and the names of the fields the mapping gave."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must be a mapping of option names to values, not a {type(raw).__name__}")
    values, unused = _check_keys(raw, model, source, prefix="")
    if unused:
        note(f"{source}: {', '.join(unused)} accepted from Accelerate's format; they have no effect in hf_backend")
    return model(**values), set(values)


def _check_keys(raw: dict, model: type, source: str, prefix: str) -> tuple[dict[str, Any], list[str]]:
    fields = fields_of(model)
    aliases = {alias: name for name, f in fields.items() for alias in f.metadata["aliases"]}
    if model is not LaunchConfig:  # section keys may drop their `fsdp_` prefix, as transformers' fsdp_config does
        aliases.update({name.removeprefix("fsdp_"): name for name in fields if name.startswith("fsdp_")})
        aliases.update({alias.removeprefix("fsdp_"): name for alias, name in list(aliases.items())})
    values: dict[str, Any] = {}
    unused: list[str] = []
    for raw_key, value in raw.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"{source}: key {_show(raw_key)} in {prefix or 'the top level'} is not a name; "
                              "keys are strings such as mixed_precision")
        name = raw_key if raw_key in fields else aliases.get(raw_key)
        if name is None:
            close = difflib.get_close_matches(raw_key, list(fields) + list(aliases), n=1, cutoff=0.6)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else "see docs/config.md for the valid keys"
            raise ConfigError(f"{source}: unknown key '{prefix}{raw_key}'; {hint}")
        if name in values:
            raise ConfigError(f"{source}: '{prefix}{raw_key}' repeats '{prefix}{name}'; keep one of them")
        f = fields[name]
        values[name] = coerce(value, f, f"{source}: {prefix}{raw_key}")
        if f.metadata["unused"]:
            unused.append(prefix + name)
    return values, unused


def coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    """Check one value against its field; return it in canonical form."""
    meta, default = f.metadata, default_of(f)
    kind = _KINDS[str(f.type).split(" | ")[0]]
    if f.name in SECTIONS or kind in (dict, list):
        if value is None:
            return type(default)()
        if not isinstance(value, kind):
            raise ConfigError(f"{where}={_show(value)} must be a {kind.__name__}")
        return value
    if value is None:
        if default is None:
            return None
        raise ConfigError(f"{where} is empty; give it a value (default {_show(default)})")
    if meta["int_choices"] and isinstance(value, int) and not isinstance(value, bool):
        if value not in meta["int_choices"]:
            raise ConfigError(f"{where}={value} is not one of {', '.join(map(str, meta['int_choices']))} "
                              f"or {', '.join(meta['choices'])}")
        return meta["int_choices"][value]
    if kind is bool:
        result = _as_bool(value)
    elif kind is int:
        result = _as_int(value)
    elif kind is float:
        result = _as_float(value)
    else:
        result = _as_str(value, meta["choices"])
    if result is None:
        allowed = _allowed(meta["choices"], kind)
        raise ConfigError(f"{where}={_show(value)} is not valid; use {allowed}")
    if meta["choices"] is not None and result not in meta["choices"]:
        raise ConfigError(f"{where}={_show(value)} is not one of {', '.join(map(str, meta['choices']))}")
    if meta["minimum"] is not None and result < meta["minimum"]:
        raise ConfigError(f"{where}={_show(value)} must be at least {meta['minimum']}")
    return result


_KINDS = {"bool": bool, "int": int, "float": float, "str": str, "dict": dict, "list": list}


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "1", "false", "no", "0"):
        return value.strip().lower() in ("true", "yes", "1")
    return None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit() and len(value.strip()) < 19:
        return int(value)
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        result = float(value)
    except (ValueError, OverflowError):
        return None
    return result if math.isfinite(result) else None


def _as_str(value: Any, choices: tuple | None) -> str | None:
    if isinstance(value, bool):
        if choices and "no" in choices:  # YAML reads `no` unquoted as False
            return "yes" if value else "no"
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # e.g. transformer_layer_cls_to_wrap: [BertLayer]
    if isinstance(value, (int, float)) and choices and value in choices:
        return value
    if not isinstance(value, str):
        return None
    if choices:
        for choice in choices:
            if isinstance(choice, str) and choice.lower() == value.strip().lower():
                return choice
    return value


def _allowed(choices: tuple | None, kind: type) -> str:
    if choices:
        return "one of " + ", ".join(map(str, choices))
    return {bool: "true or false", int: "a whole number", float: "a number"}.get(kind, "a string")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_together(config: LaunchConfig, source: str) -> None:
    if config.machine_rank >= config.num_machines:
        raise ConfigError(f"{source}: machine_rank={config.machine_rank} needs num_machines > {config.machine_rank}")
    if config.num_processes % config.num_machines:
        raise ConfigError(f"{source}: num_processes={config.num_processes} (the total) does not divide over "
                          f"num_machines={config.num_machines}")
    if config.num_machines > 1 and not config.main_process_ip:
        raise ConfigError(f"{source}: num_machines={config.num_machines} needs main_process_ip (machine 0's address)")
    if config.main_process_port is not None and config.main_process_port > 65535:
        raise ConfigError(f"{source}: main_process_port={config.main_process_port} is not a port (1-65535)")
    for section, kind in (("fsdp_config", "FSDP"), ("deepspeed_config", "DEEPSPEED")):
        if getattr(config, section) and config.distributed_type != kind:
            note(f"{source}: {section} is not used because distributed_type is {config.distributed_type}")


def write_config(config: LaunchConfig, path: str | os.PathLike) -> Path:
    """Write `config` as YAML (or JSON for a .json path), in the layout `accelerate config` writes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = config.to_dict()
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(data, indent=2) + "\n")
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=True))
    return path
