"""How many processes each parallelism spans: `ParallelismConfig` (Accelerate's class: its field names
and its PARALLELISM_CONFIG_* variables), read into the one resolved `MeshShape` (parallel/dims.py).

A config enters as Accelerate's object, ours or a dict, and is checked once against the world size
(`config.shape(world)`); from there on only the shape is asked. FSDP's sharding strategies are shapes too
(`MeshShape.for_fsdp`): FULL_SHARD shards over every process, HYBRID_SHARD replicates across
machines, NO_SHARD replicates everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from ..config import environment as env
from ..config.schema import PP_SCHEDULES
from ..core.checks import show, whole
from ..core.errors import ConfigError
from ..core.notes import note
from .dims import MeshShape, build_mesh

ENV_PREFIX = "PARALLELISM_CONFIG_"
_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
# hf_backend's, not Accelerate's: the experts split within the data-parallel ranks, no processes of its own
_EP = "ep_size"
# hf_backend's too (Accelerate 1.15 has no pp): pipeline stages, the outermost dimension (strategies/pipeline.py)
_PP = "pp_size"


@dataclasses.dataclass
class TorchTensorParallelConfig:
    """Accelerate's handler for `ParallelismConfig(tp_handler=...)`. Async tensor parallelism (a CUDA
    symmetric-memory overlap) is not applied, as in Accelerate, which warns the same."""

    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            note("TorchTensorParallelConfig(enable_async_tp=True): "
                 "async tensor parallelism is not applied")


@dataclasses.dataclass
class TorchContextParallelConfig:
    """Accelerate's handler for `ParallelismConfig(cp_handler=...)`. hf_backend's context parallelism
    passes the keys and values around a ring whichever is named (strategies/context_parallel.py):
    no rank holds the whole sequence's."""

    cp_comm_strategy: str = "allgather"

    def __post_init__(self) -> None:
        if self.cp_comm_strategy not in ("allgather", "alltoall"):
            raise ConfigError("TorchContextParallelConfig "
                              f"cp_comm_strategy={show(self.cp_comm_strategy)}: "
                              "use 'allgather' or 'alltoall'")


@dataclasses.dataclass
class DeepSpeedSequenceParallelConfig:
    """Accelerate's handler for `ParallelismConfig(sp_handler=...)`: hints for DeepSpeed's ALST. hf_backend's
    Ulysses needs none of them (any sequence length that divides by sp_size; attention by SDPA), and DeepSpeed's
    ALST is given the model's own attention and variable lengths (strategies/deepspeed_ulysses.py), so they are
    accepted and not read; an attention other than SDPA is noted."""

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None

    def __post_init__(self) -> None:
        if self.sp_attn_implementation not in (None, "sdpa"):
            note(f"DeepSpeedSequenceParallelConfig(sp_attn_implementation={self.sp_attn_implementation!r}): "
                 "hf_backend's Ulysses attends with SDPA")


# `sp_backend`: Accelerate's one value ("deepspeed", its default: DeepSpeed's ALST when DeepSpeed is the
# strategy, hf_backend's own Ulysses on the mesh path) and hf_backend's (strategies/__init__.py)
SP_BACKENDS = ("deepspeed", "hf_backend")


@dataclasses.dataclass
class ParallelismConfig:
    """Accelerate's `ParallelismConfig`: sizes left unset come from PARALLELISM_CONFIG_<NAME> (what
    `hf-backend launch --parallelism_config_tp_size 2` and `accelerate launch` set), else 1.
    Sequence parallelism (`sp_size`) is hf_backend's Ulysses on the mesh
    (strategies/ulysses.py); `tp_handler` / `cp_handler` take the handlers above, `sp_handler`
    (DeepSpeed's sequence-length hints) is not needed and not read. `ep_size` (hf_backend's, as in
    transformers' DistributedConfig) splits a mixture-of-experts model's experts over that many of
    the ranks that hold different tokens (dp_shard x cp x sp; strategies/experts.py): it adds no
    processes. `pp_size` (hf_backend's too) cuts the model into that many pipeline stages, the
    outermost dimension, trained by `pp_schedule` (one of torch.distributed.pipelining's, "1F1B" by
    default) over `pp_microbatches` microbatches per batch (default: one per stage)."""

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None
    ep_size: int | None = None
    pp_size: int | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None

    def __post_init__(self) -> None:
        for name in (*_SIZES, _EP, _PP):
            value = getattr(self, name)
            if value is None:
                variable = ENV_PREFIX + name[:-len("_size")].upper() + "_SIZE"
                raw = os.environ.get(variable, "") or "1"
                try:
                    value = int(raw)
                except ValueError:
                    raise ConfigError(f"environment variable {variable}={raw!r} "
                                      "must be an integer >= 1") from None
            setattr(self, name, whole(value, f"ParallelismConfig {name}", minimum=1))
        self.cp_backend = self.cp_backend or os.environ.get(ENV_PREFIX + "CP_BACKEND") or "torch"
        self.sp_backend = self.sp_backend or os.environ.get(ENV_PREFIX + "SP_BACKEND") or "deepspeed"
        if self.cp_backend != "torch":
            raise ConfigError(f"ParallelismConfig cp_backend={show(self.cp_backend)}: the one "
                              "backend is 'torch'")
        if self.sp_backend not in SP_BACKENDS:
            raise ConfigError(f"ParallelismConfig sp_backend={show(self.sp_backend)}: use "
                              "'deepspeed' or 'hf_backend' (both run hf_backend's Ulysses)")
        assert self.sp_size is not None and self.cp_size is not None and self.ep_size is not None  # set above
        if self.sp_size > 1 and self.cp_size > 1:
            raise ConfigError(f"ParallelismConfig cp_size={self.cp_size} with sp_size={self.sp_size}: "
                              "a sequence is split by one of them; set cp_size=1 or sp_size=1")
        if self.ep_size > 1:
            self._check_experts()
        self._read_pipeline()

    def _read_pipeline(self) -> None:
        self.pp_schedule = self.pp_schedule or os.environ.get(ENV_PREFIX + "PP_SCHEDULE") or "1F1B"
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"ParallelismConfig pp_schedule={show(self.pp_schedule)}: use one of "
                              f"{', '.join(PP_SCHEDULES)}")
        if self.pp_microbatches is None and os.environ.get(ENV_PREFIX + "PP_MICROBATCHES"):
            raw = os.environ[ENV_PREFIX + "PP_MICROBATCHES"]
            if not raw.isdigit():
                raise ConfigError(f"environment variable {ENV_PREFIX}PP_MICROBATCHES={raw!r} must be an integer >= 0 "
                                  "(0: one per stage)")
            self.pp_microbatches = int(raw) or None  # the launcher's 0: the default
        if self.pp_microbatches is not None:
            self.pp_microbatches = whole(self.pp_microbatches, "ParallelismConfig pp_microbatches", minimum=1)
        assert self.pp_size is not None and self.ep_size is not None  # set by __post_init__
        if self.pp_size > 1 and self.ep_size > 1:
            raise ConfigError(f"ParallelismConfig pp_size={self.pp_size} with ep_size={self.ep_size}: pipeline "
                              "stages compose with dp_replicate_size, dp_shard_size, tp_size, cp_size and sp_size so "
                              "far; set ep_size=1")

    def _check_experts(self) -> None:
        assert self.dp_shard_size is not None and self.cp_size is not None and self.sp_size is not None
        assert self.tp_size is not None and self.ep_size is not None  # every size is set by __post_init__
        tokens = self.dp_shard_size * self.cp_size * self.sp_size  # the ranks of a replica holding different tokens
        if self.tp_size > 1:
            raise ConfigError(f"ParallelismConfig ep_size={self.ep_size} with tp_size={self.tp_size}: "
                              "experts are not tensor-parallel in hf_backend; set tp_size=1")
        if tokens % self.ep_size:
            raise ConfigError(f"ParallelismConfig ep_size={self.ep_size}: the experts are split over "
                              f"data-parallel shards (dp_shard_size x cp_size x sp_size = {tokens}), "
                              f"which ep_size must divide; set dp_shard_size={self.ep_size} "
                              "(or a multiple of it)")

    @classmethod
    def of(cls, value: Any, where: str = "parallelism_config") -> ParallelismConfig:
        """Ours, Accelerate's (read by its field names) or a dict of those fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ConfigError(f"{where}: unknown key {unknown[0]!r}; the keys are "
                                  f"{', '.join(f.name for f in dataclasses.fields(cls))}")
            return cls(**value)
        if all(hasattr(value, name) for name in _SIZES):
            return cls(**{f.name: getattr(value, f.name, None) for f in dataclasses.fields(cls)})
        raise ConfigError(f"{where}={show(value)} must be a ParallelismConfig (hf_backend's or "
                          "Accelerate's) or a dict of its sizes")

    def shape(self, world: int) -> MeshShape:
        """The shape a config asks for, checked against the world size. All sizes 1 (an empty config,
        as Accelerate reads it) means data parallelism over every process."""
        if self.total_size == 1:
            return MeshShape(dp_replicate=world)
        assert self.dp_replicate_size is not None and self.dp_shard_size is not None and self.cp_size is not None
        assert self.sp_size is not None and self.tp_size is not None and self.ep_size is not None
        assert self.sp_backend is not None  # every size and the backend are set by __post_init__
        assert self.pp_size is not None and self.pp_schedule is not None
        shape = MeshShape(self.dp_replicate_size, self.dp_shard_size, self.cp_size, self.sp_size,
                          self.tp_size, self.ep_size, self.sp_backend, self.pp_size, self.pp_schedule,
                          self.pp_microbatches)
        if shape.world != world:
            sizes = " x ".join(f"{name}_size {size}" for name, size in zip(MeshShape.DIMS, shape.sizes) if size > 1)
            fix = f"set dp_shard_size={self.dp_shard_size * world // shape.world} or launch {shape.world} " \
                  "processes" if world % shape.world == 0 else f"launch {shape.world} processes"
            raise ConfigError(f"ParallelismConfig: {sizes} makes {shape.world} processes, but "
                              f"{world} run; {fix}")
        return shape

    @classmethod
    def of_shape(cls, shape: MeshShape) -> ParallelismConfig:
        """Accelerate's view of a grid. `sp_backend` names the Ulysses that runs: hf_backend's, so
        that transformers' Trainer takes none of its DeepSpeed-ALST paths (its dataloader adapter, its
        loss), or DeepSpeed's, so that it takes them."""
        return cls(dp_replicate_size=shape.dp_replicate, dp_shard_size=shape.dp_shard, tp_size=shape.tp,
                   cp_size=shape.cp, sp_size=shape.sp, sp_backend=shape.sp_backend, ep_size=shape.ep,
                   pp_size=shape.pp, pp_schedule=shape.pp_schedule, pp_microbatches=shape.pp_microbatches)

    def to_json(self) -> dict[str, Any]:
        """What TrainingArguments.to_dict() writes (transformers calls it): the sizes and backends.
        """
        return {name: getattr(self, name) for name in (*_SIZES, _EP, "cp_backend", "sp_backend", _PP, "pp_schedule",
                                                       "pp_microbatches")}

    # Accelerate's read-only views, which transformers' Trainer and Accelerate's examples ask
    tp_enabled = property(lambda self: self.tp_size > 1)
    ep_enabled = property(lambda self: self.ep_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)
    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    pp_enabled = property(lambda self: self.pp_size > 1)
    total_size = property(lambda self: math.prod(getattr(self, name) for name in (*_SIZES, _PP)))
    data_parallel_size = property(lambda self: self.dp_replicate_size * self.dp_shard_size)
    non_data_parallel_size = property(lambda self: self.tp_size * self.cp_size * self.sp_size)

    # Accelerate's mesh dimension names: the dimensions of size > 1 among those each group joins
    # (the mesh itself has every dimension, and the flattened `dp`, `dp_shard_cp` and `dp_cp`:
    # parallel/dims.py)
    dp_dim_names = property(lambda self: self._enabled("dp_replicate", "dp_shard"))
    non_dp_dim_names = property(lambda self: self._enabled("tp", "cp", "sp"))
    dp_shard_cp_dim_names = property(lambda self: self._enabled("dp_shard", "cp"))
    dp_cp_dim_names = property(lambda self: self._enabled("dp_replicate", "dp_shard", "cp"))
    fsdp_dim_names = property(lambda self: [*self._enabled("dp_replicate"), "dp_shard_cp"])
    active_mesh_dims = property(lambda self: self.dp_dim_names + self.non_dp_dim_names)
    device_mesh = None  # what get_device_mesh built (not a field, as in Accelerate)

    def _enabled(self, *dims: str) -> list[str]:
        return [dim for dim in dims if getattr(self, f"{dim}_size") > 1]

    def build_device_mesh(self, device_type: str) -> Any:
        """The run's DeviceMesh for these sizes over this run's processes (the one the engine then
        uses, with Accelerate's dimension names; the process state is set up first, as an
        Accelerator would); None when every size is 1, as in Accelerate."""
        from ..runtime.process import get_process_state

        if self.total_size == 1:
            return None
        process = get_process_state(cpu=device_type == "cpu")
        return build_mesh(self.shape(process.num_processes), process.device.type)

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The mesh built once (`build_device_mesh` on the first call, which needs `device_type`).
        """
        if self.device_mesh is None:
            if device_type is None:
                raise ConfigError("ParallelismConfig.get_device_mesh(): no mesh is built yet; pass "
                                  "a device_type such as 'cpu' or 'cuda'")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ConfigError(f"ParallelismConfig.get_device_mesh({device_type!r}): the "
                              f"mesh was built for {self.device_mesh.device_type!r}; "
                              "ask for that device type")
        return self.device_mesh


def requested_shape(given: Any, world: int) -> MeshShape | None:
    """The process grid for `Accelerator(parallelism_config=...)`, or the launcher's when none is given; None when
    neither asks for one."""
    if given is None:
        raw = env.launcher_setting(env.USE_PARALLELISM_CONFIG)
        if raw is None or not env.parse_bool(raw):
            return None
        given = ParallelismConfig()
    return ParallelismConfig.of(given).shape(world)
