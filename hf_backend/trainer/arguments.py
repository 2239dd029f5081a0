"""`TrainingArguments`: transformers' class on hf_backend's process state and plugins.

What differs from transformers.TrainingArguments:
- processes and device come from hf_backend's process state (never Accelerate's `PartialState`);
- `fsdp_config` also takes the YAML that `hf-backend config` / `accelerate config` write and plugin
  objects, and `deepspeed` takes a DeepSpeedPlugin (see config/training_arguments.py); with neither
  set, the FSDP or DeepSpeed choice of `hf-backend launch` applies, and so does its mixed precision;
- contradictions (fsdp and deepspeed both set, a bad option) and `push_to_hub` without a reachable
  Hub fail here, at construction, in one line;
- `bf16=True` on a machine without a GPU trains in bf16 on the CPU (transformers demands
  `use_cpu=True`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import socket
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import torch
import transformers
from transformers.trainer_pt_utils import AcceleratorConfig

from ..config import environment as env
from ..config.backend import TRAINING_ARGUMENTS, Backend, choose_backend
from ..config.fsdp import FsdpOptions
from ..config.plugins import DeepSpeedPlugin
from ..config.training_arguments import deepspeed_config_from_argument, fsdp_options_from_arguments
from ..core import checks
from ..core.errors import ConfigError, HfBackendError
from ..fault_tolerance import settings as fault_tolerance
from ..parallel.config import ParallelismConfig
from ..runtime import accelerate_state
from ..runtime.process import get_process_state, process_state_is_set_up
from .accelerate_names import engine_named
from .replica_groups import writes_for_the_run

if TYPE_CHECKING:  # engine_named(cls) is a subclass of cls with the same members
    _EngineNamed = transformers.TrainingArguments
else:
    _EngineNamed = engine_named(transformers.TrainingArguments)


@dataclass
class TrainingArguments(_EngineNamed):
    async_save: bool = dataclasses.field(default=False, metadata={"help": (
        "hf_backend: a checkpoint's large files are copied to host memory and written in the "
        "background while training goes on; the checkpoint counts (trainer_state.json, rotation) "
        "once every file is written")})
    chunked_loss: bool = dataclasses.field(default=True, metadata={"help": (
        "hf_backend: a causal LM's training loss from its last hidden state a chunk of tokens at a "
        "time, never holding the whole logits (docs/memory.md); the model's own loss exactly, where it "
        "applies (training/chunked_loss.py); False: the model's own forward")})
    fault_tolerance: bool | None = dataclasses.field(default=None, metadata={"help": (
        "hf_backend: this job is one replica group of a torchft run (docs/fault_tolerance.md); None: as "
        "`hf-backend launch --fault_tolerance` says")})
    fsdp_options = None  # config.fsdp.FsdpOptions, resolved once by _process_fsdp_args
    replica_group = None  # fault_tolerance.FaultTolerance, resolved once in __post_init__

    def __post_init__(self) -> None:
        for name in ("gradient_accumulation_steps", "per_device_train_batch_size", "per_device_eval_batch_size"):
            checks.whole(getattr(self, name), f"TrainingArguments.{name}", minimum=1)
        # Accelerate's (what transformers' docs pass), ours or a dict
        if self.parallelism_config is not None:
            self.parallelism_config = ParallelismConfig.of(self.parallelism_config,
                                                           "TrainingArguments.parallelism_config")
        # transformers types the field as given (dict, JSON path or None); read, it is an AcceleratorConfig
        self.accelerator_config = _accelerator_config(self.accelerator_config)  # type: ignore[assignment]
        self.replica_group = fault_tolerance.resolve(self.fault_tolerance)
        # fsdp / fsdp_config / deepspeed given here win (and are read below, once transformers has
        # parsed them); without them the launcher's FSDP or DeepSpeed options, read by
        # choose_backend, apply.
        wants_fsdp = bool(self.fsdp) or self.fsdp_config not in (None, {})
        self._backend = choose_backend(True if wants_fsdp else None, self.deepspeed or None,
                                       caller=TRAINING_ARGUMENTS)
        if self.push_to_hub:
            _check_hub_reachable()
        if (self.bf16 or self.bf16_full_eval) and not self.use_cpu and not torch.cuda.is_available():
            # the CPU is the device anyway; transformers would ask for use_cpu=True to allow bf16
            self.use_cpu = True
        # transformers would turn `deepspeed` into Accelerate's DeepSpeedPlugin; it is read after
        # the rest, below.
        deepspeed = self._backend.deepspeed if self._backend.deepspeed is not None else self.deepspeed
        self.deepspeed = None
        super().__post_init__()
        self.deepspeed_plugin = self._deepspeed_plugin(deepspeed) if deepspeed else None
        if deepspeed and not isinstance(deepspeed, (str, os.PathLike, dict)):
            # a plugin object is kept as its (serializable) config
            deepspeed = self.hf_deepspeed_config.config
        # a config or a path by now; transformers types the field dict | str | None
        self.deepspeed = deepspeed  # type: ignore[assignment]
        if not (self.fp16 or self.bf16) and "ACCELERATE_MIXED_PRECISION" not in os.environ:
            self.mixed_precision = env.resolve("mixed_precision")

    @property
    def backend(self) -> Backend:
        """The backend these arguments decided (once, in __post_init__: theirs over the launcher's) with its options
        read; the Trainer's Accelerator takes it as it is."""
        return dataclasses.replace(self._backend, fsdp=self.fsdp_options, deepspeed=self.deepspeed_plugin)

    @property
    def should_save(self) -> bool:
        """transformers' answer, and, in replica groups, only in group 0 (trainer/replica_groups.py)."""
        return super().should_save and writes_for_the_run(self)

    @cached_property
    def _setup_devices(self) -> torch.device:
        config = self.accelerator_config
        configured = (config.get("use_configured_state", False) if isinstance(config, dict)
                      else getattr(config, "use_configured_state", False))
        if configured and not process_state_is_set_up():
            # transformers' phrase is kept, so code matching on it still works
            raise ConfigError(
                "accelerator_config use_configured_state=True: Passing "
                "`'use_configured_state':True` to the AcceleratorConfig requires a pre-configured "
                "`AcceleratorState` or `PartialState` to be defined before calling "
                "`TrainingArguments`; create an hf_backend Accelerator or PartialState first, or "
                "drop use_configured_state")
        cpu = env.resolve("cpu", True if self.use_cpu else None)
        timeout = datetime.timedelta(seconds=self.ddp_timeout) if self.ddp_timeout else None
        # Read by transformers through the attribute names of Accelerate's PartialState, which
        # ProcessState shares.
        self.distributed_state = get_process_state(cpu=cpu, timeout=timeout, backend=self.ddp_backend)
        # loaded since the state was set up, by TRL say
        accelerate_state.tell_process(self.distributed_state)
        # never torch's DataParallel
        self._n_gpu = 1 if self.distributed_state.device.type == "cuda" else 0
        return self.distributed_state.device

    @property
    def fsdp_plugin(self) -> FsdpOptions | None:
        """The FSDP options under Accelerate's name (`accelerator.state.fsdp_plugin` shows them)."""
        return self.fsdp_options

    def _process_fsdp_args(self) -> None:
        """Called by transformers' __post_init__: the options (the launcher's, or these arguments'
        read now, once), which the Trainer hands to the Accelerator, shown as `fsdp_plugin` and, as
        a plain dict, `fsdp_config`; transformers' own plugin arguments stay None (its Accelerate
        path is unused)."""
        options = self._backend.fsdp or fsdp_options_from_arguments(self.fsdp, self.fsdp_config)
        self.fsdp_options = options
        if options is None:
            return None
        self.fsdp_config = options.to_dict()
        # transformers' Trainer refuses FSDP in one process; the engine trains unsharded there, with
        # a note.
        self.fsdp = self.world_size > 1
        return None

    def _deepspeed_plugin(self, deepspeed: Any) -> DeepSpeedPlugin:
        if importlib.util.find_spec("accelerate") is None:
            raise ConfigError(_DEEPSPEED_NEEDS_ACCELERATE)
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        from ..strategies.deepspeed import attach_deepspeed_comm

        # before a ZeRO-3 from_pretrained, which builds the model partitioned
        attach_deepspeed_comm()

        # transformers fills the config's "auto" values from these arguments, and later from the
        # model.
        self.hf_deepspeed_config = HfTrainerDeepSpeedConfig(deepspeed_config_from_argument(deepspeed))
        self.hf_deepspeed_config.trainer_config_process(self)
        is_config = isinstance(deepspeed, (str, os.PathLike, dict))
        # keeps zero3_init_flag
        plugin = DeepSpeedPlugin() if is_config else DeepSpeedPlugin.from_object(deepspeed)
        return dataclasses.replace(plugin, hf_ds_config=self.hf_deepspeed_config)


_DEEPSPEED_NEEDS_ACCELERATE = (
    "TrainingArguments(deepspeed=...): transformers' DeepSpeed integration "
    "(HfTrainerDeepSpeedConfig) imports the accelerate package, which is not installed; pip "
    "install 'hf-backend[deepspeed]' (it brings accelerate)")


class CallableAcceleratorConfigError(ConfigError, NotImplementedError):
    """`accelerator_config` given as a class or other callable: NotImplementedError, as transformers
    raises it (its tests assert the type and the message's start)."""


def _accelerator_config(value: Any) -> AcceleratorConfig:
    """transformers' reading of `accelerator_config` (None, a dict, a JSON file's path, the object),
    which it does only when the accelerate package is installed: the engine needs its values either
    way."""
    if isinstance(value, AcceleratorConfig):
        return value
    if callable(value):
        raise CallableAcceleratorConfigError(
            f"Tried passing in a callable to `accelerator_config` ({getattr(value, '__name__', value)!r}), but "
            "this is not supported. Please pass in a fully constructed `AcceleratorConfig` object instead.")
    if value is None or isinstance(value, dict):
        return AcceleratorConfig(**(value or {}))
    if isinstance(value, (str, os.PathLike)):
        return AcceleratorConfig.from_json_file(value)
    raise ConfigError(f"TrainingArguments.accelerator_config: {value!r} is neither a dict, a JSON "
                      "file's path nor an AcceleratorConfig(); pass one of those")


def _check_hub_reachable() -> None:
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    fix = "set push_to_hub=False (save_model() writes the model locally; push it later)"
    if constants.HF_HUB_OFFLINE:
        raise HfBackendError(f"push_to_hub=True but HF_HUB_OFFLINE is set; {fix}")
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
    except OSError as err:
        raise HfBackendError(f"push_to_hub=True but the Hub at {endpoint} is not reachable from "
                             f"this machine ({err.__class__.__name__}: {err}); {fix}") from None
