"""Optimizer and scheduler wrappers that know about gradient accumulation, grad scaling and skipped
steps."""

from __future__ import annotations

from typing import Any

import torch

from .gradient_state import GradientState
from .step_hooks import StepHooks


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Steps (and zeroes) only on gradient-sync steps; with fp16, steps through the GradScaler.

    `step_was_skipped` is True after a step the scaler skipped because of inf/nan gradients, or that the step hooks
    did not commit (step_hooks.py: fault tolerance's replica groups, when a group failed during the step); they hear
    of every step taken.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState,
                 scaler: torch.amp.GradScaler | None = None, hooks: StepHooks | None = None) -> None:
        # Deliberately not calling Optimizer.__init__: this object only forwards to `optimizer`.
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self.hooks = hooks or StepHooks()
        self.step_was_skipped = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def stands_for(self, optimizer: Any) -> bool:
        """Whether this is `optimizer` prepared (directly, or through the EngineStepped stand-in of an
        engine)."""
        inner = self.optimizer
        return optimizer is inner or (isinstance(inner, EngineStepped) and optimizer is inner.stepped)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        if not self.gradient_state.sync_gradients:
            return None
        if not self.hooks.commit():
            self.step_was_skipped = True
            return None
        result = None
        if self.scaler is None:
            self.step_was_skipped = False
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        else:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer, closure) if closure is not None else self.scaler.step(self.optimizer)
            self.scaler.update()
            self.step_was_skipped = self.scaler.get_scale() < scale_before
        self.hooks.after_optimizer_step()
        return result

    def train(self) -> None:
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """Advances only when its optimizers really stepped.

    A schedule is usually sized from `len(dataloader)` before `prepare`; each process then sees 1/N
    of the batches, so unless `split_batches` the scheduler advances N times per optimizer step,
    spanning the run as planned (N: the data-parallel processes, which read different batches).
    """

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer], gradient_state: GradientState,
                 step_with_optimizer: bool = True, split_batches: bool = False, num_processes: int = 1) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_update = 1 if split_batches else num_processes

    def step(self, *args: Any, **kwargs: Any) -> None:
        if isinstance(self.scheduler, EngineSteppedScheduler):
            return
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(self.steps_per_update):
            if total is not None and self.scheduler._step_count > total:
                break  # OneCycleLR raises past its end
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> list[float]:
        return self.scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not found on the wrapper: forward to the scheduler
        # (last_epoch, base_lrs, ...).
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class EngineStepped(torch.optim.Optimizer):
    """An optimizer that a training engine steps and zeroes itself, inside backward (DeepSpeed's engine
    does, at the end of each accumulation window): what a strategy's `setup` hands back in its
    place, so that the script's `step()` and `zero_grad()` calls do nothing. param_groups and state
    are those of the optimizer it stands for (a scheduler sets its learning rates there); `model` is
    the engine, whose optimizer steps partitions of the parameters rather than the parameters the
    param groups show; `state_dict()` is empty (checkpoints take the state from the engine)."""

    def __init__(self, stepped: Any, model: torch.nn.Module) -> None:
        # Deliberately not calling Optimizer.__init__: this object only forwards to `stepped`.
        self.stepped = stepped
        self.model = model

    def __getattr__(self, name: str) -> Any:
        if name in ("stepped", "model"):
            raise AttributeError(name)
        return getattr(self.stepped, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.stepped.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.stepped.param_groups = value

    @property
    def state(self) -> Any:
        return self.stepped.state

    @state.setter
    def state(self, value: Any) -> None:
        self.stepped.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return getattr(self.stepped, "defaults", {})

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.stepped.defaults = value

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def __repr__(self) -> str:
        return f"EngineStepped({self.stepped!r})"


class EngineSteppedScheduler:
    """A scheduler the engine steps at each optimizer step: `step()` does nothing, the rest is the
    scheduler's."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class DummyOptim:
    """Stands in for the optimizer a DeepSpeed config's "optimizer" section defines (Accelerate's name
    and fields): `prepare` hands DeepSpeed the parameters, and fills "auto" values in that section
    from `lr`, `weight_decay` and keyword arguments such as `betas` and `eps`."""

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0.0, **kwargs: Any) -> None:
        self.params = list(params)
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands in for the scheduler a DeepSpeed config's "scheduler" section defines (or that
    `lr_scheduler_callable(optimizer)` builds); "auto" warmup and total steps come from here."""

    def __init__(self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Any = None, **kwargs: Any) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def as_placeholder(obj: Any) -> Any:
    """Accelerate's DummyOptim / DummyScheduler (transformers' DeepSpeed integration creates those) as
    ours, read by their fields; anything else comes back as it is."""
    if not type(obj).__module__.startswith("accelerate."):
        return obj
    name = type(obj).__name__
    if name == "DummyOptim":
        return DummyOptim(obj.params, lr=obj.lr, weight_decay=obj.weight_decay, **obj.kwargs)
    if name == "DummyScheduler":
        return DummyScheduler(as_placeholder(obj.optimizer), obj.total_num_steps, obj.warmup_num_steps,
                              obj.lr_scheduler_callable, **obj.kwargs)
    return obj
