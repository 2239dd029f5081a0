"""Data parallel over processes with torch's DistributedDataParallel (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from ..config.options import DistributedDataParallelKwargs
from ..core.enums import DDPCommunicationHookType as Hook
from ..core.enums import DistributedType
from ..core.errors import HfBackendError
from ..runtime.collectives import reduce_flat
from .base import Strategy
from .capabilities import Joinable, ValueClipping

_POWER_SGD = (Hook.POWER_SGD, Hook.BATCHED_POWER_SGD)
_HOOKS: dict[Hook, Callable[..., Any]] = {
    Hook.FP16: default_hooks.fp16_compress_hook, Hook.BF16: default_hooks.bf16_compress_hook,
    Hook.POWER_SGD: powerSGD_hook.powerSGD_hook, Hook.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
_WRAPPERS = {Hook.FP16: default_hooks.fp16_compress_wrapper, Hook.BF16: default_hooks.bf16_compress_wrapper}


class DDPStrategy(Strategy, Joinable, ValueClipping):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # find_unused_parameters=None, first step not taken yet
        self._unprobed: list[DistributedDataParallel] = []

    @property
    def distributed_type(self) -> DistributedType:  # type: ignore[override]
        return self.process.distributed_type  # MULTI_GPU or MULTI_CPU, as the process state decides

    def setup_model(self, model: torch.nn.Module, device_placement: bool = True,
                    evaluation_mode: bool = False) -> torch.nn.Module:
        model = super().setup_model(model, device_placement)
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronize (a model only evaluated, or frozen)
        # before DDP builds its buckets from the parameters' dtypes
        self.precision.keep_fp32_masters(model)
        kwargs, hook = self._ddp_arguments()  # a bad option fails before any collective
        find_once = kwargs.get("find_unused_parameters", False) is None
        ddp = self._wrap(model, {**kwargs, "find_unused_parameters": False} if find_once else kwargs, hook)
        # the first step runs without DDP's reducer; `_first_reduction` all-reduces it and decides
        if find_once:
            ddp.require_backward_grad_sync = False
            self._unprobed.append(ddp)
        return ddp

    def _ddp_arguments(self) -> tuple[dict[str, Any], tuple[Callable, Any] | None]:
        """DDP's keyword arguments and the communication hook. find_unused_parameters=None
        (hf_backend.Trainer's default) means: find them once, on the first synchronized step. With a
        hook or a static graph it means True and False (the first step's all-reduce would bypass the
        hook; a static graph finds them itself)."""
        hook = communication_hook(self.handlers.ddp)
        # DDP broadcasts rank 0's parameters and buffers at construction: ranks that seeded
        # differently agree. Under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo, DDP runs on a copy of the
        # group without torch's checks (its constructor crashes on the checked one) and its
        # gradients reach the checked group through the hook.
        group = unchecked_group()
        kwargs = self.handlers.ddp.ddp_kwargs()
        if group is not None:
            kwargs["process_group"] = group
            hook = hook or (default_hooks.allreduce_hook, None)  # None: the default (checked) group
        if kwargs.get("find_unused_parameters", False) is None and (hook is not None or kwargs.get("static_graph")):
            kwargs["find_unused_parameters"] = hook is not None
        return kwargs, hook

    def _wrap(self, model: torch.nn.Module, kwargs: dict[str, Any], hook: tuple[Callable, Any] | None,
              into: DistributedDataParallel | None = None) -> DistributedDataParallel:
        """DDP around `model`; `into` rebuilds an existing wrapper in place (the object the caller
        holds stays)."""
        device_ids = [self.process.device.index] if self.process.device.type == "cuda" else None
        if into is None:
            ddp = DistributedDataParallel(model, device_ids=device_ids, **kwargs)
        else:
            DistributedDataParallel.__init__(into, model, device_ids=device_ids, **kwargs)
            ddp = into
        if hook is not None:
            ddp.register_comm_hook(hook[1], hook[0])  # before the first backward, as DDP requires
        return ddp

    def backward(self, loss: torch.Tensor, accumulation_steps: int, sync: bool, **kwargs: Any) -> None:
        super().backward(loss, accumulation_steps, sync, **kwargs)
        if sync and self._unprobed:
            self._probe()

    def _probe(self) -> None:
        for ddp in [d for d in self._unprobed if any(p.grad is not None for p in d.parameters())]:
            self._unprobed.remove(ddp)
            # some parameter had no gradient somewhere: keep DDP's search
            if not _first_reduction(ddp):
                kwargs, hook = self._ddp_arguments()
                self._wrap(ddp.module, {**kwargs, "find_unused_parameters": True}, hook, into=ddp)
            ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True

    def is_wrapper(self, model: torch.nn.Module) -> bool:
        return isinstance(model, DistributedDataParallel)

    def join(self, joinables: list) -> contextlib.AbstractContextManager:
        return Join(joinables)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """DDP skips the all-reduce under `no_sync` through two flags; set them (and prepare the
        reducer, as DDP's forward would have) for the block, then restore them. Before the first
        step of find_unused_parameters=None the block runs without the reducer and that first step
        is all-reduced after it."""
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        if model in self._unprobed:
            yield
            self._probe()
            return
        saved = model.require_backward_grad_sync, model.require_forward_param_sync
        try:
            model.require_backward_grad_sync = model.require_forward_param_sync = True
            model.reducer.prepare_for_backward([])
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = saved

    def reset(self) -> None:
        super().reset()
        self._unprobed.clear()


def _first_reduction(ddp: DistributedDataParallel, bucket_bytes: int = 25 * 2**20) -> bool:
    """All-reduce the gradients of a step taken without DDP's reducer as DDP with
    find_unused_parameters=True would (each divided by the world size, then summed; a rank that did
    not use a parameter adds zeros; a parameter no rank used keeps no gradient), and say whether
    every parameter had a gradient on every rank."""
    group = ddp.process_group
    world = dist.get_world_size(group)
    params = [p for name, p in ddp.module.named_parameters()
              if p.requires_grad and name not in ddp.parameters_to_ignore]
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(used, group=group)
    reduced = [p for p, count in zip(params, used.tolist()) if count > 0]
    for p in reduced:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    reduce_flat([p.grad for p in reduced], lambda flat: dist.all_reduce(flat.div_(world), group=group),
                bucket_bytes=bucket_bytes)
    return bool((used == world).all())


# -- gradient communication hooks (DistributedDataParallelKwargs.comm_hook / comm_wrapper / comm_sta
def _hook_type(value: Any, field: str, choices: tuple[Hook, ...]) -> Hook:
    try:
        hook = Hook(getattr(value, "value", value))
    except ValueError:
        hook = None
    if hook not in choices:
        raise HfBackendError(f"DistributedDataParallelKwargs({field}={str(getattr(value, 'value', value))!r}): "
                             f"use one of {', '.join(repr(c.value) for c in choices)}")
    return hook


def communication_hook(handler: DistributedDataParallelKwargs) -> tuple[Callable, Any] | None:
    """The (hook, state) pair torch's `DistributedDataParallel.register_comm_hook` takes, or None for
    plain all-reduce. Every invalid combination is one line; a new PowerSGD state is made per call
    (one per model)."""
    hook = _hook_type(handler.comm_hook, "comm_hook", tuple(Hook))
    wrapper = _hook_type(handler.comm_wrapper, "comm_wrapper", (Hook.NO, Hook.FP16, Hook.BF16))
    options = handler.comm_state_option
    if not isinstance(options, dict):
        raise HfBackendError(f"DistributedDataParallelKwargs(comm_state_option={options!r}): give a dict of "
                             "PowerSGD options, e.g. {'matrix_approximation_rank': 2}")
    if hook not in _POWER_SGD:
        if wrapper is not Hook.NO:
            raise HfBackendError(f"DistributedDataParallelKwargs(comm_wrapper={wrapper.value!r}) "
                                 "compresses around a PowerSGD hook: set comm_hook='power_sgd', "
                                 f"or use comm_hook={wrapper.value!r} alone")
        if options:
            raise HfBackendError("DistributedDataParallelKwargs(comm_state_option=...) holds "
                                 "PowerSGD's options: set comm_hook='power_sgd' or "
                                 "'batched_power_sgd', or leave it empty")
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
        raise HfBackendError("DistributedDataParallelKwargs(comm_state_option=...): unknown "
                             f"PowerSGD option {unknown[0]!r}; use {', '.join(allowed)}")
    try:
        return powerSGD_hook.PowerSGDState(None, **options)  # None: the default process group
    except (TypeError, ValueError) as err:
        raise HfBackendError(f"DistributedDataParallelKwargs(comm_state_option={options}): "
                             f"{' '.join(str(err).split())}") from None


def _bf16_supported() -> bool:
    """torch's own condition for its bf16 hooks (`DistributedDataParallel._check_comm_hook`): a CUDA
    (or ROCm) build with NCCL >= 2.10, or XPU with XCCL. gloo all-reduces bf16 fine; it is torch
    that refuses on a CPU-only build."""
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
    """torch 2.13's batched_powerSGD_hook passes 2-D matrices to an orthogonalization that asserts 3-D
    (batched) ones, so it fails on its first compressed step on any device; probe that function
    rather than a version."""
    try:
        powerSGD_hook._orthogonalize(torch.ones(4, 1))
    except AssertionError:
        return False
    return True


def _check_torch_can_run(hook: Hook, wrapper: Hook) -> None:
    if Hook.BF16 in (hook, wrapper) and not _bf16_supported():
        field = "comm_hook" if hook is Hook.BF16 else "comm_wrapper"
        raise HfBackendError(f"DistributedDataParallelKwargs({field}='bf16'): torch allows its "
                             "bf16 hooks only in a CUDA build with NCCL >= 2.10 (or XPU); this "
                             "torch has neither: use 'fp16'")
    if hook is Hook.BATCHED_POWER_SGD and not _batched_power_sgd_works():
        raise HfBackendError(f"DistributedDataParallelKwargs(comm_hook='batched_power_sgd'): torch {torch.__version__}"
                             "'s batched_powerSGD_hook fails on its first compressed step; use comm_hook='power_sgd' "
                             "(comm_state_option={'batch_tensors_with_same_shape': True} batches same-shaped tensors)")


_UNCHECKED: list = []


def unchecked_group() -> Any:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL with gloo, a copy of the default group without torch's
    checking wrapper, for DDP (made once, by every rank); else None. torch's DDP constructor crashes
    (SIGSEGV in its logger, which takes the wrapper for gloo's own group) on the checked group; DDP
    on the copy sends its gradients through a hook on the checked group, so they are still checked.
    """
    if not dist.is_initialized() or dist.get_debug_level() != dist.DebugLevel.DETAIL:
        return None
    wrapper = getattr(torch._C._distributed_c10d, "_ProcessGroupWrapper", None)
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    if wrapper is None or not isinstance(backend, wrapper) or dist.get_backend() != "gloo":
        return None
    if not _UNCHECKED:
        level = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.INFO)
        try:
            _UNCHECKED.append(dist.new_group(backend="gloo"))
        finally:
            dist.set_debug_level(level)
    return _UNCHECKED[0]
