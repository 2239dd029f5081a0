"""Config files made to crash or stall `hf-backend config validate` (issue 19): a seeded corpus of mutated copies of
Accelerate-style configs (deep nesting, alias bombs, huge lists, repeated keys, giant numbers, wrong types, junk
characters, truncation, JSON for YAML, a DeepSpeed JSON for an accelerate config), each answered within a second by
one error line naming the file, or accepted and valid; and the limits that make that so.

`corpus(seed, n)` and `answer(case, path)` are also what the counts in the issue are measured with (a larger seed).
"""

from __future__ import annotations

import io
import json
import random
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import DOCS_FSDP_YAML, assert_valid_config, cli

from hf_backend.cli.main import main
from hf_backend.config import loader
from hf_backend.config.loader import load_config, write_config
from hf_backend.config.schema import DeepSpeedSection, FsdpSection, LaunchConfig, fields_of
from hf_backend.core.checks import show
from hf_backend.core.errors import ConfigError

SEED, CASES, TIME_BOUND = 19, 300, 1.0


@dataclass
class Case:
    name: str
    build: Callable[[], str | bytes]  # the file's content, made when the case runs (some are 25 MiB)
    suffix: str = ".yaml"
    reject: bool = False  # accepting it would be a silent acceptance
    hint: str = ""  # the error line must say this


# Accelerate's config layouts (single GPU, multi GPU, two machines, DeepSpeed, the Transformers docs' FSDP file)
# and a DeepSpeed JSON shaped like Accelerate's DeepSpeed templates, with values of our own.
TEMPLATES: dict[str, dict] = {
    "single": {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "NO",
               "downcast_bf16": "no", "gpu_ids": "all", "machine_rank": 0, "main_training_function": "main",
               "mixed_precision": "fp16", "num_machines": 1, "num_processes": 1, "rdzv_backend": "static",
               "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False,
               "use_cpu": False},
    "multi_gpu": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "gpu_ids": "0,1,2,3",
                  "mixed_precision": "bf16", "num_machines": 1, "num_processes": 4, "machine_rank": 0,
                  "main_training_function": "main", "rdzv_backend": "static", "same_network": True},
    "multi_node": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "machine_rank": 0,
                   "main_process_ip": "192.168.1.10", "main_process_port": 29500, "num_machines": 2,
                   "num_processes": 16, "mixed_precision": "no", "rdzv_backend": "c10d", "same_network": True},
    "deepspeed": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_processes": 2,
                  "mixed_precision": "fp16", "deepspeed_config": {
                      "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "offload_optimizer_device": "cpu",
                      "offload_param_device": "none", "zero3_init_flag": False, "zero_stage": 2}},
    "fsdp": yaml.safe_load(DOCS_FSDP_YAML),
}
DEEPSPEED_JSON = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
NUMERIC_KEYS = [("num_processes",), ("num_machines",), ("machine_rank",), ("main_process_port",),
                ("gradient_accumulation_steps",), ("fsdp_config", "fsdp_min_num_params"),
                ("deepspeed_config", "gradient_accumulation_steps"), ("deepspeed_config", "gradient_clipping")]
ABSURD = ["1000000000000000000000000000000", "-1000000000000000000000000000000", "1" + "0" * 5000,
          "1" + "0" * 100_000, "9223372036854775808", "1e400", "-1", "1" + ":1" * 50_000, "0x" + "f" * 40]
VALUES = [None, True, False, 0, 1, 2, 3, 7, 65536, 1.5, float("nan"), float("inf"), "", "two", " bf16 ", "FSDP",
          "yes", "no", "\u202eevil", "a\nb", "x" * 300, [], ["a"], [1, 2], {}, {"a": 1}, 10**30, -(10**30), 2**63]
SCALARS = ["!!python/object/apply:os.system ['true']", "!!python/name:os.system", "!!binary aGVsbG8=",
           "!!set {a, b}", "!!omap [a: 1]", "!!timestamp 2001-13-45", "2001-13-45", "2001-02-03", "!!int zz",
           "!!float x", "!!bool maybe", "!custom x", "!!str 5", ".nan", "-.inf", "0x1F", "0o17", "1_000",
           "190:20:30", "~", "1e400", "!!binary zz!", "!!pairs [a]", "'unterminated", "\"\\u00e9\"", "|\n  block"]
JUNK = ["\x00", "\x07", "\x1b[31m", "\u202e", "\ufeff", "\U0001f600", "\t", "\r", "\x85", "\ud800", "\udcff",
        "\uffff", "{", "[", "]", ":", "&", "*", "!", "%", "@", "`", "'", '"', "- ", "? ", "\n  ", "#"]


def _bomb(key: str) -> str:
    """A 330-byte billion-laughs value for `key`: 9 anchored lists, each 9 aliases of the one before, 9^9 strings
    when expanded (as repr(), str() or a deep copy of the value would)."""
    rows = [f"- &a [{', '.join(['lol'] * 9)}]"] + [f"- &{c} [{','.join(['*' + p] * 9)}]"
                                                   for p, c in zip("abcdefgh", "bcdefghi")]
    return f"{key}:\n" + "\n".join(rows) + "\n"


def _nest(depth: int, style: str) -> str:
    if style == "flow-list":
        return "[" * depth + "]" * depth
    if style == "flow-map":
        return "{a: " * depth + "1" + "}" * depth
    if style == "json-list":
        return "[" * depth + "1" + "]" * depth
    return '{"a": ' * depth + "1" + "}" * depth  # json-map


def _block(depth: int) -> str:
    return "tpu_env:\n" + "".join("  " * i + "-\n" for i in range(1, depth)) + "  " * depth + "- 1\n"


def _dump(raw: object, rng: random.Random) -> tuple[str, str]:
    fmt = rng.choice(["yaml", "yaml", "json", "json-as-yaml", "yml"])
    if fmt == "json":
        return json.dumps(raw, indent=rng.choice([None, 2])), ".json"
    if fmt == "json-as-yaml":
        return json.dumps(raw), ".yaml"
    return yaml.safe_dump(raw, sort_keys=rng.random() < 0.5, allow_unicode=True), "." + fmt


def _absurd(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18


def _edit(rng: random.Random) -> Case:
    """One to three value changes, renames or deletions (sections included), in YAML or JSON."""
    name = rng.choice(sorted(TEMPLATES))
    raw = json.loads(json.dumps(TEMPLATES[name]))
    for _ in range(rng.randint(1, 3)):
        sections = [v for v in raw.values() if isinstance(v, dict) and v]
        target = rng.choice(sections) if sections and rng.random() < 0.4 else raw
        if not target:
            break
        key = rng.choice(sorted(target))
        action = rng.choice(["value", "value", "rename", "delete"])
        if action == "value":
            target[key] = rng.choice(VALUES)
        elif action == "rename":
            target[key[:-1] + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz_", k=rng.randint(0, 2)))] = \
                target.pop(key)
        else:
            del target[key]
    reject = any(_absurd(v) for section in [raw, *[v for v in raw.values() if isinstance(v, dict)]]
                 for v in section.values())
    text, suffix = _dump(raw, rng)
    return Case(f"edit-{name}{suffix}", lambda: text, suffix, reject=reject)


def _duplicate(rng: random.Random) -> Case:
    """A key written twice: at the top level or in a section (YAML), or at the top level of a JSON object."""
    name = rng.choice(sorted(TEMPLATES))
    if rng.random() < 0.3:
        text = "{" + json.dumps(rng.choice(sorted(TEMPLATES[name]))) + ": 1, " + json.dumps(TEMPLATES[name])[1:]
        return Case(f"duplicate-{name}.json", lambda: text, ".json", reject=True, hint="appears twice")
    lines = yaml.safe_dump(TEMPLATES[name]).splitlines(keepends=True)
    i = rng.choice([i for i, line in enumerate(lines) if not line.rstrip().endswith(":")])
    key, value = lines[i].split(":", 1)
    copy = f"{key}: {rng.choice(['1', 'bf16', 'true', repr('x'), '[]', value.strip()])}\n"
    lines.insert(i + 1 if key.startswith(" ") else len(lines), copy)  # in the same mapping
    text = "".join(lines)
    return Case(f"duplicate-{name}", lambda: text, reject=True, hint="appears twice")


def _deep(rng: random.Random) -> Case:
    depth = rng.choice([33, 40, 500, 5000, 100_000])
    style = rng.choice(["flow-list", "flow-map", "json-list", "json-map", "block"])
    key = rng.choice(["tpu_env", "fsdp_config", "commands", "main_process_ip", "deepspeed_config"])
    if style == "block":
        depth = min(depth, 500)
        return Case(f"deep-{depth}-block", lambda: _block(depth), reject=True, hint="nested more than")
    if style.startswith("json"):
        return Case(f"deep-{depth}-{style}", lambda: f'{{"{key}": {_nest(depth, style)}}}', ".json", reject=True,
                    hint="nested more than")
    return Case(f"deep-{depth}-{style}", lambda: f"{key}: {_nest(depth, style)}\n", reject=True,
                hint="nested more than")


def _nested_ok(rng: random.Random) -> Case:
    depth = rng.randint(1, 20)
    return Case(f"nested-{depth}-ok", lambda: f"tpu_env: {_nest(depth, 'flow-list')}\n")


def _alias(rng: random.Random) -> Case:
    key = rng.choice(["tpu_env", "main_process_ip", "commands", "fsdp_config", "tpu_vm", "deepspeed_config"])
    kind = rng.choice(["bomb", "bomb", "anchor", "merge"])
    if kind == "bomb":
        return Case(f"alias-bomb-{key}", lambda: _bomb(key), reject=True, hint="aliases")
    if kind == "anchor":
        return Case("alias-anchor", lambda: "mixed_precision: &m bf16\n", reject=True, hint="aliases")
    text = "base: &base {num_processes: 2}\n<<: *base\nmixed_precision: bf16\n"
    return Case("alias-merge", lambda: text, reject=True, hint="aliases")


def _huge(rng: random.Random) -> Case:
    size = rng.choice([300 << 10, 900 << 10, 3 << 19, 5 << 20])
    style = rng.choice(["block", "flow", "json", "strings"])
    if style == "block":
        return Case(f"huge-{size >> 10}KiB-block", lambda: "tpu_env:\n" + "- x\n" * (size // 4), reject=True)
    if style == "flow":
        return Case(f"huge-{size >> 10}KiB-flow", lambda: "tpu_env: [" + "1, " * (size // 3) + "1]\n", reject=True)
    if style == "json":
        return Case(f"huge-{size >> 10}KiB-json", lambda: '{"tpu_env": [' + '{"a": 1}, ' * (size // 10) + "1]}",
                    ".json", reject=True)
    key = rng.choice(["use_cpu", "mixed_precision", "main_process_ip", "gpu_ids", "num_processes"])
    long = size < 1 << 20 and key in ("main_process_ip", "gpu_ids")  # a long string where any string goes
    return Case(f"long-{key}-{size >> 10}KiB", lambda: f"{key}: {'y' * size}\n", reject=not long)


def _giant_number(rng: random.Random) -> Case:
    where, value = rng.choice(NUMERIC_KEYS), rng.choice([*ABSURD, "65536", "70000"])
    if value in ("65536", "70000"):
        where = ("main_process_port",)
    text = f"{where[0]}: {value}\n" if len(where) == 1 else f"{where[0]}:\n  {where[1]}: {value}\n"
    return Case(f"number-{'.'.join(where)}-{value[:12]}", lambda: text, reject=True)


def _scalar(rng: random.Random) -> Case:
    key, value = rng.choice(["use_cpu", "main_process_ip", "num_processes", "tpu_env", "mixed_precision"]), \
        rng.choice(SCALARS)
    return Case(f"scalar-{key}", lambda: f"distributed_type: NO\n{key}: {value}\n")


def _structure(rng: random.Random) -> Case:
    text = rng.choice(["", "\n", "~", "null", "[]", "{}", "0", "- a\n- b\n", "'just a string'", "---\n---\n",
                       "a: 1\n---\nb: 2\n", "---\nmixed_precision: bf16\n...\n", "<<: {num_processes: 2}\n",
                       "1: 2\n", "? [a, b]\n: c\n", "null: x\n", "{a: 1}: 2\n", "true: 1\n", "%YAML 1.1\n---\na: 1\n",
                       "%TAG ! tag:x,2000:\n---\na: !b 1\n", "fsdp_config: 3\n", "deepspeed_config: [1]\n"])
    return Case("structure", lambda: text)


def _deepspeed(rng: random.Random) -> Case:
    raw = json.loads(json.dumps(DEEPSPEED_JSON))
    for key in rng.sample(sorted(raw), rng.randint(0, 4)):
        if len(raw) > 1 and key not in ("zero_optimization",):
            del raw[key]
    raw["zero_optimization"]["stage"] = rng.choice([0, 1, 2, 3])
    if rng.random() < 0.3:
        return Case("deepspeed-json-as-yaml", lambda: yaml.safe_dump(raw), reject=True, hint="deepspeed_config_file")
    return Case("deepspeed-json", lambda: json.dumps(raw, indent=4), ".json", reject=True,
                hint="deepspeed_config_file")


def _break_text(rng: random.Random) -> Case:
    """Truncation, junk characters (some not UTF-8) or flipped bytes in a template's text."""
    name = rng.choice(sorted(TEMPLATES))
    text, suffix = _dump(TEMPLATES[name], rng)
    kind = rng.choice(["truncate", "junk", "junk", "flip"])
    if kind == "truncate":
        cut = rng.randint(0, len(text))
        return Case(f"truncate-{name}{suffix}", lambda: text[:cut], suffix)
    data = bytearray(text.encode())
    for _ in range(rng.randint(1, 5)):
        at = rng.randint(0, len(data))
        if kind == "flip" and data:
            data[min(at, len(data) - 1)] = rng.randrange(256)
        else:
            data[at:at] = rng.choice(JUNK).encode("utf-8", "surrogatepass")
    blob = bytes(data)
    return Case(f"{kind}-{name}{suffix}", lambda: blob, suffix)


def _swap(rng: random.Random) -> Case:
    name = rng.choice(sorted(TEMPLATES))
    if rng.random() < 0.5:
        return Case(f"swap-yaml-as-json-{name}", lambda: yaml.safe_dump(TEMPLATES[name]), ".json")
    return Case(f"swap-json-as-yaml-{name}", lambda: json.dumps(TEMPLATES[name], indent=2), ".yml")


MUTATIONS = [(_edit, 6), (_duplicate, 2), (_deep, 2), (_nested_ok, 1), (_alias, 2), (_huge, 1), (_giant_number, 2),
             (_scalar, 2), (_structure, 1), (_deepspeed, 1), (_break_text, 4), (_swap, 1)]


def corpus(seed: int, n: int) -> list[Case]:
    """The cases the issue names, always, then `n` minus those drawn from MUTATIONS by their weights."""
    fixed = [
        *(Case(f"template-{name}", lambda r=raw: yaml.safe_dump(r)) for name, raw in TEMPLATES.items()),
        Case("list-25MiB", lambda: "tpu_env:\n" + "- x\n" * (25 << 18), reject=True, hint="MiB"),
        Case("list-5MiB-json", lambda: '{"tpu_env": [' + "1, " * (5 << 19) + "1]}", ".json", reject=True, hint="MiB"),
        Case("alias-bomb-tpu_env", lambda: _bomb("tpu_env"), reject=True, hint="aliases"),
        Case("alias-bomb-main_process_ip", lambda: _bomb("main_process_ip"), reject=True, hint="aliases"),
        Case("deep-500-yaml", lambda: f"tpu_env: {_nest(500, 'flow-list')}\n", reject=True, hint="nested"),
        Case("deep-500-json", lambda: f'{{"tpu_env": {_nest(500, "json-list")}}}', ".json", reject=True,
             hint="nested"),
        Case("giant-num_processes", lambda: "num_processes: 1000000000000000000000000000000\n", reject=True,
             hint="num_processes"),
        Case("duplicate-num_processes", lambda: "num_processes: 2\nmixed_precision: bf16\nnum_processes: 8\n",
             reject=True, hint="'num_processes' appears twice"),
        Case("deepspeed-template", lambda: json.dumps(DEEPSPEED_JSON, indent=4), ".json", reject=True,
             hint="deepspeed_config_file"),
    ]
    rng = random.Random(seed)
    kinds, weights = zip(*MUTATIONS)
    drawn = [rng.choices(kinds, weights)[0](rng) for _ in range(n - len(fixed))]
    cases = fixed + drawn
    for i, case in enumerate(cases):
        case.name = f"{i:04d}-{case.name}"
    return cases


def answer(case: Case, path: Path) -> tuple[str, str, float]:
    """Runs `hf-backend config validate` on `case` written at `path`, in this process: ("error", line) for one
    line naming the file (with the case's hint), ("accepted", "") for a config that is valid and reads back the
    same, "unclear" or "silent" (accepted though it must not be, or invalid) otherwise; and the seconds it took.
    Any other exception propagates: that is a traceback."""
    content = case.build()
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        start = time.perf_counter()
        code = main(["config", "validate", str(path)])
        seconds = time.perf_counter() - start
    if code == 2:
        line = err.getvalue()
        clean = line.count("\n") == 1 and line.endswith("\n") and str(path) in line and len(line) < 300 + len(str(path))
        return ("error" if clean and case.hint in line else "unclear"), line, seconds
    assert code == 0, f"exit code {code}"
    if case.reject:
        return "silent", out.getvalue()[:300], seconds
    config = load_config(path)
    try:
        assert_valid_config(config)
        assert load_config(write_config(config, path.with_name("again" + path.suffix))) == config
    except AssertionError as wrong:
        return "silent", str(wrong), seconds
    return "accepted", "", seconds


@pytest.mark.parametrize("case", corpus(SEED, CASES), ids=lambda case: case.name)
def test_a_mutated_config_is_one_error_line_or_valid_within_a_second(tmp_path, case):
    path = tmp_path / f"c{case.suffix}"
    verdict, detail, seconds = answer(case, path)
    assert verdict in ("error", "accepted"), f"{verdict}: {detail[:400]!r}"
    if seconds >= TIME_BOUND:  # a second try, so that a busy machine's pause is not taken for a stall
        seconds = min(seconds, answer(case, path)[2])
    path.unlink()  # some are 25 MiB
    assert seconds < TIME_BOUND, f"{seconds:.2f} s"


def test_the_command_line_answers_an_alias_bomb_with_one_line_and_exit_2(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb("tpu_env"))
    proc = cli("config", "validate", str(path), timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"hf-backend config: error: {path}: line 2: YAML aliases (&anchor / *alias) are not "
                           "allowed in a config file; write the value out\n")


@pytest.mark.parametrize(("name", "text", "message"), [
    ("c.yaml", "num_processes: 2\nuse_cpu: true\nnum_processes: 4\n",
     "c.yaml: line 3: key 'num_processes' appears twice (first on line 1); keep one of them"),
    ("c.yaml", "fsdp_config: {fsdp_version: 2, fsdp_version: 1}\n",
     "c.yaml: line 1: key 'fsdp_version' appears twice (first on line 1); keep one of them"),
    ("c.json", '{"num_processes": 2, "num_processes": 4}',
     "c.json: key 'num_processes' appears twice in one object; keep one of them"),
    ("c.yaml", "x: &x 1\n", "c.yaml: line 1: YAML aliases (&anchor / *alias) are not allowed in a config file"),
    ("c.yaml", "tpu_env: " + "[" * 33 + "]" * 33, "c.yaml: line 1: nested more than 32 levels deep"),
    ("c.json", '{"tpu_env": ' + "[" * 50_000 + "]" * 50_000 + "}", "c.json: nested more than 32 levels deep"),
    ("c.yaml", "tpu_env: [" + "1, " * 10_000 + "1]", "c.yaml: line 1: more than 10,000 values"),
    ("c.yaml", "tpu_env: [" + "1, " * 400_000 + "1]", "c.yaml: is 1.1 MiB, larger than the 1 MiB a config file"),
    ("c.yaml", "num_processes: 1" + "0" * 1000, "c.yaml: line 1: a number 1,001 characters long ('1000"),
    ("c.yaml", "num_processes: 1" + "0" * 5000, "c.yaml: num_processes='10000"),  # a string to YAML: no regexes
    ("c.yaml", "".join(f"%TAG !t{i}! tag:x{i}:\n" for i in range(40_000)) + "---\na: 1\n",
     "c.yaml: more than 8 lines start with % (YAML directives); a config file needs none"),
    ("c.json", '{"num_processes": 1' + "0" * 5000 + "}", "c.json: a number 5,001 characters long"),
    ("c.yaml", "main_process_ip: 2001-13-45\n", "c.yaml: line 1: '2001-13-45' is not a valid timestamp (month"),
    ("c.yaml", "use_cpu: !!bool maybe\n", "c.yaml: line 1: 'maybe' is not a valid bool"),
    ("c.yaml", "use_cpu: true\x00\n", "c.yaml: line 1: character U+0000 is not allowed in YAML; remove it"),
    ("c.yaml", "use_cpu: " + "y" * 100_000, "c.yaml: use_cpu='" + "y" * 56),
    ("c.yaml", "a" * 100 + ": 1\n", "c.yaml: unknown key '" + "a" * 56 + "...; see docs/config.md"),
    ("c.json", json.dumps(DEEPSPEED_JSON), "c.json looks like a DeepSpeed config (zero_optimization, "
     "train_micro_batch_size_per_gpu, train_batch_size, fp16); pass it as deepspeed_config_file: under "
     "deepspeed_config in an accelerate config, or to `hf-backend launch --deepspeed_config_file`"),
    ("c.yaml", "distributed_type: DEEPSPEED\nzero_optimization: {stage: 3}\n",
     "c.yaml: 'zero_optimization' is a key of DeepSpeed's own JSON config, not of an accelerate config; put "
     "DeepSpeed settings in a JSON file named by deepspeed_config.deepspeed_config_file"),
])
def test_the_limits_are_one_line_errors(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    text = str(caught.value)
    assert message in text and "\n" not in text and len(text) - len(str(path)) < 250
    assert time.perf_counter() - start < TIME_BOUND


def test_the_pure_python_parser_keeps_the_same_rules(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_LOADER", loader._strict_loader(loader._PyEvents))
    path = tmp_path / "c.yaml"
    for text, message in ((_bomb("tpu_env"), "line 2: YAML aliases"), ("a: 1\na: 2\n", "line 2: key 'a' appears"),
                          ("tpu_env: " + "[" * 40 + "]" * 40, "line 1: nested more than 32")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(path)
    path.write_text(DOCS_FSDP_YAML)
    assert load_config(path).fsdp.fsdp_transformer_layer_cls_to_wrap == "BertLayer"


def test_every_number_a_config_holds_has_a_range():
    for model in (LaunchConfig, FsdpSection, DeepSpeedSection):
        for name, f in fields_of(model).items():
            meta = f.metadata
            if str(f.type).split(" | ")[0] in ("int", "float") and not meta["choices"]:
                assert meta["minimum"] is not None and meta["maximum"] is not None, f"{model.__name__}.{name}"


def test_an_error_quotes_a_bounded_prefix_of_any_value():
    start = time.perf_counter()
    long = "y" * 10**7
    for value in (10**100_000, [[list(range(10**5))] * 10**3] * 10**3, long, {i: long for i in range(10**4)}):
        assert len(show(value)) <= 60
    assert show(10**100_000) == "<a 100001-digit integer>"
    assert time.perf_counter() - start < TIME_BOUND
