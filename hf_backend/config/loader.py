"""Reading, validating and writing config files (YAML or JSON, the layout `accelerate config` writes).

Every problem is one `ConfigError` line naming the file, the key and the fix: an unknown key (with
the closest valid one), a bad value (with the allowed values), malformed YAML/JSON (with the line).
Nothing is silently ignored: keys that exist in Accelerate but mean nothing here are accepted with
one note listing them. No file can crash or stall the loader: size, depth and value count are
bounded, YAML aliases and repeated keys refused, every number has a range and an error quotes at
most 60 characters of a value.
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
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent, MappingStartEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from ..core.checks import show
from ..core.errors import ConfigError
from ..core.notes import note
from .schema import SECTIONS, LaunchConfig, default_of, fields_of


def default_config_path() -> Path:
    """`$HF_HOME/hf_backend/default_config.yaml` (HF_HOME defaults to ~/.cache/huggingface)."""
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(hf_home) / "hf_backend" / "default_config.yaml"


# What a config file may be: Accelerate's files are about 1 KB and DeepSpeed's a few KB, nested 3-4
# levels with a few dozen values. The limits leave two orders of magnitude above that and keep the
# worst file parsing in well under a second: the size is checked before parsing, depth and count
# while the document is composed.
MAX_BYTES = 1 << 20  # 1 MiB
MAX_DEPTH = 32  # mappings and lists inside each other
MAX_VALUES = 10_000  # keys, values and list items, all together
# a longer number is a mistake (and Python's int() is slow on, then refuses, huge ones)
MAX_NUMBER_CHARS = 64


def read_mapping(path: str | os.PathLike, json_only: bool = False) -> dict[str, Any]:
    """The raw key/value mapping of a YAML or JSON file (JSON is read by its extension, or always with
    `json_only`: DeepSpeed's configs are JSON whatever their name; YAML otherwise). Files are at
    most MAX_BYTES, nested at most MAX_DEPTH deep with at most MAX_VALUES values; YAML
    anchors/aliases and repeated keys are refused."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file; create one "
                          "with `hf-backend config` or fix the path")
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_BYTES + 1)
            size = max(os.fstat(handle.fileno()).st_size, len(data)) / (1 << 20)
        if len(data) > MAX_BYTES:
            raise ConfigError(f"{path}: is {size:.1f} MiB, larger than the {MAX_BYTES >> 20} MiB a "
                              "config file may be; check that this is the config file you meant")
        text = data.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read ({type(err).__name__}); "
                          "pass a UTF-8 YAML or JSON file") from None
    parsed = _parse_json(text, path) if json_only or path.suffix.lower() == ".json" else _parse_yaml(text, path)
    if parsed is None:
        return {}
    if not isinstance(parsed, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, not a "
                          f"{type(parsed).__name__}")
    return parsed


class _Refused(yaml.YAMLError):
    """A file this loader refuses (too deep, too many values, an alias, a repeated key), with its line
    if known."""

    def __init__(self, line: int | None, problem: str) -> None:
        super().__init__(problem)
        self.line, self.problem = line, problem


_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep; a config file needs 3 or 4"
_TOO_MANY = f"more than {MAX_VALUES:,} values; a config file has a few dozen"


def _parse_json(text: str, path: Path) -> Any:
    try:
        data = json.loads(text, object_pairs_hook=_json_object, parse_int=_json_number(int),
                          parse_float=_json_number(float))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: line {err.lineno}: malformed JSON ({err.msg})") from None
    except RecursionError:
        raise ConfigError(f"{path}: {_TOO_DEEP}") from None
    except _Refused as err:
        raise ConfigError(f"{path}: {err.problem}") from None
    _check_shape(data, path)
    return data


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or _add(seen, k))
        raise _Refused(None, f"key {show(twice)} appears twice in one object; keep one of them")
    return out


def _json_number(kind: type) -> Any:
    def parse(text: str) -> Any:
        if len(text) > MAX_NUMBER_CHARS:
            raise _Refused(None, f"a number {len(text):,} characters long ({show(text)}); numbers "
                                 f"in a config file have at most {MAX_NUMBER_CHARS}")
        return kind(text)
    return parse


def _check_shape(data: Any, path: Path) -> None:
    """MAX_DEPTH and MAX_VALUES, walked without recursion (and without looking past the first
    MAX_VALUES)."""
    stack, count = ([(data, 1)] if isinstance(data, (dict, list)) else []), 1
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"{path}: {_TOO_DEEP}")
        items = value.values() if isinstance(value, dict) else value
        count += len(items)
        if count > MAX_VALUES:
            raise ConfigError(f"{path}: {_TOO_MANY}")
        stack.extend((item, depth + 1) for item in items if isinstance(item, (dict, list)))


def _parse_yaml(text: str, path: Path) -> Any:
    bad = Reader.NON_PRINTABLE.search(text)
    if bad:
        line = text.count("\n", 0, bad.start()) + 1
        raise ConfigError(f"{path}: line {line}: character U+{ord(bad.group()):04X} is not allowed "
                          "in YAML; remove it")
    # libyaml checks %TAG lines against each other: slow
    if text.count("\n%") + text.startswith("%") > 8:
        raise ConfigError(f"{path}: more than 8 lines start with % "
                          "(YAML directives); a config file needs none")
    loader = _LOADER(text)
    try:
        return loader.get_single_data()
    except _Refused as err:
        raise ConfigError(f"{path}: line {err.line}: {err.problem}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = str(getattr(err, "problem", None) or "not YAML").replace("\n", " ")
        raise ConfigError(f"{path}: {where}malformed YAML ({problem[:80]})") from None
    finally:
        loader.dispose()


class _StrictComposer(Composer):
    """Builds the node tree from parser events, refusing anchors and aliases (no expansion bombs;
    Accelerate never writes them) and counting depth and values as it goes, so a deep or huge
    document stops early."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = self.values = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(line, "YAML aliases (&anchor / *alias) are not allowed in a config "
                                 "file; write the value out")
        self.values += 1
        if self.values > MAX_VALUES:
            raise _Refused(line, _TOO_MANY)
        if not isinstance(event, (SequenceStartEvent, MappingStartEvent)):
            return super().compose_node(parent, index)
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Refused(line, _TOO_DEEP)
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _StrictConstructor(SafeConstructor):
    """SafeConstructor that refuses repeated keys and overlong numbers, and turns a scalar that does
    not convert (`2001-13-45`, `!!int x`) into an error with its line instead of a traceback."""

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, LookupError, OverflowError, TypeError) as err:
            why = f" ({str(err)[:80]})".replace("\n", " ") if isinstance(err, ValueError) else ""
            raise _Refused(node.start_mark.line + 1, f"{show(node.value)} is not a valid "
                                                     f"{node.tag.rsplit(':', 1)[-1]}{why}") from None

    def construct_mapping(self, node: Node, deep: bool = False) -> dict:
        if isinstance(node, MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:
                    continue  # an unhashable key: SafeConstructor refuses it
                if first is not None:
                    raise _Refused(line, f"key {show(key)} appears twice (first "
                                         f"on line {first}); keep one of them")
                lines[key] = line
        return super().construct_mapping(node, deep)

    def construct_number(self, node: Node) -> Any:
        if len(node.value) > MAX_NUMBER_CHARS:
            raise _Refused(node.start_mark.line + 1, f"a number {len(node.value):,} characters "
                                                     f"long ({show(node.value)}); numbers in a "
                                                     f"config file have at most {MAX_NUMBER_CHARS}")
        kind = node.tag.rsplit(":", 1)[-1]
        return SafeConstructor.construct_yaml_int(self, node) if kind == "int" else \
            SafeConstructor.construct_yaml_float(self, node)


_StrictConstructor.add_constructor("tag:yaml.org,2002:int", _StrictConstructor.construct_number)
_StrictConstructor.add_constructor("tag:yaml.org,2002:float", _StrictConstructor.construct_number)


class _PyEvents(Reader, Scanner, Parser):
    """PyYAML's pure-Python parser, used only where libyaml (the C parser, 5-10x faster) is not
    installed."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)


def _add(seen: set[str], key: str) -> bool:
    seen.add(key)
    return False


def _strict_loader(events: type) -> type:
    """A YAML loader: `events` (libyaml's CParser or _PyEvents) parses; the strict composer and
    constructor build (libyaml's own composer cannot be limited; parsing is where its speed is)."""

    class StrictLoader(_StrictComposer, events, _StrictConstructor, Resolver):
        def __init__(self, stream: str) -> None:
            events.__init__(self, stream)  # type: ignore[misc]  # the parser class is chosen at run time
            _StrictComposer.__init__(self)
            _StrictConstructor.__init__(self)
            Resolver.__init__(self)

        def resolve(self, kind: type, value: Any, implicit: Any) -> str:
            # no number, date or bool is this long:
            if kind is ScalarNode and implicit[0] and len(value) > 4096:
                # a string, without the implicit types' regexes (slow on 1 MiB)
                return self.DEFAULT_SCALAR_TAG
            return super().resolve(kind, value, implicit)

    return StrictLoader


try:
    from yaml.cyaml import CParser as _CEvents
except ImportError:  # PyYAML built without libyaml
    _CEvents = None

_LOADER = _strict_loader(_CEvents or _PyEvents)


def load_config(path: str | os.PathLike) -> LaunchConfig:
    return validate(read_mapping(path), source=str(path))


def validate(raw: dict[str, Any], source: str = "<config>") -> LaunchConfig:
    """Check and normalize a raw mapping into a LaunchConfig."""
    _refuse_deepspeed_keys(raw, source)
    values, unused = _check_keys(raw, LaunchConfig, source, prefix="")
    for section, model in SECTIONS.items():
        if section in values:
            if values[section] is None:
                values[section] = {}
            if not isinstance(values[section], dict):
                raise ConfigError(f"{source}: {section} must be a mapping, got "
                                  f"{show(values[section])}")
            values[section], more = _check_keys(values[section], model, source, prefix=section + ".")
            unused += more
    config = LaunchConfig(**values)
    _check_together(config, source)
    if unused:
        note(f"{source}: {', '.join(unused)} accepted from Accelerate's format; they have no "
             "effect in hf_backend")
    return config


def validate_section(raw: dict[str, Any], model: type, source: str) -> dict[str, Any]:
    """One section on its own (transformers' flat `fsdp_config`, say), checked like the same keys in a
    config file; returns the values it gives under the model's field names, in canonical form."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must be a mapping of option names to values, not a "
                          f"{type(raw).__name__}")
    values, unused = _check_keys(raw, model, source, prefix="")
    if unused:
        note(f"{source}: {', '.join(unused)} accepted from Accelerate's format; they have no "
             "effect in hf_backend")
    return values


def _check_keys(raw: dict, model: type, source: str, prefix: str) -> tuple[dict[str, Any], list[str]]:
    fields = fields_of(model)
    aliases = {alias: name for name, f in fields.items() for alias in f.metadata["aliases"]}
    # section keys may drop their `fsdp_` prefix, as transformers' fsdp_config does
    if model is not LaunchConfig:
        aliases.update({name.removeprefix("fsdp_"): name for name in fields if name.startswith("fsdp_")})
        aliases.update({alias.removeprefix("fsdp_"): name for alias, name in list(aliases.items())})
    values: dict[str, Any] = {}
    unused: list[str] = []
    for raw_key, value in raw.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"{source}: key {show(raw_key)} in {prefix or 'the top level'} is "
                              "not a name; keys are strings such as mixed_precision")
        name = raw_key if raw_key in fields else aliases.get(raw_key)
        if name is None:
            shown = show(prefix + raw_key) if len(raw_key) > 60 or not raw_key.isprintable() else \
                f"'{prefix}{raw_key}'"
            close = difflib.get_close_matches(raw_key, list(fields) + list(aliases), n=1, cutoff=0.6) \
                if len(raw_key) <= 60 else []
            hint = f"did you mean '{prefix}{close[0]}'?" if close else "see docs/config.md for the valid keys"
            raise ConfigError(f"{source}: unknown key {shown}; {hint}")
        if name in values:
            raise ConfigError(f"{source}: '{prefix}{raw_key}' repeats "
                              f"'{prefix}{name}'; keep one of them")
        f = fields[name]
        values[name] = coerce(value, f, f"{source}: {prefix}{raw_key}")
        if f.metadata["unused"]:
            unused.append(prefix + name)
    return values, unused


# Top-level keys of DeepSpeed's own JSON config (Accelerate's DeepSpeed templates have them) that
# are never keys of an accelerate config's top level.
_DEEPSPEED_KEYS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "fp16", "bf16",
                   "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
                   "activation_checkpointing", "flops_profiler", "amp")


def _refuse_deepspeed_keys(raw: dict, source: str) -> None:
    """A DeepSpeed config given where an accelerate config belongs (or its keys pasted into one): say
    where it goes."""
    found = [k for k in _DEEPSPEED_KEYS if k in raw]
    if not found:
        return
    if "distributed_type" not in raw and "compute_environment" not in raw:
        raise ConfigError(f"{source} looks like a DeepSpeed config ({', '.join(found[:4])}); pass "
                          "it as deepspeed_config_file: under deepspeed_config in an accelerate "
                          "config, or to `hf-backend launch --deepspeed_config_file`")
    raise ConfigError(f"{source}: '{found[0]}' is a key of DeepSpeed's own JSON config, not of an "
                      "accelerate config; put DeepSpeed settings in a JSON file named by "
                      "deepspeed_config.deepspeed_config_file")


def coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    """Check one value against its field; return it in canonical form."""
    meta, default = f.metadata, default_of(f)
    kind = _KINDS[str(f.type).split(" | ")[0]]
    if f.name in SECTIONS or kind in (dict, list):
        if value is None:
            return type(default)()
        if not isinstance(value, kind):
            raise ConfigError(f"{where}={show(value)} must be a {kind.__name__}")
        if str(f.type).startswith("list[str]") and not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}={show(value)} must be a list of strings (names)")
        return value
    if value is None:
        if default is None:
            return None
        raise ConfigError(f"{where} is empty; give it a value (default {show(default)})")
    if meta["int_choices"] and isinstance(value, int) and not isinstance(value, bool):
        if value not in meta["int_choices"]:
            raise ConfigError(f"{where}={show(value)} is not one of "
                              f"{', '.join(map(str, meta['int_choices']))} or "
                              f"{', '.join(meta['choices'])}")
        return meta["int_choices"][value]
    result: bool | int | float | str | None
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
        raise ConfigError(f"{where}={show(value)} is not valid; use {allowed}")
    if meta["choices"] is not None and result not in meta["choices"]:
        raise ConfigError(f"{where}={show(value)} is not one of "
                          f"{', '.join(map(str, meta['choices']))}")
    if meta["minimum"] is not None and result < meta["minimum"]:
        raise ConfigError(f"{where}={show(value)} must be at least {meta['minimum']}")
    if meta["maximum"] is not None and result > meta["maximum"]:
        raise ConfigError(f"{where}={show(value)} must be at most {meta['maximum']}")
    return result


_KINDS: dict[str, type[Any]] = {"bool": bool, "int": int, "float": float, "str": str, "dict": dict, "list": list,
                              "list[str]": list}


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


def _as_str(value: Any, choices: tuple | None) -> str | float | None:
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


def _check_together(config: LaunchConfig, source: str) -> None:
    if config.machine_rank >= config.num_machines:
        raise ConfigError(f"{source}: machine_rank={config.machine_rank} needs num_machines > "
                          f"{config.machine_rank}")
    if config.num_processes % config.num_machines:
        raise ConfigError(f"{source}: num_processes={config.num_processes} (the total) does not "
                          f"divide over num_machines={config.num_machines}")
    if config.num_machines > 1 and not config.main_process_ip:
        raise ConfigError(f"{source}: num_machines={config.num_machines} needs main_process_ip "
                          "(machine 0's address)")
    for section, kind in (("fsdp_config", "FSDP"), ("deepspeed_config", "DEEPSPEED")):
        if getattr(config, section) and config.distributed_type != kind:
            note(f"{source}: {section} is not used because distributed_type is "
                 f"{config.distributed_type}")
    if config.fault_tolerance_config and not config.fault_tolerance:
        note(f"{source}: fault_tolerance_config is not used because fault_tolerance is false")
    if config.parallelism_config and config.distributed_type == "DEEPSPEED":
        raise ConfigError(f"{source}: parallelism_config goes with the native path, not DeepSpeed; "
                          "set distributed_type FSDP (or MULTI_CPU / MULTI_GPU) or drop "
                          "parallelism_config")


def write_config(config: LaunchConfig, path: str | os.PathLike) -> Path:
    """Write `config` as YAML (or JSON for a .json path), in the layout `accelerate config` writes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = config.to_dict()
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(data, indent=2) + "\n")
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=True))
    return path
