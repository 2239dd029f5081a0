"""The connector (Lightning Fabric's): an Accelerator's arguments and the launcher's environment turned into the
engine's parts, once. Each part is decided here only: the process state, precision, gradient accumulation, the data
and project options, the backend and the strategy (with its mesh), and the step hooks (fault tolerance's replica
groups, or none). The Trainer's arguments reach the same decisions through the same call (trainer/trainer.py builds
an Accelerator)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .. import fault_tolerance
from ..config import environment as env
from ..config.backend import Backend, choose_backend
from ..config.options import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    Handlers,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from ..core import checks
from ..core.enums import DistributedType
from ..core.errors import HfBackendError
from ..parallel.config import requested_shape
from ..parallel.dims import MeshShape
from ..runtime.process import ProcessGroupPlugin, ProcessState, add_process_group_plugin, get_process_state
from ..strategies import select_strategy
from ..strategies.base import Strategy
from ..training.gradient_state import GradientState
from ..training.precision import Precision
from ..training.prepared import PreparedObjects
from ..training.step_hooks import StepHooks
from . import compat, elastic, rank0_loading

if TYPE_CHECKING:
    from .tracking import Tracking


@dataclasses.dataclass
class Engine:
    """What one Accelerator is made of (its attributes of the same names)."""

    process: ProcessState
    handlers: Handlers
    precision: Precision
    gradient_state: GradientState
    dataloader_config: DataLoaderConfiguration
    project_configuration: ProjectConfiguration
    tracking: Tracking
    launch_config: Any  # what `hf-backend launch` handed over, or None
    strategy: Strategy
    dynamo_plugin: TorchDynamoPlugin
    device_placement: bool
    step_scheduler_with_optimizer: bool
    _parallelism_shape: MeshShape | None
    _objects: PreparedObjects
    _hooks: StepHooks  # fault tolerance's replica groups, or the default (nothing)

    @property
    def replica_groups(self) -> fault_tolerance.ReplicaGroups | None:
        return self._hooks if isinstance(self._hooks, fault_tolerance.ReplicaGroups) else None


def connect(arguments: dict[str, Any], other: dict[str, Any]) -> Engine:
    """`arguments`: the Accelerator's named arguments; `other`: the rest (Accelerate's extras, hf_backend's
    `fault_tolerance`, and `backend`, the one TrainingArguments decided), each read here or refused in one line
    (compat.py)."""
    dynamo = compat.dynamo_plugin(other.pop("dynamo_backend", None), other.pop("dynamo_plugin", None))
    replicas = fault_tolerance.resolve(other.pop("fault_tolerance", None))
    decided = other.pop("backend", None)  # the Trainer's: its TrainingArguments decided it
    deepspeed_plugin = compat.check_accelerator_arguments(other, arguments["deepspeed_plugin"])
    loader_options = {k: other.pop(k) for k in ("dispatch_batches", "use_seedable_sampler") if k in other}
    for name in ("cpu", "split_batches", "even_batches"):
        checks.flag(arguments[name], name, optional=True)  # None: the launcher's or the default
    checks.flag(arguments["device_placement"], "device_placement")
    checks.flag(arguments["step_scheduler_with_optimizer"], "step_scheduler_with_optimizer")
    handlers, plugins = Handlers.of(arguments["kwargs_handlers"], passed_through=ProcessGroupPlugin)
    for plugin in plugins:  # hf_backend.launch.hang_watch.HangWatch
        add_process_group_plugin(plugin)

    process = get_process_state(cpu=env.resolve("cpu", arguments["cpu"]), timeout=handlers.init.timeout,
                                backend=handlers.init.backend)
    mixed_precision = getattr(arguments["mixed_precision"], "value", arguments["mixed_precision"])  # the enum's
    precision = Precision(str(env.resolve("mixed_precision", mixed_precision)), process.device, handlers.scaler,
                          handlers.autocast)
    gradient_state = GradientState(_accumulation(arguments["gradient_accumulation_plugin"],
                                                 arguments["gradient_accumulation_steps"]))
    overrides = {k: v for k, v in (("split_batches", arguments["split_batches"]),
                                   ("even_batches", arguments["even_batches"]), *loader_options.items())
                 if v is not None}
    loader_config = dataclasses.replace(
        compat.checked(arguments["dataloader_config"], DataLoaderConfiguration, "dataloader_config"), **overrides)
    project = compat.checked(arguments["project_config"], ProjectConfiguration, "project_config")
    if arguments["project_dir"] is not None:
        project.set_directories(str(arguments["project_dir"]))

    from .tracking import Tracking  # trackers' packages load only when asked for

    launch_config = env.read_launch_config()
    backend = decided_backend(decided, arguments["fsdp_plugin"], deepspeed_plugin, launch_config)
    shape = requested_shape(arguments["parallelism_config"], process.num_processes)
    strategy = select_strategy(process, precision, handlers, backend, gradient_state, loader_config.split_batches,
                               shape)
    if strategy.receives_rank0_weights:  # from_pretrained may load on rank 0 only
        rank0_loading.tell_transformers()
    objects = PreparedObjects()
    hooks = _step_hooks(replicas, process, objects, gradient_state, strategy)
    return Engine(process, handlers, precision, gradient_state, loader_config, project,
                  Tracking(arguments["log_with"], project.logging_dir, process.is_main_process), launch_config,
                  strategy, dynamo, arguments["device_placement"], arguments["step_scheduler_with_optimizer"], shape,
                  objects, hooks)


def _step_hooks(replicas: fault_tolerance.FaultTolerance | None, process: ProcessState, objects: PreparedObjects,
                gradient_state: GradientState, strategy: Strategy) -> StepHooks:
    """Nothing follows the steps, or this process's replica groups: meeting every step (gradients averaged), or
    every `sync_every` steps (LocalSGD / DiLoCo between the groups)."""
    if replicas is None:
        return StepHooks()
    if strategy.distributed_type == DistributedType.DEEPSPEED:
        raise HfBackendError("fault_tolerance with DeepSpeed: its engine reduces the gradients itself; use "
                             "FSDP (fsdp_plugin or parallelism_config) or DDP inside each replica group")
    mode = fault_tolerance.EveryStep if replicas.sync_every == 1 else fault_tolerance.Periodic
    return mode(replicas, process, objects, gradient_state, strategy.data_shard, not elastic.restart_count())


def decided_backend(decided: Backend | None, fsdp: Any, deepspeed: Any, launch_config: Any) -> Backend:
    """The backend the caller decided (the Trainer: its TrainingArguments did, once, with the launcher's choice), or
    the one the plugins and the launcher's environment make."""
    if decided is None:
        return choose_backend(fsdp, deepspeed, launch_config)
    if not isinstance(decided, Backend):
        raise HfBackendError(f"Accelerator(backend={decided!r}): pass the Backend TrainingArguments decided "
                             "(args.backend), or leave it out and pass fsdp_plugin / deepspeed_plugin")
    if fsdp is not None or deepspeed is not None:
        raise HfBackendError("Accelerator(backend=...) is the decided backend with its options; pass it or "
                             "fsdp_plugin / deepspeed_plugin, not both")
    return decided


def _accumulation(plugin: GradientAccumulationPlugin | None, steps: int | None) -> GradientAccumulationPlugin:
    if plugin is not None and steps not in (None, 1):
        raise HfBackendError("pass gradient_accumulation_steps or gradient_accumulation_plugin, not both")
    if plugin is None:
        plugin = GradientAccumulationPlugin(num_steps=env.resolve("gradient_accumulation_steps", steps))
    checks.whole(plugin.num_steps, "gradient_accumulation_steps", minimum=1)
    return plugin
