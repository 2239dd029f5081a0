"""`Accelerator`: the facade a training script talks to, with Accelerate's public API.

It holds one process state, one strategy (chosen once), one precision policy and the
gradient-accumulation state, and routes every call to the piece that owns it. It never branches on
the kind of strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from .. import checkpoint
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
from ..data.loader import PreparedDataLoader, prepare_dataloader, skip_first_batches
from ..runtime import accelerate_state, collectives
from ..runtime.process import (
    ProcessView,
    shutdown_process_group,
)
from ..strategies.capabilities import Joinable, Pipelined, SequenceLoader, ValueClipping, capability
from ..training.memory import release_memory
from ..training.optim import AcceleratedOptimizer, AcceleratedScheduler, DummyOptim, DummyScheduler, as_placeholder
from ..training.precision import Precision
from ..training.trigger import Trigger, uneven_inputs
from ..training.unwrap import is_compiled_module
from . import compat, elastic
from .connector import connect
from .saving import SavingMembers
from .states import AcceleratorState

if TYPE_CHECKING:
    from ..parallel.dims import MeshShape
    from ..strategies.base import Strategy
    from ..training.gradient_state import GradientState
    from ..training.prepared import PreparedObjects
    from ..training.step_hooks import StepHooks
    from .tracking import Tracking


class Accelerator(ProcessView, SavingMembers, compat.AccelerateMembers, elastic.ElasticMembers):
    # The engine's parts (connector.Engine), set from it in __init__.
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
    _hooks: StepHooks

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        even_batches: bool | None = None,
        fsdp_plugin: Any = None,
        deepspeed_plugin: Any = None,
        log_with: Any = None,
        parallelism_config: Any = None,
        **other: Any,
    ) -> None:
        """Accelerate's arguments; those naming what hf_backend does not run are refused in one line, those with
        nothing to do here noted (docs/compat.md). `parallelism_config` lays the processes out on one DeviceMesh
        (docs/parallelism.md); `fault_tolerance` (hf_backend's own) makes this job one replica group of a torchft
        run (docs/fault_tolerance.md). connector.py turns them into the engine's parts, once."""
        arguments = {name: value for name, value in locals().items() if name not in ("self", "other")}
        engine = connect(arguments, other)
        for field in dataclasses.fields(engine):
            setattr(self, field.name, getattr(engine, field.name))
        self.replica_groups = engine.replica_groups  # the documented view (docs/fault_tolerance.md), or None
        # a grid of replicas only (DDP) still has Accelerate's mesh
        self._config_mesh = compat.config_mesh(self._parallelism_shape, self.strategy, self.process.device.type)
        self.checkpoint_io = checkpoint.CheckpointIO(self.process, self.strategy, self.precision, self._objects,
                                                     self._progress)
        self.trigger = Trigger(self.process)
        self._save_state_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._load_state_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        _ = self.state  # built now: `AcceleratorState()` describes the newest Accelerator, as in Accelerate
        accelerate_state.tell_accelerator(self)  # and so do Accelerate's own, when third-party code loaded it

    # -- process state -----------------------------------------------------------------------------
    @functools.cached_property
    def state(self) -> AcceleratorState:
        """Accelerate's `accelerator.state`: process facts plus the distributed type, precision and
        plugin in use (all fixed once the strategy is chosen)."""
        return AcceleratorState.of(self.process, self.distributed_type, self.mixed_precision,
                                   **self.strategy.state_plugins())

    @property
    def _models(self) -> list[torch.nn.Module]:
        """The prepared models (an attribute transformers' Trainer reads)."""
        return self._objects.models

    @property
    def distributed_type(self) -> DistributedType:
        return self.strategy.distributed_type

    @property
    def mixed_precision(self) -> str:
        return self.precision.mode

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        """Scripts that pick the accumulation after `find_executable_batch_size` set it here, as in
        Accelerate."""
        checks.whole(steps, "gradient_accumulation_steps", minimum=1)
        self.gradient_state.num_steps = int(steps)

    @property
    def step(self) -> int:
        """Micro steps seen by `accumulate()` since the last sync."""
        return self.gradient_state.micro_step

    @step.setter
    def step(self, step: int) -> None:
        self.gradient_state.micro_step = step

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._objects.optimizers)

    # -- prepare -----------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers for this run.

        What is not prepared yet goes to the strategy in one joint `setup` call (models first:
        optimizers may need the wrapped parameters; DeepSpeed builds one engine from all of it). An
        object that is already prepared comes back as it is; anything else passes through.

        Args:
            *args: the objects, in any order.
            device_placement: per object, whether to move it to this process's device (None: the
                Accelerator's `device_placement`).

        Returns:
            the prepared objects in the order given (one object alone, not a tuple).
        """
        placement: Sequence[bool | None] = device_placement or [None] * len(args)
        if len(placement) != len(args):
            raise HfBackendError(f"prepare(): device_placement has {len(placement)} entries for "
                                 f"{len(args)} objects")
        args = tuple(as_placeholder(obj) for obj in args)
        result = list(args)
        kinds: dict[str, type | tuple[type, ...]] = {
            "models": torch.nn.Module, "optimizers": (torch.optim.Optimizer, DummyOptim),
            "schedulers": (torch.optim.lr_scheduler.LRScheduler, DummyScheduler)}
        new = {kind: [i for i, obj in enumerate(args) if isinstance(obj, cls) and not self._is_prepared(obj)]
               for kind, cls in kinds.items()}
        loaders = [i for i, obj in enumerate(args) if isinstance(obj, DataLoader)]
        models, optimizers, schedulers = self.strategy.setup(
            [args[i] for i in new["models"]], [args[i] for i in new["optimizers"]],
            [args[i] for i in new["schedulers"]], [args[i] for i in loaders],
            [self.device_placement if (p := placement[i]) is None else p for i in new["models"]])
        for i, model in zip(new["models"], models):
            result[i] = self._register_model(model)
        for i in loaders:
            result[i] = self.prepare_data_loader(args[i], device_placement=placement[i])
            if new["models"] and isinstance(self.strategy, SequenceLoader):  # as Accelerate does
                result[i] = self.strategy.sequence_loader(result[i])
        for i, optimizer in zip(new["optimizers"], optimizers):
            result[i] = self._register_optimizer(optimizer)
        for i, scheduler in zip(new["schedulers"], schedulers):
            result[i] = self._register_scheduler(scheduler, steps=args[i])
        return result[0] if len(result) == 1 else tuple(result)

    def _is_prepared(self, obj: Any) -> bool:
        return any(obj is prepared for prepared in self._objects.models) or \
            isinstance(obj, (AcceleratedOptimizer, AcceleratedScheduler, PreparedDataLoader))

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """`evaluation_mode`: the model is only evaluated, so it is placed and autocast but not wrapped
        for training (no DDP)."""
        if self._is_prepared(model):
            return model
        placement = self.device_placement if device_placement is None else device_placement
        (prepared,), _, _ = self.strategy.setup([model], device_placement=[placement], evaluation_mode=evaluation_mode)
        return self._register_model(prepared)

    def _register_model(self, prepared: torch.nn.Module) -> torch.nn.Module:
        if self.dynamo_plugin.enabled and not is_compiled_module(prepared):
            # once, around the wrapper
            prepared = self.strategy.compile_model(prepared, self.dynamo_plugin)
        self._objects.models.append(prepared)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer | DummyOptim) -> AcceleratedOptimizer:
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        _, (inner,), _ = self.strategy.setup([], [optimizer])
        return self._register_optimizer(inner)

    def _register_optimizer(self, inner: Any) -> AcceleratedOptimizer:
        wrapped = AcceleratedOptimizer(inner, self.gradient_state, self.scaler, hooks=self._hooks)
        self._objects.optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        _, _, (inner,) = self.strategy.setup([], [], [scheduler])
        return self._register_scheduler(inner, steps=scheduler)

    def _register_scheduler(self, inner: Any, steps: Any) -> AcceleratedScheduler:
        """`steps`: the scheduler as given, whose `optimizer` links it to the prepared optimizers it
        follows."""
        given = getattr(steps, "optimizer", None)
        linked = [opt for opt in self._objects.optimizers if opt.stands_for(given)] or list(self._objects.optimizers)
        wrapped = AcceleratedScheduler(inner, linked, self.gradient_state, self.step_scheduler_with_optimizer,
                                       self.split_batches, self.strategy.data_shard.count)
        self._objects.schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> PreparedDataLoader:
        if isinstance(data_loader, PreparedDataLoader):
            return data_loader
        placement = self.device_placement if device_placement is None else device_placement
        # Batches are built on the CPU: placing them on a CPU device would only cost time.
        device = self.device if placement and self.device.type != "cpu" else None
        # tensor / context parallel neighbours read the same batches
        shard = self._hooks.data_shard(self.strategy.data_shard)
        prepared = prepare_dataloader(data_loader, num_processes=shard.count, process_index=shard.index,
                                      device=device, split_batches=self.split_batches, even_batches=self.even_batches,
                                      gradient_state=self.gradient_state, data_seed=self.dataloader_config.data_seed,
                                      non_blocking=self.dataloader_config.non_blocking)
        self._hooks.loader_prepared(prepared)
        self._objects.dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """Start the next pass of a prepared loader at batch `num_batches` (absolute: it replaces,
        never adds to, the position `load_state` restored, so Accelerate scripts that skip by hand
        after resuming stay correct)."""
        return skip_first_batches(dataloader, num_batches)

    # -- training step -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()` for the prepared model: divided by the accumulation steps, scaled
        under fp16, through the engine under DeepSpeed.

        Args:
            loss: the micro batch's loss tensor.
            **kwargs: passed on to torch's `backward` (e.g. `retain_graph`).
        """
        if not self._objects.models:
            raise HfBackendError("backward() before prepare(): call model, optimizer, ... = "
                                 "accelerator.prepare(...) first")
        if not isinstance(loss, torch.Tensor):
            raise HfBackendError(f"backward(loss={checks.show(loss)}): pass the loss tensor (e.g. "
                                 f"outputs.loss), not a {type(loss).__name__}")
        self.strategy.backward(loss, self.gradient_state.num_steps, self.sync_gradients, **kwargs)
        if self.sync_gradients:
            self._hooks.after_backward(self._objects.models)

    def forward_backward(self, model: torch.nn.Module, batch: Any,
                         num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Under pipeline parallelism (`ParallelismConfig(pp_size=P)`), what `loss = model(**batch).loss` and
        `accelerator.backward(loss)` do together: the batch through the schedule's microbatches, forward and
        backward. Returns the batch's mean loss on every rank (a causal LM's, from `labels` or else the
        `input_ids`; with `num_items_in_batch`, the target tokens of the global batch of every accumulated micro
        step, their sum divided by it, as transformers' losses take it); inside `accumulate` it counts as one
        micro step."""
        loss = self._pipelined("forward_backward").forward_backward(model, batch, self.gradient_state.num_steps,
                                                                    num_items_in_batch)
        if self.sync_gradients:
            self._hooks.after_backward(self._objects.models)
        return loss

    def forward_only(self, model: torch.nn.Module, batch: Any, logits: bool = False) -> Any:
        """Under pipeline parallelism, `model(**batch)` for evaluation, without gradients: a `CausalLMOutput`
        with the batch's mean loss (None without `labels`) and, with `logits`, the batch's logits, on every
        rank."""
        from transformers.modeling_outputs import CausalLMOutput

        loss, out = self._pipelined("forward_only").forward_only(model, batch, logits=logits)
        return CausalLMOutput(loss=loss, logits=out)

    def _pipelined(self, what: str) -> Pipelined:
        if not self._objects.models:
            raise HfBackendError(f"{what}() before prepare(): call model, optimizer, ... = "
                                 "accelerator.prepare(...) first")
        return capability(self.strategy, Pipelined)  # type: ignore[type-abstract]

    def _do_sync(self) -> None:
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step = 0
            state.sync_gradients = True
        else:
            self.step += 1
            state.sync_gradients = self.step % state.num_steps == 0

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro step: optimizers step only every `gradient_accumulation_steps` micro steps and at
        the end of the dataloader; in between, gradients are not all-reduced, unless
        `sync_each_batch` asks for it (it saves memory under FSDP, at the cost of a reduction every
        micro step)."""
        if not all(isinstance(m, torch.nn.Module) for m in models):
            raise HfBackendError(f"accumulate({', '.join(checks.show(m) for m in models)}): pass "
                                 "the prepared models")
        self._do_sync()
        if self.sync_gradients or not models or (self.use_distributed and self.gradient_state.sync_each_batch):
            yield
            return
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(self.strategy.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        with self.strategy.no_sync(model):
            yield

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.scaler is None:
            return
        targets = [optimizer] if optimizer is not None else self._objects.optimizers
        for opt in targets:
            self.scaler.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the synchronized gradients by their total norm, over every shard.

        Args:
            parameters: the prepared model's parameters.
            max_norm: the largest total norm kept.
            norm_type: the p of the p-norm (inf for the largest value).

        Returns:
            the total norm before clipping; None on a micro step that does not sync (clipping a
            partial sum is never what accumulation means), where nothing is done.
        """
        checks.number(max_norm, "clip_grad_norm_ max_norm", positive=True)
        if not self.sync_gradients:
            return None
        self.unscale_gradients()
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        checks.number(clip_value, "clip_grad_value_ clip_value", positive=True)
        clipping = capability(self.strategy, ValueClipping)  # DeepSpeed clips by norm only
        if not self.sync_gradients:
            return
        self.unscale_gradients()
        clipping.clip_grad_value_(parameters, clip_value)

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager:
        return self.precision.autocast(enabled=getattr(autocast_handler, "enabled", True))

    # -- collectives -------------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Every process's `tensor` (or nested structure of tensors) concatenated along the first
        dimension, on every process; same shapes on every process (see `pad_across_processes`)."""
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather predictions or labels of an evaluation batch.

        Args:
            input_data: this process's tensors (or nested structure); any objects with
                `use_gather_object`.
            use_gather_object: gather Python objects rather than tensors.

        Returns:
            every process's rows, exactly one per dataset item over the whole loop (the padding a
            short last batch got is dropped).
        """
        return collectives.gather_for_metrics(input_data, self.gradient_state, use_gather_object,
                                              self.strategy.data_shard)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """`tensor` (or a nested structure) summed ("sum") or averaged ("mean") over the processes,
        times `scale`, on every process."""
        return collectives.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return collectives.pad_across_processes(tensor, dim, pad_index, pad_first)

    # -- models and saving -------------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = False) -> torch.nn.Module:
        """The user's module inside a prepared model: no DDP / FSDP / DeepSpeed wrapper and, unless
        `keep_torch_compile`, no torch.compile wrapper; `keep_fp32_wrapper=False` also removes the
        autocast forward of mixed precision."""
        inner = self.strategy.unwrap_model(model, keep_torch_compile=keep_torch_compile)
        if not keep_fp32_wrapper:
            Precision.unwrap_forward(inner)
        return inner

    def _progress(self) -> dict[str, Any]:
        """The counters a checkpoint keeps besides the objects' states (restored by `load_state`).
        """
        return {"accumulation_step": self.step, **self._elastic_progress()}

    # -- coordination between processes ------------------------------------------------------------
    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None) -> Iterator[None]:
        """Train on loaders whose processes run out at different steps (torch's Join for DDP models);
        `even_batches` overrides the prepared loaders' setting inside the block."""
        # one line refuses FSDP and DeepSpeed; an abstract class is only isinstance-checked (python/mypy#4717)
        joinable = capability(self.strategy, Joinable)  # type: ignore[type-abstract]
        with uneven_inputs(joinable, joinables, self._objects.dataloaders, even_batches):
            yield

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A block whose backward all-reduces gradients although it runs under `no_sync` (DDP; others
        need nothing)."""
        return self.strategy.trigger_sync_in_backward(model)

    # -- lifecycle ---------------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[None]:
        """Drop every reference this Accelerator holds to prepared objects (and return `None` for each
        argument)."""
        self.checkpoint_io.wait()  # an async save's staged copy is memory too
        self._objects.clear()
        self.strategy.reset()
        self.step = 0
        return release_memory(*objects)

    clear = free_memory

    def end_training(self) -> None:
        """Finish the trackers and an async save under way, then tear down the process group if this
        process created it (a group given by Ray or the user stays)."""
        self.tracking.finish()
        self.wait_for_checkpoint()
        self.wait_for_everyone()
        self._hooks.close()
        shutdown_process_group()

