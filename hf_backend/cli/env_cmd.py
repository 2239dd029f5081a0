"""`hf-backend env`: the report to paste into a bug report (versions, devices, dtypes, the config in
effect)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import warnings
from typing import Any

import hf_backend

from ..config import environment as env
from ..config.loader import default_config_path, load_config
from ..core.errors import ConfigError

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


def _autocast_dtypes(device: str) -> str:
    """The 16-bit dtypes autocast really computes a matmul in on this device (probed: torch disables
    autocast with a warning for a dtype a device does not support)."""
    import torch

    from ..core.dtypes import dtype_name

    works = []
    for dtype in (torch.bfloat16, torch.float16):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                x = torch.ones(2, 2, device=device)
                with torch.autocast(device_type=device, dtype=dtype):
                    if torch.mm(x, x).dtype == dtype:
                        works.append(dtype_name(dtype))
        except Exception:  # noqa: BLE001 - a device or dtype torch cannot run here: not listed
            continue
    return ", ".join(works) or "none"


def _dtype_lines(config: Any) -> list[str]:
    import torch

    from ..core.dtypes import dtype_name

    devices = [f"cpu {_autocast_dtypes('cpu')} (cpu capability "
               f"{torch.backends.cpu.get_cpu_capability()})"]
    if torch.cuda.is_available():
        devices.append(f"cuda {_autocast_dtypes('cuda')} (bf16 supported: "
                       f"{torch.cuda.is_bf16_supported()})")
    from_env = env.launcher_setting(env.MIXED_PRECISION)
    mode, source = (from_env, env.MIXED_PRECISION) if from_env else \
        (config.mixed_precision, "config file") if config is not None else ("no", "default")
    deepspeed = (env.launcher_setting(env.DISTRIBUTED_TYPE) or getattr(config, "distributed_type", "")) == "DEEPSPEED"
    if deepspeed:
        effect = "DeepSpeed keeps fp32 master weights and optimizer state, the module in " + \
            (mode if mode in ("bf16", "fp16") else "the dtype it was loaded in")
    elif mode in ("bf16", "fp16"):
        effect = ("the optimizer steps fp32 master weights with fp32 state "
                  "(trainable bf16/fp16 parameters are upcast at prepare); "
                  f"the forward computes in {mode} under autocast")
    else:
        effect = "the optimizer steps the parameters in the dtype they were loaded in, state included"
    return [f"dtypes: torch default {dtype_name(torch.get_default_dtype())}; autocast computes in "
            + "; ".join(devices),
            f"mixed precision: {mode} ({source}): {effect}"]


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
    config = None
    if os.path.isfile(path):
        try:
            config = load_config(path)
            lines.append(f"config file: {path}")
            lines += [f"  {k}: {v}" for k, v in config.to_dict().items() if v not in ({}, None, [])]
        except ConfigError as err:
            lines.append(f"config file: {path} is invalid: {err}")
    else:
        lines.append(f"config file: none ({path} does not exist; `hf-backend config` writes it)")
    config_at = next(i for i, line in enumerate(lines) if line.startswith("config file:"))
    # after the devices, before the config file's keys
    lines[config_at:config_at] = _dtype_lines(config)
    settings = {k: v for k, v in os.environ.items() if k.startswith(env.PREFIX)}
    lines.append("launcher settings in this environment: " + (", ".join(f"{k}={v}" for k, v in settings.items())
                                                             or "none"))
    print("\n".join(lines))
    return 0
