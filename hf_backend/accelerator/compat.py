"""The parts of Accelerate's `Accelerator` API that have nothing to run here, in one place.

Three kinds (docs/compat.md lists every public name with its kind):
- arguments and members that are constants here (no tensor/context/pipeline parallelism, no fp8, no
  LOMO): they answer as Accelerate answers when the feature is off;
- arguments accepted as no-ops, with one note in the log saying why;
- features refused with one line naming them and what to use instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch

from ..config import environment as env
from ..config.options import DataLoaderConfiguration, Handlers, TorchDynamoPlugin
from ..core.enums import DistributedType, FP8BackendType
from ..core.errors import HfBackendError
from ..core.notes import note
from ..parallel.config import ParallelismConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..parallel.dims import MeshShape
    from ..runtime.process import ProcessState
    from ..strategies.base import Strategy
    from ..training.trigger import Trigger
    from .states import AcceleratorState
    from .tracking import Tracking

# Accelerator(...) arguments with nothing to do here, and why.
_NOOP_ARGUMENTS = {
    "rng_types": "each process's RNG is restored by load_state and the epoch order comes from the sampler's seeded "
                 "generator, shared from rank 0",
}
# Accelerator(...) arguments that ask for a feature hf_backend does not run, and what to do instead.
_REFUSED_ARGUMENTS = {
    "megatron_lm_plugin": "Megatron-LM is not supported; use FSDP or DeepSpeed ZeRO-3 for models that do not fit",
    "torch_tp_plugin": "Accelerate deprecated it; pass parallelism_config=ParallelismConfig(tp_size=...)",
}


def check_accelerator_arguments(other: dict[str, Any], deepspeed_plugin: Any) -> Any:
    """Consume the Accelerate-only keyword arguments in `other` (notes for no-ops, one-line errors for
    refused features); returns the DeepSpeed plugin in effect (Accelerate's `deepspeed_plugins` dict
    with one entry is that plugin). Leaves the DataLoaderConfiguration fields Accelerate also takes
    here in `other`."""
    for key, why in _NOOP_ARGUMENTS.items():
        if other.pop(key, None) is not None:
            note(f"Accelerator({key}=...) is accepted and has nothing to do: {why}")
    for key, instead in _REFUSED_ARGUMENTS.items():
        value = other.pop(key, None)
        if value is not None and str(getattr(value, "value", value)).lower() != "no":
            raise HfBackendError(f"Accelerator({key}=...): {instead}")
    plugins = other.pop("deepspeed_plugins", None)
    if plugins is not None:
        plugins = list(plugins.values()) if isinstance(plugins, dict) else [plugins]
        if len(plugins) != 1 or deepspeed_plugin is not None:
            raise HfBackendError("Accelerator(deepspeed_plugins=...): hf_backend "
                                 "runs one DeepSpeed plugin per Accelerator; "
                                 "pass deepspeed_plugin=<the one to use>")
        deepspeed_plugin = plugins[0]
    unknown = sorted(set(other) - {"dispatch_batches", "use_seedable_sampler"})
    if unknown:
        raise HfBackendError(f"Accelerator() does not support {', '.join(unknown)} "
                             "in hf_backend; remove the argument (docs/compat.md "
                             "lists every Accelerate argument and member)")
    return deepspeed_plugin


def config_mesh(shape: MeshShape | None, strategy: Strategy, device_type: str) -> DeviceMesh | None:
    """The mesh Accelerate builds for a ParallelismConfig whose grid the engine runs without one
    (replicas only: DDP), so `accelerator.torch_device_mesh["dp_cp"]` works as there; None
    otherwise. Built on every rank now."""
    if shape is None or strategy.mesh is not None or shape.world == 1 or shape.deepspeed_ulysses:
        return None  # (DeepSpeed's ALST makes its own groups, and Accelerate no mesh)
    from ..parallel.dims import build_mesh

    return build_mesh(shape, device_type)


def dynamo_plugin(backend: Any, plugin: Any) -> TorchDynamoPlugin:
    """Accelerate's `dynamo_backend` (a name) or `dynamo_plugin` (a TorchDynamoPlugin or a dict of its
    fields)."""
    if backend is not None and plugin is not None:
        raise HfBackendError("pass dynamo_backend or dynamo_plugin, not both")
    if plugin is None:  # else the launcher's dynamo_backend (a launch config's), else off
        return TorchDynamoPlugin(backend=env.resolve("dynamo_backend", backend))
    return checked(plugin, TorchDynamoPlugin, "dynamo_plugin")


def checked(value: Any, cls: type, argument: str) -> Any:
    """An options object given as itself, a dict of its fields, or None (the defaults)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise HfBackendError(f"{argument}: {cls.__name__} has no field {', '.join(unknown)}; "
                                 f"fields: {', '.join(sorted(names))}")
        return cls(**value)
    hint = " (for a directory, pass project_dir=...)" if argument == "project_config" else ""
    raise HfBackendError(f"{argument}= takes a {cls.__name__}, got {type(value).__name__}{hint}")


def _not_configured(what: str) -> HfBackendError:
    return HfBackendError(f"{what}: no parallelism_config is set (and hf_backend does not run "
                          "pipeline parallelism); use accelerator.process_index for the "
                          "data-parallel rank")


class AccelerateMembers:
    """Accelerator members for features that are off here (answering as Accelerate does when they are
    off), and Accelerate's names for state the facade keeps under its own."""

    has_lomo_optimizer = False
    fp8_enabled = False
    has_fp8_handler = False
    delayed_fp8_autocast = False
    fp8_recipe_handler = None
    ao_recipe_handler = None
    te_recipe_handler = None
    msamp_recipe_handler = None
    fp8_backend = FP8BackendType.NO

    rng_types = None

    # What the Accelerator this is mixed into holds, which the members below answer from (declared,
    # not set here).
    handlers: Handlers
    process: ProcessState
    strategy: Strategy
    trigger: Trigger
    tracking: Tracking
    dataloader_config: DataLoaderConfiguration
    _parallelism_shape: MeshShape | None
    _config_mesh: DeviceMesh | None
    if TYPE_CHECKING:  # the facade's read-only properties
        @property
        def state(self) -> AcceleratorState: ...
        @property
        def distributed_type(self) -> DistributedType: ...
        @property
        def is_local_main_process(self) -> bool: ...
        @property
        def mixed_precision(self) -> str: ...

    # -- forwarded to the pieces that own them: experiment tracking, the trigger -------------------
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        self.tracking.init_trackers(project_name, config, init_kwargs)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        self.tracking.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        return self.tracking.get_tracker(name, unwrap)

    @property
    def trackers(self) -> list:
        return self.tracking.trackers

    def set_trigger(self) -> None:
        """Raise this process's flag; the next `check_trigger()` is True on every process."""
        self.trigger.set()

    def check_trigger(self) -> bool:
        """True on every process when any process called `set_trigger()` since the last check
        (collective)."""
        return self.trigger.check()

    def profile(self, profile_handler: Any = None) -> contextlib.AbstractContextManager:
        """A torch.profiler context (ProfileKwargs); each process writes its own Chrome trace when
        asked."""
        from ..runtime.profiling import profile

        return profile(profile_handler or self.handlers.profile, self.process.process_index)

    @property
    def ddp_handler(self) -> Any:
        return self.handlers.ddp

    @property
    def scaler_handler(self) -> Any:
        return self.handlers.scaler

    @property
    def init_handler(self) -> Any:
        return self.handlers.init

    @property
    def autocast_handler(self) -> Any:
        return self.handlers.autocast

    @property
    def profile_handler(self) -> Any:
        return self.handlers.profile

    @property
    def flag_tensor(self) -> torch.Tensor:
        return self.trigger.flag

    @property
    def log_with(self) -> list:
        return self.tracking.log_with

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def fsdp_plugin(self) -> Any:
        return self.state.fsdp_plugin

    @property
    def deepspeed_plugin(self) -> Any:
        return self.state.deepspeed_plugin

    @property
    def is_fsdp2(self) -> bool:
        return self.state.is_fsdp2

    @property
    def multi_device(self) -> bool:
        return self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

    @property
    def should_save_model(self) -> bool:
        return self.is_local_main_process

    @property
    def native_amp(self) -> bool:
        return self.mixed_precision in ("fp16", "bf16")

    @functools.cached_property
    def parallelism_config(self) -> Any:
        """The process grid as Accelerate's ParallelismConfig shows it, made once: the mesh strategy's
        shape, or the grid a config asked for (all sizes 1 in N processes: N replicas, as Accelerate
        sets it); None when neither exists (DDP, DeepSpeed, one process without a config).
        transformers' Trainer reads its tp / cp / sp sizes at every step."""
        shape = self.strategy.shape or self._parallelism_shape
        return ParallelismConfig.of_shape(shape) if shape is not None else None

    @property
    def torch_device_mesh(self) -> Any:
        """The run's DeviceMesh, with Accelerate's dimension names (hf_backend/parallel/dims.py)."""
        return self.strategy.mesh if self.strategy.mesh is not None else self._config_mesh

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.strategy.mesh is not None

    def _mesh_rank(self, what: str, dim: str) -> int:
        if self.strategy.mesh is None:
            raise _not_configured(what)
        return self.strategy.mesh.get_local_rank(dim)

    @property
    def tensor_parallel_rank(self) -> int:
        return self._mesh_rank("tensor_parallel_rank", "tp")

    @property
    def pipeline_parallel_rank(self) -> int:
        raise _not_configured("pipeline_parallel_rank")

    @property
    def context_parallel_rank(self) -> int:
        return self._mesh_rank("context_parallel_rank", "cp")

    @property
    def data_parallel_rank(self) -> int:
        if self.strategy.mesh is None:
            raise _not_configured("data_parallel_rank")
        return self.strategy.data_shard.index

    @property
    def data_parallel_shard_rank(self) -> int:
        return self._mesh_rank("data_parallel_shard_rank", "dp_shard")

    def maybe_context_parallel(self, buffers: Any = None, buffer_seq_dims: Any = None,
                               no_restore_buffers: Any = None) -> contextlib.AbstractContextManager:
        """With context or sequence parallelism (cp_size or sp_size > 1), each rank keeps its slice
        of the buffers' sequences inside the block, and the buffers not in `no_restore_buffers` are
        whole again after it; otherwise nothing happens."""
        return self.strategy.context_parallel(list(buffers or []), list(buffer_seq_dims or []),
                                              list(no_restore_buffers or []))

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """True when the model was loaded with a device map over several devices (big-model inference),
        which training cannot prepare."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        raise HfBackendError("lomo_backward: LOMO optimizers are not supported by hf_backend; use "
                             "a torch optimizer and accelerator.backward(loss)")

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any = None) -> Any:
        """Under DeepSpeed's ALST, `dl` through DeepSpeed's adapter (this rank's slice of each of its
        group's batches in turn); without sequence parallelism `dl` as it is, as in Accelerate. Under
        hf_backend's own sp the loader stays as it is: one line says so."""
        from ..strategies.capabilities import SequenceLoader

        if isinstance(self.strategy, SequenceLoader):
            return self.strategy.sequence_loader(dl)
        if self.parallelism_config is None or self.parallelism_config.sp_size == 1:
            return dl
        raise HfBackendError("deepspeed_ulysses_dl_adapter: DeepSpeed's ALST loader is not used by "
                             "hf_backend's sequence parallelism; keep the loader as it is and call the model "
                             "inside accelerator.maybe_context_parallel(...) (docs/parallelism.md)")
