"""The one interface every way of training a model (one process, DDP, the native mesh path, DeepSpeed)
implements.

The Accelerator picks a strategy once and routes every model-touching call through it; it never asks
which one it has. `setup` prepares what one `prepare` call was given, jointly (as a Lightning Fabric
strategy does): the native strategies build it from `setup_model` / `setup_optimizer` /
`setup_scheduler`; DeepSpeed builds one engine from all of it and hands back optimizers it steps
itself (optim.EngineStepped).

What only some strategies can do (`join_uneven_inputs`, `clip_grad_value_`) is an optional
capability (capabilities.py), not a member here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..config.options import Handlers
from ..core.enums import DistributedType
from ..core.errors import HfBackendError
from ..parallel.dims import DataShard, loaded_shape
from ..runtime.process import ProcessState
from ..training.optim import DummyScheduler
from ..training.precision import Precision
from ..training.unwrap import extract_model_from_parallel
from . import quantized
from .compile import compile_regions


class Strategy:
    """Defaults are those of a plain, unwrapped model on one device; subclasses override what they
    change."""

    distributed_type = DistributedType.NO
    # Ranks other than 0 may build the model without its weights (on the meta device): preparing
    # it gives them rank 0's (FSDP's cpu_ram_efficient_loading).
    receives_rank0_weights = False

    def __init__(self, process: ProcessState, precision: Precision, handlers: Handlers) -> None:
        self.process = process
        self.precision = precision
        self.handlers = handlers

    mesh: Any = None  # the DeviceMesh the parallelisms are applied over, where there is one
    shape: Any = None  # its MeshShape

    @property
    def data_shard(self) -> DataShard:
        """Which part of each global batch this process reads: its own, unless tensor or context
        parallel neighbours share it."""
        return DataShard(self.process.num_processes, self.process.process_index)

    # -- preparing ---------------------------------------------------------------------------------
    def setup(self, models: Sequence[torch.nn.Module], optimizers: Sequence[Any] = (), schedulers: Sequence[Any] = (),
              loaders: Sequence[Any] = (), device_placement: Sequence[bool] | None = None,
              evaluation_mode: bool = False) -> tuple[list[torch.nn.Module], list[Any], list[Any]]:
        """Everything one `prepare` call was given that is not prepared yet, in one call: returns the
        prepared models, optimizers and schedulers, in the order given. Loaders are only read
        (DeepSpeed sizes its batches from them); `evaluation_mode`: the models are only evaluated
        (placed and autocast, not wrapped for training)."""
        check_loaded_grid(models, self.shape)
        quantized.prepare(models, self.shape)
        placement = list(device_placement) if device_placement is not None else [True] * len(models)
        return ([self.setup_model(m, p, evaluation_mode) for m, p in zip(models, placement, strict=True)],
                [self.setup_optimizer(o) for o in optimizers], [self.setup_scheduler(s) for s in schedulers])

    def setup_model(self, model: torch.nn.Module, device_placement: bool = True,
                    evaluation_mode: bool = False) -> torch.nn.Module:
        if device_placement:
            model = model.to(self.process.device)
        self.precision.wrap_forward(model)
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise HfBackendError(f"prepare(): {type(optimizer).__name__} is not a "
                                 "torch optimizer (DummyOptim stands in for a "
                                 "DeepSpeed config's optimizer and needs DeepSpeed)")
        return optimizer

    def setup_scheduler(self, scheduler: Any) -> Any:
        if isinstance(scheduler, DummyScheduler):
            raise HfBackendError("DummyScheduler stands in for a DeepSpeed config's scheduler; use "
                                 "a torch scheduler without DeepSpeed")
        return scheduler

    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool = False) -> torch.nn.Module:
        """The user's module: no parallel wrapper, ours or the user's own `nn.DataParallel` (and no
        torch.compile wrapper unless `keep_torch_compile`)."""
        return extract_model_from_parallel(model, keep_torch_compile=keep_torch_compile, is_wrapper=self.is_wrapper)

    def is_wrapper(self, model: torch.nn.Module) -> bool:
        return False

    def compile_model(self, model: torch.nn.Module, plugin: Any) -> torch.nn.Module:
        """torch.compile around the prepared (wrapped) model, as Accelerate does: DDP's and FSDP2's
        hooks stay outside the compiled graphs (dynamo's DDPOptimizer splits the graphs at DDP's
        bucket boundaries). With `use_regional_compilation`, the user's module compiled by regions
        in place (compile.py), the wrapper kept as it is."""
        if plugin.use_regional_compilation:
            compile_regions(self.unwrap_model(model), **plugin.compile_kwargs())
            return model
        return torch.compile(model, **plugin.compile_kwargs())  # type: ignore[return-value]  # an OptimizedModule

    # -- training step -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, accumulation_steps: int, sync: bool, **kwargs: Any) -> None:
        """Backward of one micro step; `sync` says whether it ends an accumulation window."""
        self.precision.scale_and_backward(loss / accumulation_steps if accumulation_steps > 1 else loss, **kwargs)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def context_parallel(self, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                         keep: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager:
        """Accelerate's `maybe_context_parallel`: each rank keeps its slice of the buffers inside the
        block (only with context parallelism; elsewhere nothing happens)."""
        return contextlib.nullcontext()

    def outside_training(self) -> contextlib.AbstractContextManager:
        """A forward that is no training step's (the Trainer asking the model about its loss before
        the first step): whatever the strategy learns from the steps' forwards stays untouched."""
        return contextlib.nullcontext()

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A block whose backward synchronizes although it runs under `no_sync` (only DDP needs to do
        anything)."""
        return contextlib.nullcontext()

    def state_plugins(self) -> dict[str, Any]:
        """The plugin `accelerator.state` shows, under Accelerate's name (fsdp_plugin,
        deepspeed_plugin)."""
        return {}

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    # -- state -------------------------------------------------------------------------------------
    # What a model's and optimizer's state is, through torch's distributed state-dict API;
    # hf_backend.checkpoint decides where and how it is written. `sharded_checkpoints`: states are
    # saved as each process's shards (DCP) rather than gathered full states. Both forms load under
    # every strategy.
    sharded_checkpoints = False
    save_options = StateDictOptions()  # how full states are taken from this strategy's models
    # how full states are given back (missing tied keys checked)
    load_options = StateDictOptions(strict=False)

    def model_state_dict(self, model: torch.nn.Module, sharded: bool = False, trainable_only: bool = False,
                         masters: bool = False) -> dict[str, torch.Tensor]:
        """The full state dict (collective for sharded strategies: call it on every process), or with
        `sharded` this process's shards; `trainable_only`: the parameters that require grad, nothing
        else gathered.
        `masters`: the weights the optimizer steps, which a checkpoint holds; they are the model's
        parameters (precision.py keeps them in fp32) except where an engine keeps a master copy of
        its own (DeepSpeed)."""
        options = StateDictOptions() if sharded else self.save_options
        return get_model_state_dict(  # type: ignore[return-value]  # torch's type covers optimizer states too
            model, options=dataclasses.replace(options, ignore_frozen_params=trainable_only))

    def load_model_state_dict(self, model: torch.nn.Module, state_dict: dict[str, Any], sharded: bool = False) -> Any:
        """Give the model a full state dict (or, with `sharded`, this process's shards); returns
        torch's missing and unexpected keys. A full state goes through the module's own
        `load_state_dict`, as transformers' Trainer loads it: a model that overrides it (to resize a
        buffer, say) keeps its meaning, where torch's `set_model_state_dict` would call it with an
        `assign` argument such an override may lack."""
        if sharded:
            return set_model_state_dict(model, state_dict, options=StateDictOptions())
        return self.unwrap_model(model).load_state_dict(state_dict, strict=self.load_options.strict)

    def optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             sharded: bool = False) -> dict[str, Any]:
        """The optimizer's state keyed by parameter names: full, or with `sharded` this process's
        shards."""
        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions() if sharded else self.save_options)

    def load_optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  state_dict: dict[str, Any], sharded: bool = False) -> None:
        set_optimizer_state_dict(model, optimizer, state_dict,
                                 options=StateDictOptions() if sharded else self.load_options)

    def optimizer_parameters(self, model: torch.nn.Module,
                             optimizer: torch.optim.Optimizer) -> list[list[torch.nn.Parameter]]:
        """The model's parameters each of the optimizer's param groups updates, in order: what the
        groups of a saved optimizer state are matched against."""
        return [list(group["params"]) for group in optimizer.param_groups]

    def reset(self) -> None:
        """Drop every reference to prepared objects this strategy holds (`Accelerator.free_memory`).
        """


def check_loaded_grid(models: Sequence[torch.nn.Module], shape: Any) -> None:
    """A model transformers sharded while loading it (`from_pretrained(distributed_config=...)` or
    `tp_plan=`) trains as it is only on the grid it was sharded over: that must be this run's
    (`shape`, None without a mesh)."""
    for model in models:
        loaded = loaded_shape(model)
        if loaded is not None and loaded != shape:
            run = shape.describe() if shape is not None else "plain data parallelism (no mesh)"
            raise HfBackendError(
                f"prepare(): the model was sharded over {loaded.describe()} by from_pretrained "
                "(distributed_config= or tp_plan=: transformers' own mesh over every process), "
                f"but this run's grid is {run}; build the Accelerator with "
                f"parallelism_config={_config_text(loaded)}, or load the model whole and let "
                "prepare shard it (docs/parallelism.md)")


def _config_text(shape: Any) -> str:
    sizes = {"dp_replicate_size": shape.dp_replicate, "dp_shard_size": shape.dp_shard, "tp_size": shape.tp}
    return "ParallelismConfig(" + ", ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) + ")"
