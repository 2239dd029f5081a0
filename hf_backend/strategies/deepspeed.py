"""DeepSpeed ZeRO (stages 0-3) through the `deepspeed` package.

One adapter behind the strategy interface's joint `setup`: the engine is built from the model,
optimizer, scheduler and dataloader passed to one `prepare` call, after "auto" values in the config
are resolved from them, and the optimizer (and DeepSpeed's own scheduler) come back as
`EngineStepped` stand-ins: DeepSpeed owns the step. `backward` runs the engine's backward and step
every micro step, and the engine applies accumulation, clipping and the optimizer step at the
window's end (the Accelerator tells it where that is).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..config.options import Handlers
from ..config.plugins import DeepSpeedPlugin
from ..core.enums import DistributedType
from ..core.errors import HfBackendError
from ..core.notes import note
from ..runtime.process import ProcessState
from ..training.gradient_state import GradientState
from ..training.optim import DummyOptim, DummyScheduler, EngineStepped, EngineSteppedScheduler
from ..training.precision import Precision
from . import deepspeed_state, quantized
from .base import Strategy, check_loaded_grid

_BUCKETS = {  # ZeRO sizes derived from the hidden size h, as transformers does
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


_FP16_MESSAGE = {  # by whether the device is the CPU
    True: "DeepSpeed's CPU accelerator does not run fp16 (DeepSpeed 0.19.8 stops with 'Type fp16 "
          "is not supported on your device'); use bf16",
    False: "hf_backend does not run DeepSpeed's fp16 loss scaling yet; use bf16",
}


class DeepSpeedStrategy(Strategy):
    distributed_type = DistributedType.DEEPSPEED

    def __init__(self, process: ProcessState, precision: Precision, handlers: Handlers, plugin: DeepSpeedPlugin,
                 gradient_state: GradientState, split_batches: bool = False) -> None:
        super().__init__(process, precision, handlers)
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise HfBackendError("DeepSpeed was asked for but is not installed: DS_BUILD_OPS=0 pip "
                                 "install deepspeed (or pip install "
                                 "'hf-backend[deepspeed]')") from None
        if precision.mode == "fp16":
            raise HfBackendError(_FP16_MESSAGE[process.device.type == "cpu"])
        attach_deepspeed_comm()
        self.config = plugin.config()
        self.plugin = dataclasses.replace(plugin, zero_stage=self.zero_stage)
        self.gradient_state = gradient_state
        self.split_batches = split_batches
        self.engine: Any = None
        self._zero3_init = None
        if plugin.zero3_init_flag and self.zero_stage == 3:
            self._zero3_init = _partition_at_construction(self.config, precision.mode == "bf16")

    @property
    def zero_stage(self) -> int:
        return int(self.config["zero_optimization"]["stage"])

    # -- building the engine -----------------------------------------------------------------------
    def setup(self, models: Sequence[torch.nn.Module], optimizers: Sequence[Any] = (), schedulers: Sequence[Any] = (),
              loaders: Sequence[Any] = (), device_placement: Sequence[bool] | None = None,
              evaluation_mode: bool = False) -> tuple[list[torch.nn.Module], list[Any], list[Any]]:
        """One engine from everything one `prepare` call holds; a later call may only prepare the model
        again without an optimizer (transformers' Trainer does, to evaluate: the engine comes back)
        or torch schedulers, which the loop steps."""
        if not models:
            if optimizers or any(isinstance(s, DummyScheduler) for s in schedulers):
                raise HfBackendError("DeepSpeed: prepare() the optimizer "
                                     "in the same call as its model")
            return [], [], list(schedulers)
        check_loaded_grid(models, None)
        quantized.prepare(models, self.shape)
        if len(models) > 1 or (self.engine is not None and optimizers):
            raise HfBackendError("DeepSpeed trains one model per Accelerator: prepare it once, "
                                 "with its optimizer")
        if self.engine is None:
            if len(optimizers) > 1:
                raise HfBackendError("DeepSpeed takes one optimizer; pass param "
                                     "groups to a single optimizer instead")
            self._build(models[0], optimizers[0] if optimizers else None, schedulers[0] if schedulers else None,
                        loaders[0] if loaders else None)
        engine = self.engine
        stepped = [EngineStepped(engine.optimizer if isinstance(o, DummyOptim) else o, engine) for o in optimizers]
        own = []
        for scheduler in schedulers:
            if isinstance(scheduler, DummyScheduler):
                if engine.lr_scheduler is None:
                    raise HfBackendError("DummyScheduler: DeepSpeed built no scheduler; check the "
                                         "config's scheduler section")
                scheduler = EngineSteppedScheduler(engine.lr_scheduler)
            own.append(scheduler)
        return [engine], stepped, own

    def _build(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, loader: DataLoader | None) -> None:
        # Read the plugin's config again: transformers' Trainer completes it ("auto" values) after
        # construction.
        self.config = self._resolve(self.plugin.config(), model, loader)
        self._resolve_placeholders(self.config, optimizer, scheduler)
        import deepspeed

        client = None if isinstance(optimizer, DummyOptim) else optimizer
        if client is not None and self.config["zero_optimization"].get("offload_optimizer", {}).get(
                "device", "none") != "none":
            client = self._offload_optimizer(client)
        params = optimizer.params if isinstance(optimizer, DummyOptim) else \
            [p for p in model.parameters() if p.requires_grad]
        callable_scheduler = getattr(scheduler, "lr_scheduler_callable", None) if "scheduler" not in self.config \
            else None
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=client, config=self.config, lr_scheduler=callable_scheduler,
            model_parameters=None if client is not None else params, **self._engine_arguments(model),
        )

    def _engine_arguments(self, model: torch.nn.Module) -> dict[str, Any]:
        """More arguments of `deepspeed.initialize` (its `mpu`, for sequence parallelism)."""
        return {}

    def _resolve_placeholders(self, config: dict[str, Any], optimizer: Any, scheduler: Any) -> None:
        """A config "optimizer"/"scheduler" section goes with DummyOptim/DummyScheduler, whose values
        fill "auto"."""
        if "optimizer" in config:
            if not isinstance(optimizer, DummyOptim):
                raise HfBackendError('DeepSpeed config defines an "optimizer": prepare DummyOptim(model.parameters(), '
                                     "lr=...) (hf_backend.utils) in place of a torch optimizer, or drop the section")
            defaults = {"lr": optimizer.lr, "weight_decay": optimizer.weight_decay, "betas": [0.9, 0.999],
                        "eps": 1e-8, **optimizer.kwargs}
            params = config["optimizer"].setdefault("params", {})
            for key, value in params.items():
                if value == "auto" and key in defaults:
                    params[key] = list(defaults[key]) if key == "betas" else defaults[key]
        elif isinstance(optimizer, DummyOptim):
            raise HfBackendError('DummyOptim needs an "optimizer" section in the DeepSpeed config; add one or prepare '
                                 "a torch optimizer")
        if "scheduler" in config:
            if scheduler is not None and not isinstance(scheduler, DummyScheduler):
                raise HfBackendError('DeepSpeed config defines a "scheduler": prepare DummyScheduler(optimizer, '
                                     "total_num_steps=..., warmup_num_steps=...) in place of a torch scheduler")
            lr = config.get("optimizer", {}).get("params", {}).get("lr")
            fills = {"warmup_min_lr": 0, "warmup_max_lr": lr,
                     "warmup_num_steps": getattr(scheduler, "warmup_num_steps", None),
                     "total_num_steps": getattr(scheduler, "total_num_steps", None)}
            params = config["scheduler"].setdefault("params", {})
            for key, value in params.items():
                if value == "auto" and fills.get(key) is not None:
                    params[key] = fills[key]
        elif isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            raise HfBackendError('DummyScheduler needs a "scheduler" section in the DeepSpeed config or '
                                 "lr_scheduler_callable=...")
        left = _auto_keys({k: config[k] for k in ("optimizer", "scheduler") if k in config})
        if left:
            raise HfBackendError(f'DeepSpeed config: {", ".join(left)} is "auto" and nothing here resolves it; give a '
                                 "number, or the value to DummyOptim / DummyScheduler")

    def _offload_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Offloaded optimizer state is stepped on the CPU: Adam and AdamW become DeepSpeed's CPU Adam
        (compiled on first use), sharing the original param groups so that a scheduler's learning
        rates still apply."""
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or any(
                g.get("amsgrad") for g in optimizer.param_groups):
            note(f"DeepSpeed offload_optimizer: {type(optimizer).__name__} runs as given (slower "
                 "than DeepSpeed's CPU Adam, which replaces Adam/AdamW)")
            self.config["zero_force_ds_cpu_optimizer"] = False
            return optimizer
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        groups = optimizer.param_groups
        cpu_adam = DeepSpeedCPUAdam([dict(g) for g in groups], lr=groups[0]["lr"],
                                    adamw_mode=isinstance(optimizer, torch.optim.AdamW))
        for shared, filled in zip(groups, cpu_adam.param_groups):
            for key, value in filled.items():
                shared.setdefault(key, value)
        cpu_adam.param_groups = groups
        note(f"DeepSpeed offload_optimizer: {type(optimizer).__name__} "
             "runs as DeepSpeed's CPU Adam")
        return cpu_adam

    def _resolve(self, config: dict[str, Any], model: torch.nn.Module, loader: DataLoader | None) -> dict[str, Any]:
        """Fill "auto" (and missing) values from the engine's settings and the prepared objects."""
        steps = self.gradient_state.num_steps
        given = config.get("gradient_accumulation_steps", "auto")
        if given != "auto" and given != steps:
            if steps != 1:
                raise HfBackendError(f"gradient_accumulation_steps is {steps} in the Accelerator "
                                     f"and {given} in the DeepSpeed config; keep one")
            # the config's value governs accumulate()
            self.gradient_state.num_steps = steps = int(given)
        config["gradient_accumulation_steps"] = steps
        if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            batch = getattr(loader, "batch_size", None)
            if batch is None:
                raise HfBackendError('DeepSpeed config: train_micro_batch_size_per_gpu is "auto"; pass the training '
                                     "DataLoader to the same prepare() call as the model, or give a number")
            config["train_micro_batch_size_per_gpu"] = batch // self.process.num_processes if self.split_batches \
                else batch
        micro = config["train_micro_batch_size_per_gpu"]
        if config.get("train_batch_size", "auto") == "auto":
            config["train_batch_size"] = micro * steps * self.process.num_processes
        if config.get("gradient_clipping") == "auto":
            # transformers resolves it from max_grad_norm, whose default is 1.0; the engine has no
            # such setting.
            config["gradient_clipping"] = 1.0
            note('DeepSpeed config: gradient_clipping "auto" is 1.0 (transformers\' max_grad_norm default); set '
                 "DeepSpeedPlugin(gradient_clipping=...) for another value")
        for kind, wanted in (("bf16", self.precision.mode == "bf16"), ("fp16", False)):
            section = config.setdefault(kind, {})
            if section.get("enabled", "auto") == "auto":
                section["enabled"] = wanted
        if config["fp16"]["enabled"]:
            raise HfBackendError("DeepSpeed config: fp16.enabled: " + _FP16_MESSAGE[self.process.device.type == "cpu"])
        zero = config["zero_optimization"]
        for key, rule in _BUCKETS.items():
            if zero.get(key) == "auto":
                hidden = _hidden_size(model)
                if hidden is None:
                    raise HfBackendError(f'DeepSpeed config: zero_optimization.{key} is "auto" but the model has no '
                                         "config.hidden_size to derive it from; give a number")
                zero[key] = rule(hidden)
        left = _auto_keys({k: v for k, v in config.items() if k not in ("optimizer", "scheduler")})
        if left:
            raise HfBackendError(f'DeepSpeed config: {", ".join(left)} is "auto" and nothing here resolves it; '
                                 "give a number")
        config.setdefault("steps_per_print", 2**31 - 1)  # DeepSpeed's own progress prints stay off
        return config

    def compile_model(self, model: torch.nn.Module, plugin: Any) -> torch.nn.Module:
        """DeepSpeed compiles the module inside its engine (its hooks stay outside), in place; by
        regions, as every strategy does (the engine's module, unwrapped)."""
        if plugin.use_regional_compilation:
            return super().compile_model(model, plugin)
        kwargs = plugin.compile_kwargs()
        model.compile(backend=kwargs.pop("backend"), compile_kwargs=kwargs)
        return model

    # -- training step -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, accumulation_steps: int, sync: bool, **kwargs: Any) -> None:
        # The engine divides by its gradient_accumulation_steps itself: the loss is divided exactly
        # once. It reduces gradients only at the window's end: `no_sync` is the base's null context.
        self.engine.set_gradient_accumulation_boundary(sync)
        self.engine.backward(loss, **kwargs)
        self.engine.step()

    @contextlib.contextmanager
    def outside_training(self) -> Iterator[None]:
        """ZeRO-3 learns the order its parameters are fetched in from the first forward and backward,
        and prefetches by it. A forward before the first step would be taken for the step's forward,
        the step's backward would then contradict it, and DeepSpeed would drop what it prefetched in
        the middle of that backward: a head read outside its module (TRL's fused lm_head loss)
        then receives its gradient partitioned. So the order is learnt again from the next step."""
        try:
            yield
        finally:
            offload = getattr(getattr(self.engine, "optimizer", None), "parameter_offload", None)
            coordinator = offload.get_param_coordinator() if offload is not None else None
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()  # what DeepSpeed itself does when its hooks change

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """The engine clipped already (config `gradient_clipping`); returns the norm it measured."""
        configured = self.config.get("gradient_clipping")
        if configured is not None and float(configured) != float(max_norm):
            note(f"clip_grad_norm_(max_norm={max_norm}): DeepSpeed clips to its config's "
                 f"gradient_clipping={configured}")
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(0.0 if norm is None else float(norm))

    def state_plugins(self) -> dict[str, Any]:
        return {"deepspeed_plugin": self.plugin}

    def is_wrapper(self, model: torch.nn.Module) -> bool:
        return model is self.engine

    # -- state -------------------------------------------------------------------------------------
    # Checkpoints hold what every strategy writes (deepspeed_state.py): full fp32 master weights and
    # an optimizer state keyed by parameter name, gathered from the partitions, so they resume
    # anywhere.

    def model_state_dict(self, model: torch.nn.Module, sharded: bool = False, trainable_only: bool = False,
                         masters: bool = False) -> dict[str, torch.Tensor]:
        """Full weights; under ZeRO-3 gathered (16-bit when training in bf16) onto rank 0, other ranks
        get {}. Read from the engine given (still there after `free_memory`), else this strategy's.
        `sharded`: full-size tensors on every process for a sharded (DCP) checkpoint of another
        strategy to be read into;
        `trainable_only`: the parameters that require grad; `masters`: the fp32 master weights the
        optimizer steps (bf16 training included), gathered from their partitions, which checkpoints
        hold."""
        engine = self._engine_of(model)
        if sharded:
            return deepspeed_state.weights_template(engine)
        if masters:
            return deepspeed_state.full_weights(engine, self.zero_stage, trainable_only)
        if self.zero_stage == 3:
            return engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=trainable_only) or {}
        state_dict = engine.module.state_dict()
        if trainable_only:
            frozen = {name for name, p in engine.module.named_parameters() if not p.requires_grad}
            state_dict = {name: tensor for name, tensor in state_dict.items() if name not in frozen}
        return state_dict

    def load_model_state_dict(self, model: torch.nn.Module, state_dict: dict[str, Any], sharded: bool = False) -> Any:
        """Full weights into the module and the fp32 master partitions (`sharded` states are read whole
        by checkpoint/ first)."""
        return deepspeed_state.load_full_weights(self._engine_of(model), self.zero_stage, state_dict)

    def optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             sharded: bool = False) -> dict[str, Any]:
        engine = self._engine_of(model)
        # no ZeRO in fp32: the module's own parameters are stepped
        if not deepspeed_state.partitioned(engine):
            return super().optimizer_state_dict(engine.module, engine.optimizer)
        if sharded:  # to read another strategy's DCP shards into, whole
            return deepspeed_state.optimizer_template(engine)
        return deepspeed_state.full_optimizer_state(engine)

    def load_optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  state_dict: dict[str, Any], sharded: bool = False) -> None:
        engine = self._engine_of(model)
        if not deepspeed_state.partitioned(engine):
            super().load_optimizer_state_dict(engine.module, engine.optimizer, state_dict, sharded)
            return
        deepspeed_state.load_full_optimizer_state(engine, state_dict, "the checkpoint's "
                                                                      "optimizer state")

    def optimizer_parameters(self, model: torch.nn.Module,
                             optimizer: torch.optim.Optimizer) -> list[list[torch.nn.Parameter]]:
        """ZeRO's param groups hold flat partitions (ZeRO-3's only while it steps them): the module's
        parameters come from the engine's own groups."""
        engine = self._engine_of(model)
        if not deepspeed_state.partitioned(engine):
            return super().optimizer_parameters(engine.module, engine.optimizer)
        return deepspeed_state.module_groups(engine.optimizer)

    def _engine_of(self, model: torch.nn.Module) -> Any:
        return model if hasattr(model, "_zero3_consolidated_16bit_state_dict") else self.engine

    def reset(self) -> None:
        """The engine's hooks on the parameters (held by autograd, out of Python's garbage collector's
        reach) would keep model and optimizer alive: DeepSpeed's `destroy` removes them."""
        if self.engine is not None:
            self.engine.destroy()
            _forget_zero3_module(self.engine.module)
        self.engine = None


def attach_deepspeed_comm() -> None:
    """deepspeed.comm over the process group the engine set up (DeepSpeed wraps an existing torch
    group), as Accelerate's state does when DeepSpeed is asked for: `deepspeed.zero.Init`
    (transformers' `from_pretrained` under ZeRO-3) checks its config's batch sizes against
    DeepSpeed's world size before it would initialize it, and would count one process."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                                        verbose=False)


def _partition_at_construction(config: dict[str, Any], bf16: bool) -> Any:
    """Keep transformers' HfDeepSpeedConfig alive: while it lives, `from_pretrained` / `from_config`
    build models under `deepspeed.zero.Init`, so each rank only ever holds its partition of the
    parameters.

    Batch sizes are not known yet (they come from the dataloader at prepare); partitioning does not
    use them, so the config it sees has "auto" values dropped and a placeholder batch."""
    try:
        from transformers.integrations import HfDeepSpeedConfig
    except ImportError:
        note("zero3_init_flag: transformers is not installed; build the model inside "
             "deepspeed.zero.Init() yourself")
        return None
    construction = _without_auto(config)
    construction.pop("train_batch_size", None)
    construction.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    construction.setdefault("bf16", {})["enabled"] = bf16
    return HfDeepSpeedConfig(construction)


def _forget_zero3_module(module: torch.nn.Module) -> None:
    """ZeRO-3 pushes the model onto a module-level stack when it sets up its hooks and `destroy` leaves
    it there (DeepSpeed 0.19), which keeps a freed model alive for the life of the process."""
    from deepspeed.runtime.zero import parameter_offload

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]


def _without_auto(config: Any) -> Any:
    if isinstance(config, dict):
        return {k: _without_auto(v) for k, v in config.items() if v != "auto"}
    return config


def _hidden_size(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    sizes = getattr(config, "hidden_sizes", None)
    if size is None and sizes:
        size = max(sizes)
    return int(size) if size else None


def _auto_keys(config: Any, prefix: str = "") -> list[str]:
    if isinstance(config, dict):
        return [k for key, value in config.items() for k in _auto_keys(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if config == "auto" else []
