"""Data parallel over processes with torch's DistributedDataParallel (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from .. import hang_watch
from ..enums import DDPCommunicationHookType as Hook
from ..errors import HfBackendError
from ..options import DistributedDataParallelKwargs
from ..state import DistributedType
from .base import Strategy

_POWER_SGD = (Hook.POWER_SGD, Hook.BATCHED_POWER_SGD)
_HOOKS = {Hook.FP16: default_hooks.fp16_compress_hook, Hook.BF16: default_hooks.bf16_compress_hook,
          Hook.POWER_SGD: powerSGD_hook.powerSGD_hook, Hook.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
_WRAPPERS = {Hook.FP16: default_hooks.fp16_compress_wrapper, Hook.BF16: default_hooks.bf16_compress_wrapper}


class DDPStrategy(Strategy):
    @property
    def distributed_type(self) -> DistributedType:  # type: ignore[override]
        return self.process.distributed_type  # MULTI_GPU or MULTI_CPU, as the process state decides

    def setup_model(self, model: torch.nn.Module, device_placement: bool = True,
                    evaluation_mode: bool = False) -> torch.nn.Module:
        model = super().setup_model(model, device_placement)
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronize (a model only evaluated, or frozen)
        self.precision.keep_fp32_masters(model)  # before DDP builds its buckets from the parameters' dtypes
        hook = communication_hook(self.handlers.ddp)  # a bad option fails before any collective
        device_ids = [self.process.device.index] if self.process.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers at construction: ranks that seeded differently agree.
        # Under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo, DDP runs on a copy of the group without torch's checks (its
        # constructor crashes on the checked one) and its gradients reach the checked group through the hook.
        group = hang_watch.unchecked_group()
        kwargs = self.handlers.ddp.ddp_kwargs()
        if group is not None:
            kwargs["process_group"] = group
        ddp = DistributedDataParallel(model, device_ids=device_ids, **kwargs)
        if hook is None and group is not None:
            hook = (default_hooks.allreduce_hook, None)  # None: the default (checked) group
        if hook is not None:
            ddp.register_comm_hook(hook[1], hook[0])  # before the first backward, as DDP requires
        return ddp

    def is_wrapper(self, model: torch.nn.Module) -> bool:
        return isinstance(model, DistributedDataParallel)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """DDP skips the all-reduce under `no_sync` through two flags; set them (and prepare the reducer, as DDP's
        forward would have) for the block, then restore them."""
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        saved = model.require_backward_grad_sync, model.require_forward_param_sync
        try:
            model.require_backward_grad_sync = model.require_forward_param_sync = True
            model.reducer.prepare_for_backward([])
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = saved


# -- gradient communication hooks (DistributedDataParallelKwargs.comm_hook / comm_wrapper / comm_state_option) ---------
def _hook_type(value: Any, field: str, choices: tuple[Hook, ...]) -> Hook:
    try:
        hook = Hook(getattr(value, "value", value))
    except ValueError:
        hook = None
    if hook not in choices:
        raise HfBackendError(f"DistributedDataParallelKwargs({field}={str(getattr(value, 'value', value))!r}): use "
                             f"one of {', '.join(repr(c.value) for c in choices)}")
    return hook


def communication_hook(handler: DistributedDataParallelKwargs) -> tuple[Callable, Any] | None:
    """The (hook, state) pair torch's `DistributedDataParallel.register_comm_hook` takes, or None for plain
    all-reduce. Every invalid combination is one line; a new PowerSGD state is made per call (one per model)."""
    hook = _hook_type(handler.comm_hook, "comm_hook", tuple(Hook))
    wrapper = _hook_type(handler.comm_wrapper, "comm_wrapper", (Hook.NO, Hook.FP16, Hook.BF16))
    options = handler.comm_state_option
    if not isinstance(options, dict):
        raise HfBackendError(f"DistributedDataParallelKwargs(comm_state_option={options!r}): give a dict of "
                             "PowerSGD options, e.g. {'matrix_approximation_rank': 2}")
    if hook not in _POWER_SGD:
        if wrapper is not Hook.NO:
            raise HfBackendError(f"DistributedDataParallelKwargs(comm_wrapper={wrapper.value!r}) compresses around "
                                 "a PowerSGD hook: set comm_hook='power_sgd', or use comm_hook="
                                 f"{wrapper.value!r} alone")
        if options:
            raise HfBackendError("DistributedDataParallelKwargs(comm_state_option=...) holds PowerSGD's options: set "
                                 "comm_hook='power_sgd' or 'batched_power_sgd', or leave it empty")
    if hook is Hook.NO:
        return None
    _check_torch_can_run(hook, wrapper)
    state = _power_sgd_state(options) if hook in _POWER_SGD else None
    fn = _HOOKS[hook]
    if wrapper is not Hook.NO:
        fn = _WRAPPERS[wrapper](fn)
    return fn, state


def _power_sgd_state(options: dict) -> powerSGD_hook.PowerSGDState:
    allowed = [name for name in inspect.signature(powerSGD_hook.PowerSGDState).parameters if name != "process_group"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise HfBackendError(f"DistributedDataParallelKwargs(comm_state_option=...): unknown PowerSGD option "
                             f"{unknown[0]!r}; use {', '.join(allowed)}")
    try:
        return powerSGD_hook.PowerSGDState(None, **options)  # None: the default process group
    except (TypeError, ValueError) as err:
        raise HfBackendError(f"DistributedDataParallelKwargs(comm_state_option={options}): "
                             f"{' '.join(str(err).split())}") from None


def _bf16_supported() -> bool:
    """torch's own condition for its bf16 hooks (`DistributedDataParallel._check_comm_hook`): a CUDA (or ROCm) build
    with NCCL >= 2.10, or XPU with XCCL. gloo all-reduces bf16 fine; it is torch that refuses on a CPU-only build."""
    dist = torch.distributed
    if torch.version.cuda is not None or torch.version.hip is not None:
        with contextlib.suppress(Exception):
            if dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10):
                return True
    with contextlib.suppress(Exception):
        return bool(dist.is_xccl_available() and torch.xpu.is_available())
    return False


@functools.cache
def _batched_power_sgd_works() -> bool:
    """torch 2.13's batched_powerSGD_hook passes 2-D matrices to an orthogonalization that asserts 3-D (batched)
    ones, so it fails on its first compressed step on any device; probe that function rather than a version."""
    try:
        powerSGD_hook._orthogonalize(torch.ones(4, 1))
    except AssertionError:
        return False
    return True


def _check_torch_can_run(hook: Hook, wrapper: Hook) -> None:
    if Hook.BF16 in (hook, wrapper) and not _bf16_supported():
        field = "comm_hook" if hook is Hook.BF16 else "comm_wrapper"
        raise HfBackendError(f"DistributedDataParallelKwargs({field}='bf16'): torch allows its bf16 hooks only in a "
                             "CUDA build with NCCL >= 2.10 (or XPU); this torch has neither: use 'fp16'")
    if hook is Hook.BATCHED_POWER_SGD and not _batched_power_sgd_works():
        raise HfBackendError(f"DistributedDataParallelKwargs(comm_hook='batched_power_sgd'): torch {torch.__version__}"
                             "'s batched_powerSGD_hook fails on its first compressed step; use comm_hook='power_sgd' "
                             "(comm_state_option={'batch_tensors_with_same_shape': True} batches same-shaped tensors)")

