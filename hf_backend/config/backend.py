"""Which backend a process trains with: FSDP, DeepSpeed, or plain data parallelism. Decided here only.

Precedence: what the caller was given explicitly (`Accelerator(fsdp_plugin=...)`,
`TrainingArguments(fsdp=...)`), then the launcher's `distributed_type` (`hf-backend launch` hands
the config file's choice and section over in HF_BACKEND_* variables), then plain data parallelism.
Plain means one process or DDP: the world size decides that later (`ProcessState.distributed_type`),
as it does whether FSDP or DeepSpeed asked for in one process run at all
(`strategies.select_strategy`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..core.errors import ConfigError
from ..core.notes import note
from .environment import read_launch_config
from .fsdp import FsdpOptions
from .plugins import DeepSpeedPlugin, fsdp_options

FSDP, DEEPSPEED, DATA_PARALLEL = "FSDP", "DEEPSPEED", "DATA_PARALLEL"


@dataclass(frozen=True)
class Caller:
    """Who asks, as its messages say it. `reads_arguments`: the explicit values are plugin objects,
    read here into the Backend's options; otherwise they only say what is asked for, and the caller
    reads them itself (TrainingArguments: its fsdp / fsdp_config / deepspeed values, once
    transformers has parsed them)."""

    both_set: str  # the error when FSDP and DeepSpeed are both asked for
    # the note when the explicit choice is not the launcher's ({chosen}, {launched})
    overrides_launcher: str | None
    reads_arguments: bool


ACCELERATOR = Caller("Accelerator(): pass fsdp_plugin or deepspeed_plugin, "
                     "not both", None, reads_arguments=True)
TRAINING_ARGUMENTS = Caller(
    "TrainingArguments: fsdp and deepspeed are both set; keep one of them",
    "TrainingArguments ask for {chosen}; the launcher's "
    "distributed_type {launched} is not used", reads_arguments=False)


@dataclass(frozen=True)
class Backend:
    """The choice, with its one resolved options object: `fsdp` for FSDP, `deepspeed` (the plugin; its
    "auto" values are resolved when the engine is built) for DeepSpeed. Both are None for
    DATA_PARALLEL, and for an explicit choice whose caller reads its own arguments."""

    kind: str  # FSDP, DEEPSPEED or DATA_PARALLEL
    fsdp: FsdpOptions | None = None
    deepspeed: DeepSpeedPlugin | None = None


_FROM_ENVIRONMENT: Any = object()


def choose_backend(fsdp: Any = None, deepspeed: Any = None, launch_config: Any = _FROM_ENVIRONMENT,
                   caller: Caller = ACCELERATOR) -> Backend:
    """The backend for `fsdp` / `deepspeed` (what the caller was given; None: not asked for) and
    `launch_config` (the LaunchConfig a launcher handed over, or None; read from the environment
    when not passed)."""
    if fsdp is not None and deepspeed is not None:
        raise ConfigError(caller.both_set)
    if launch_config is _FROM_ENVIRONMENT:
        launch_config = read_launch_config()
    launched = launch_config.distributed_type if launch_config is not None else None
    if caller.reads_arguments:
        _refuse_paths(fsdp, deepspeed)
    if fsdp is not None or deepspeed is not None:
        chosen = FSDP if fsdp is not None else DEEPSPEED
        if caller.overrides_launcher and launched in (FSDP, DEEPSPEED) and launched != chosen:
            note(caller.overrides_launcher.format(chosen=chosen, launched=launched))
        if not caller.reads_arguments:
            return Backend(chosen)
        if fsdp is not None:
            return Backend(FSDP, fsdp=fsdp_options(fsdp))
        return Backend(DEEPSPEED, deepspeed=DeepSpeedPlugin.from_object(deepspeed))
    if launched == FSDP:
        # only the keys the file gave: the rest follow from them (SHARD_GRAD_OP keeps parameters
        # after forward)
        return Backend(FSDP, fsdp=FsdpOptions.from_section(launch_config.fsdp_config))
    if launched == DEEPSPEED:
        return Backend(DEEPSPEED, deepspeed=DeepSpeedPlugin.from_section(launch_config.deepspeed))
    return Backend(DATA_PARALLEL)


def _refuse_paths(fsdp: Any, deepspeed: Any) -> None:
    """A config file given where a plugin object is expected would otherwise be read as a plugin with
    no fields."""
    if isinstance(fsdp, (str, os.PathLike)):
        raise ConfigError(f"Accelerator(fsdp_plugin={str(fsdp)!r}): pass a "
                          "FullyShardedDataParallelPlugin(...); a config file goes to `hf-backend "
                          "launch --config_file` or TrainingArguments(fsdp_config=...)")
    if isinstance(deepspeed, (str, os.PathLike)):
        raise ConfigError(f"Accelerator(deepspeed_plugin={str(deepspeed)!r}): pass "
                          f"DeepSpeedPlugin(hf_ds_config={str(deepspeed)!r}) for a DeepSpeed JSON, "
                          "or launch with `hf-backend launch --config_file`")
