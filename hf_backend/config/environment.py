"""The environment variables through which a launcher hands settings to `Accelerator()` in each
process.

`hf-backend launch` writes them (`to_environment`); `Accelerator()` and `TrainingArguments` read
them (`resolve`, `read_launch_config`). Nothing here writes `os.environ`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from ..core.errors import HfBackendError
from ..core.notes import warn

PREFIX = "HF_BACKEND_"
MIXED_PRECISION = PREFIX + "MIXED_PRECISION"
GRADIENT_ACCUMULATION_STEPS = PREFIX + "GRADIENT_ACCUMULATION_STEPS"
USE_CPU = PREFIX + "USE_CPU"
DYNAMO_BACKEND = PREFIX + "DYNAMO_BACKEND"
DISTRIBUTED_TYPE = PREFIX + "DISTRIBUTED_TYPE"
FSDP_CONFIG = PREFIX + "FSDP_CONFIG"  # JSON of the validated fsdp_config section
DEEPSPEED_CONFIG = PREFIX + "DEEPSPEED_CONFIG"  # JSON of the validated deepspeed_config section
# JSON of the fault_tolerance_config section, its lighthouse resolved (fault_tolerance.FaultTolerance reads it)
FAULT_TOLERANCE = PREFIX + "FAULT_TOLERANCE"
# the file the launcher read, for `hf-backend env` and messages
CONFIG_FILE = PREFIX + "CONFIG_FILE"
# Accelerate's names, so that `accelerate launch --parallelism_config_tp_size 2` starts hf_backend
# scripts too; the sizes travel in PARALLELISM_CONFIG_<NAME>_SIZE, which ParallelismConfig reads
# (parallel/config.py)
USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"


def launcher_setting(name: str) -> str | None:
    """The value a launcher set for `name`, or None; empty strings count as unset."""
    value = os.environ.get(name, "")
    return value or None


# The LaunchConfig keys a launcher hands over, each in its variable (the sections below travel as
# JSON)
_CARRIED = {"distributed_type": DISTRIBUTED_TYPE, "mixed_precision": MIXED_PRECISION, "use_cpu": USE_CPU,
            "gradient_accumulation_steps": GRADIENT_ACCUMULATION_STEPS, "dynamo_backend": DYNAMO_BACKEND}
_SECTIONS = {"FSDP": ("fsdp_config", FSDP_CONFIG), "DEEPSPEED": ("deepspeed_config", DEEPSPEED_CONFIG)}


def to_environment(config: Any, config_file: str | None = None) -> dict[str, str]:
    """The variables that carry a LaunchConfig to the processes."""
    env = {name: _text(getattr(config, key)) for key, name in _CARRIED.items()}
    if config.distributed_type in _SECTIONS:
        key, name = _SECTIONS[config.distributed_type]
        env[name] = json.dumps(getattr(config, key))
    # ParallelismConfig() reads these
    if config.parallelism_config and config.distributed_type != "DEEPSPEED":
        env[USE_PARALLELISM_CONFIG] = "true"
        for key, value in config.parallelism_config.items():
            # parallelism_config_tp_size -> PARALLELISM_CONFIG_TP_SIZE
            env[key.upper()] = str(value)
    if config.fault_tolerance:
        env[FAULT_TOLERANCE] = json.dumps(dataclasses.asdict(config.replica_group))
    if config_file:
        env[CONFIG_FILE] = str(config_file)
    return env


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def read_launch_config() -> Any | None:
    """The LaunchConfig a launcher handed to this process (validated again), or None outside a launch.
    """
    from .loader import validate

    if launcher_setting(DISTRIBUTED_TYPE) is None:
        return None
    raw: dict[str, Any] = {key: launcher_setting(name) for key, name in _CARRIED.items()
                           if launcher_setting(name) is not None}
    for key, name in _SECTIONS.values():
        carried = launcher_setting(name)
        if carried is not None:
            try:
                raw[key] = json.loads(carried)
            except json.JSONDecodeError:
                raise HfBackendError(f"environment variable {name} is not JSON; start the job with "
                                     "hf-backend launch, or unset it") from None
    return validate(raw, source=f"the launcher's environment ({PREFIX}*)")


def parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise ValueError(raw)


# Each setting a launcher hands over: its variable, how the variable is read, and the value when
# nobody sets it.
SETTINGS: dict[str, tuple[str, Callable[[str], Any], Any]] = {
    "cpu": (USE_CPU, parse_bool, False),
    "mixed_precision": (MIXED_PRECISION, str, "no"),
    "gradient_accumulation_steps": (GRADIENT_ACCUMULATION_STEPS, int, 1),
    "dynamo_backend": (DYNAMO_BACKEND, str.lower, "no"),
}


def resolve(name: str, explicit: Any = None) -> Any:
    """The setting `name` (a SETTINGS key) in effect: an explicit argument wins over what a launcher
    put in the environment, with a warning when they differ; else the launcher's value; else the
    default. `Accelerator()` and `TrainingArguments` both ask here."""
    env_name, parse, default = SETTINGS[name]
    raw = launcher_setting(env_name)
    from_env = None
    if raw is not None:
        try:
            from_env = parse(raw)
        except ValueError:
            raise HfBackendError(f"environment variable {env_name}={raw!r} "
                                 f"is not valid for {name}") from None
    if explicit is None:
        return default if from_env is None else from_env
    if from_env is not None and from_env != explicit:
        warn(f"{name}={explicit!r} given to Accelerator() "
             f"overrides the launcher's {env_name}={raw}")
    return explicit

