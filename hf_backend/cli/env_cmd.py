"""`hf-backend env`: the report to paste into a bug report (versions, devices, the config in effect)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
from typing import Any

import hf_backend

from ..config import environment as env
from ..config.loader import ConfigError, default_config_path, load_config

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "ray", "safetensors", "huggingface_hub", "numpy",
            "datasets", "evaluate")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("env", help="print versions, devices and the config in effect")
    p.add_argument("--config_file", default=None, help="report this config instead of the default one")
    p.set_defaults(func=run_env)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_env(args: argparse.Namespace) -> int:
    import torch

    lines = [
        f"hf_backend: {hf_backend.__version__}",
        f"python: {platform.python_version()} ({platform.python_implementation()})",
        f"platform: {platform.platform()}",
        *(f"{name}: {_version(name)}" for name in PACKAGES),
        f"cpu cores: {os.cpu_count()}",
        f"cuda available: {torch.cuda.is_available()}"
        + (f" ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""),
        f"distributed backends: gloo={torch.distributed.is_gloo_available()}, "
        f"nccl={torch.distributed.is_nccl_available()}",
    ]
    path = args.config_file or os.environ.get(env.CONFIG_FILE) or default_config_path()
    if os.path.isfile(path):
        try:
            config = load_config(path)
            lines.append(f"config file: {path}")
            lines += [f"  {k}: {v}" for k, v in config.to_dict().items() if v not in ({}, None, [])]
        except ConfigError as err:
            lines.append(f"config file: {path} is invalid: {err}")
    else:
        lines.append(f"config file: none ({path} does not exist; `hf-backend config` writes it)")
    settings = {k: v for k, v in os.environ.items() if k.startswith(env.PREFIX)}
    lines.append("launcher settings in this environment: " + (", ".join(f"{k}={v}" for k, v in settings.items())
                                                             or "none"))
    print("\n".join(lines))
    return 0
