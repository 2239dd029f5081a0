"""`hf-backend config`: write a config file by answering questions (piped answers work), with defaults,
or check one.

    hf-backend config [--config_file PATH]           the questions `accelerate config` asks
    hf-backend config default [--config_file PATH] [--mixed_precision ...] [--num_processes N] [--cpu]
    hf-backend config validate FILE
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ..config.loader import coerce, default_config_path, load_config, validate, write_config
from ..config.schema import (
    DeepSpeedSection,
    FsdpSection,
    LaunchConfig,
    ParallelismSection,
    default_of,
    fields_of,
)
from ..core.errors import ConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="write or check a config file", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_file", default=None, help=f"where to write (default: {default_config_path()})")
    p.set_defaults(func=run_interactive)
    actions = p.add_subparsers(dest="config_action", metavar="ACTION")
    d = actions.add_parser("default", help="write a config without questions")
    d.add_argument("--config_file", default=None, help=f"where to write (default: {default_config_path()})")
    d.add_argument("--mixed_precision", default="no", choices=("no", "fp16", "bf16"), help="autocast dtype")
    d.add_argument("--num_processes", type=int, default=1, help="processes on this machine")
    d.add_argument("--cpu", action="store_true", help="train on the CPU only")
    d.set_defaults(func=run_default)
    v = actions.add_parser("validate", help="check a config file and print what it sets")
    v.add_argument("file", help="the YAML or JSON file to check")
    v.set_defaults(func=run_validate)


def run_default(args: argparse.Namespace) -> int:
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    kind = "NO" if args.num_processes == 1 else ("MULTI_CPU" if cpu else "MULTI_GPU")
    config = validate({"distributed_type": kind, "num_processes": args.num_processes, "use_cpu": cpu,
                       "mixed_precision": args.mixed_precision}, source="config default")
    path = write_config(config, args.config_file or default_config_path())
    print(f"hf-backend config: wrote {path}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    settings = ", ".join(f"{k}={v}" for k, v in config.to_dict().items() if v not in ({}, None, []))
    print(f"{args.file}: valid ({settings})")
    return 0


class _Asker:
    """Reads one answer per question from stdin: a TTY or a pipe; an empty answer takes the default.
    """

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, question: str, default: Any, check: Callable[[str], Any]) -> Any:
        while True:
            self.count += 1
            sys.stdout.write(f"{question} [{_render(default)}]: ")
            sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                raise ConfigError(f"config: the answers ended at question {self.count} "
                                  f"({question!r}); give one line per question (an empty line "
                                  "takes the default)")
            answer = line.strip()
            if not answer:
                return default
            try:
                return check(answer)
            except ConfigError as err:
                if not sys.stdin.isatty():
                    raise
                print(f"  {err}")


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return "" if value is None else str(value)


def _field_question(ask: _Asker, model: type, name: str, values: dict, question: str | None = None) -> None:
    f = fields_of(model)[name]
    choices = f.metadata["choices"]
    text = question or f.metadata["question"] or name
    if choices:
        text += f" ({'/'.join(map(str, choices))})"
    values[name] = ask(text, default_of(f), lambda answer: coerce(answer, f, f"config: {name}"))


def run_interactive(args: argparse.Namespace) -> int:
    ask = _Asker()
    top: dict[str, Any] = {}
    machine = ask("Which kind of machine: no distributed training, multi-CPU or multi-GPU? (no/cpu/gpu)", "no",
                  lambda a: _pick(a, {"no": "NO", "cpu": "MULTI_CPU", "gpu": "MULTI_GPU"}, "machine"))
    top["distributed_type"] = machine
    top["use_cpu"] = machine == "MULTI_CPU"
    if machine != "NO":
        _field_question(ask, LaunchConfig, "num_machines", top)
        if top["num_machines"] > 1:
            for name in ("machine_rank", "main_process_ip", "main_process_port"):
                _field_question(ask, LaunchConfig, name, top)
        _field_question(ask, LaunchConfig, "num_processes", top)
        if machine == "MULTI_GPU":
            if ask("Use DeepSpeed? (yes/no)", False, _yes_no):
                top["distributed_type"] = "DEEPSPEED"
                top["deepspeed_config"] = _section(ask, DeepSpeedSection)
            elif ask("Use FullyShardedDataParallel? (yes/no)", False, _yes_no):
                top["distributed_type"] = "FSDP"
                top["fsdp_config"] = _section(ask, FsdpSection)
        elif ask("Use FullyShardedDataParallel (FSDP2 over gloo)? (yes/no)", False, _yes_no):
            top["distributed_type"] = "FSDP"
            top["fsdp_config"] = _section(ask, FsdpSection)
        if top["distributed_type"] != "DEEPSPEED" and ask(
                "Lay the processes out with a ParallelismConfig (tensor "
                "parallelism x FSDP)? (yes/no)", False, _yes_no):
            top["parallelism_config"] = _section(ask, ParallelismSection)
    if machine == "NO":
        _field_question(ask, LaunchConfig, "use_cpu", top)
    _field_question(ask, LaunchConfig, "mixed_precision", top)
    config = validate(top, source="config answers")
    path = write_config(config, args.config_file or default_config_path())
    print(f"hf-backend config: wrote {path}")
    return 0


def _section(ask: _Asker, model: type) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, f in fields_of(model).items():
        if f.metadata["question"]:
            _field_question(ask, model, name, values)
    return values


def _yes_no(answer: str) -> bool:
    return _pick(answer, {"yes": True, "y": True, "no": False, "n": False}, "answer")


def _pick(answer: str, options: dict[str, Any], what: str) -> Any:
    key = answer.strip().lower()
    if key not in options:
        raise ConfigError(f"config: {what} {answer!r} is not one of {', '.join(options)}")
    return options[key]
