"""Small option objects that `Accelerator(...)` accepts; names and fields match Accelerate's so scripts
port as is."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from ..core import checks
from ..core.enums import DDPCommunicationHookType
from ..core.errors import HfBackendError


@dataclass
class ProjectConfiguration:
    """Where `save_state` writes, and how automatic checkpoint names rotate.

    With `automatic_checkpoint_naming`, checkpoints go to
    `project_dir/checkpoints/checkpoint_{iteration}` and only the newest `total_limit` are kept.
    `async_save`: `save_state` returns once the state is copied to host memory and writes it in the
    background (the default of its `async_save` argument).
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    async_save: bool = False

    def __post_init__(self) -> None:
        self.project_dir = checks.path(self.project_dir, "ProjectConfiguration.project_dir")
        self.logging_dir = checks.path(self.logging_dir, "ProjectConfiguration.logging_dir")
        checks.flag(self.automatic_checkpoint_naming, "ProjectConfiguration.automatic_checkpoint_naming")
        checks.flag(self.save_on_each_node, "ProjectConfiguration.save_on_each_node")
        checks.flag(self.async_save, "ProjectConfiguration.async_save")
        checks.whole(self.total_limit, "ProjectConfiguration.total_limit", minimum=1, optional=True,
                     fix="; None keeps every checkpoint")
        checks.whole(self.iteration, "ProjectConfiguration.iteration")

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders are sharded.

    split_batches: the loader's batch is the global batch and is split across processes (its size
    must divide by the
        number of processes); otherwise each process gets whole batches and the global batch is N times larger.
    even_batches: pad the last global batch with samples from the start of the epoch so that every
    process gets the
        same number of equally sized batches (`gather_for_metrics` drops the padding again).
    data_seed: the seed epoch orders of shuffling loaders derive from (epoch e: data_seed + e); by
    default the
        process's torch seed (rank 0's).

    dispatch_batches / use_seedable_sampler: accepted for Accelerate scripts; every process reads
    its own shard (no
        dispatching from rank 0) and the order is always seedable, so neither changes anything here.
    use_stateful_dataloader: accepted; every prepared loader already has `state_dict()` /
    `load_state_dict()` and
        resumes mid-epoch (with `num_workers > 0` too).
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = True
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        for name in ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking",
                     "use_stateful_dataloader", "dispatch_batches"):
            checks.flag(getattr(self, name), f"DataLoaderConfiguration.{name}", optional=name == "dispatch_batches")
        checks.whole(self.data_seed, "DataLoaderConfiguration.data_seed", maximum=2**64 - 1, optional=True)


@dataclass
class GradientAccumulationPlugin:
    num_steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class KwargsHandler:
    """Base of the option objects `kwargs_handlers=[...]` takes."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the default: only those are passed on."""
        default = self.__class__()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """DDP's constructor arguments, plus a gradient communication hook (`comm_hook`: fp16 / bf16
    compression or PowerSGD; `comm_wrapper`: fp16 / bf16 compression around PowerSGD;
    `comm_state_option`: PowerSGD's options). `find_unused_parameters=None` (hf_backend's,
    hf_backend.Trainer's default): find them once, on the first synchronized step, and search again
    on every step only if that one left some parameter without a gradient."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool | None = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def ddp_kwargs(self) -> dict[str, Any]:
        """What `DistributedDataParallel(...)` takes (the hook fields are registered after wrapping).
        """
        return {k: v for k, v in self.to_kwargs().items() if not k.startswith("comm_")}


@dataclass
class GradScalerKwargs(KwargsHandler):
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    backend: str | None = None
    init_method: str | None = None
    timeout: datetime.timedelta | None = None

    def __post_init__(self) -> None:
        if self.init_method not in (None, "env://"):
            raise HfBackendError(f"InitProcessGroupKwargs(init_method={self.init_method!r}): "
                                 "hf_backend joins the process group from the launcher's "
                                 "environment (env://); remove init_method and set MASTER_ADDR / "
                                 "MASTER_PORT (hf-backend launch and torchrun do)")


@dataclass
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class ProfileKwargs(KwargsHandler):
    """`accelerator.profile()`'s torch.profiler options. `activities`: names ("cpu", "cuda");
    `schedule_option`: the keys of `torch.profiler.schedule` (wait, warmup, active, repeat,
    skip_first); `output_trace_dir`: each process writes its Chrome trace there."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """`torch.compile` of every prepared model, after the strategy wrapped it (Accelerate's fields and
    defaults).
    `backend`: a `DynamoBackend` or its name ("inductor", "eager", "aot_eager", ...; "no": off)."""

    backend: Any = "no"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] | None = None
    disable: bool = False
    use_regional_compilation: bool = False

    @property
    def backend_name(self) -> str:
        return str(getattr(self.backend, "value", self.backend)).lower()

    @property
    def enabled(self) -> bool:
        return self.backend_name != "no" and not self.disable

    def compile_kwargs(self) -> dict[str, Any]:
        """torch.compile's keyword arguments."""
        kwargs = {"backend": self.backend_name, "mode": self.mode,
                  "fullgraph": self.fullgraph, "dynamic": self.dynamic, "options": self.options}
        return {k: v for k, v in kwargs.items() if v is not None}


KWARGS_HANDLERS = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs,
                   ProfileKwargs)


@dataclass
class Handlers:
    """The kwargs handlers a user passed, at most one of each kind."""

    ddp: DistributedDataParallelKwargs = field(default_factory=DistributedDataParallelKwargs)
    scaler: GradScalerKwargs = field(default_factory=GradScalerKwargs)
    init: InitProcessGroupKwargs = field(default_factory=InitProcessGroupKwargs)
    autocast: AutocastKwargs = field(default_factory=AutocastKwargs)
    profile: ProfileKwargs = field(default_factory=ProfileKwargs)

    @classmethod
    def of(cls, given: Any, passed_through: type) -> tuple[Handlers, list[Any]]:
        """`Accelerator(kwargs_handlers=...)`: each handler in its slot, and apart, in order, those
        that are a `passed_through` (the process-group plugins: a HangWatch)."""
        if given is not None and not isinstance(given, (list, tuple)):
            raise HfBackendError(_NOT_A_LIST.format(shown=checks.show(given)))
        handlers, passed = cls(), []
        for handler in given or []:
            if isinstance(handler, passed_through):
                passed.append(handler)
            elif type(handler) in _SLOTS:
                setattr(handlers, _SLOTS[type(handler)], handler)
            else:
                names = ", ".join(c.__name__ for c in KWARGS_HANDLERS)
                raise HfBackendError(_UNSUPPORTED.format(name=type(handler).__name__, names=names))
        return handlers, passed


_SLOTS = dict(zip(KWARGS_HANDLERS, ("ddp", "scaler", "init", "autocast", "profile"), strict=True))
_NOT_A_LIST = "kwargs_handlers={shown} must be a list of handlers, e.g. [DistributedDataParallelKwargs(...)]"
_UNSUPPORTED = "kwargs_handlers: {name} is not supported; use one of {names}, or HangWatch"
