"""The one interface every way of wrapping a model (one process, DDP, FSDP, DeepSpeed) implements.

The Accelerator picks a strategy once and routes every model-touching call through it; it never asks which one it has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms.join import Join
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint import check_loaded, load_file, read_state_dict, tied_weight_keys, write_weights
from ..errors import HfBackendError
from ..log import note
from ..optim import DummyScheduler
from ..options import Handlers
from ..precision import Precision
from ..state import DistributedType, ProcessState


def is_compiled_module(module: torch.nn.Module) -> bool:
    """A `torch.compile(...)` wrapper."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True,
                                is_wrapper: Callable[[torch.nn.Module], bool] | None = None) -> torch.nn.Module:
    """Strip parallel wrappers (DDP, `nn.DataParallel`, a DeepSpeed engine, or what `is_wrapper` says) and, unless
    `keep_torch_compile`, the torch.compile wrapper."""
    wrappers = (DistributedDataParallel, torch.nn.DataParallel)
    while True:
        wrapped = isinstance(model, wrappers) or type(model).__name__ == "DeepSpeedEngine"
        if wrapped or (is_wrapper is not None and is_wrapper(model)):
            inner = getattr(model, "module", None)
        else:
            inner = None if keep_torch_compile or not is_compiled_module(model) else model._orig_mod
        if not isinstance(inner, torch.nn.Module):
            if not keep_fp32_wrapper:
                from ..precision import Precision

                Precision.unwrap_forward(model)
            return model
        model = inner


class Strategy:
    """Defaults are those of a plain, unwrapped model on one device; subclasses override what they change."""

    distributed_type = DistributedType.NO
    plugin: Any = None  # the FSDP / DeepSpeed plugin in effect, as `accelerator.state` shows it

    def __init__(self, state: ProcessState, precision: Precision, handlers: Handlers) -> None:
        self.state = state
        self.precision = precision
        self.handlers = handlers
        self.models: list[torch.nn.Module] = []  # prepared by this strategy, in order

    # -- preparing ---------------------------------------------------------------------------------------------------
    def setup_model(self, model: torch.nn.Module, device_placement: bool = True,
                    evaluation_mode: bool = False) -> torch.nn.Module:
        if device_placement:
            model = model.to(self.state.device)
        self.precision.wrap_forward(model)
        self.models.append(model)
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise HfBackendError(f"prepare(): {type(optimizer).__name__} is not a torch optimizer (DummyOptim stands "
                                 "in for a DeepSpeed config's optimizer and needs DeepSpeed)")
        return optimizer

    def setup_scheduler(self, scheduler: Any) -> Any:
        if isinstance(scheduler, DummyScheduler):
            raise HfBackendError("DummyScheduler stands in for a DeepSpeed config's scheduler; use a torch scheduler "
                                 "without DeepSpeed")
        return scheduler

    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool = False) -> torch.nn.Module:
        """The user's module: no parallel wrapper, ours or the user's own `nn.DataParallel` (and no torch.compile
        wrapper unless `keep_torch_compile`)."""
        return extract_model_from_parallel(model, keep_torch_compile=keep_torch_compile, is_wrapper=self.is_wrapper)

    def is_wrapper(self, model: torch.nn.Module) -> bool:
        return False

    def compile_model(self, model: torch.nn.Module, plugin: Any) -> torch.nn.Module:
        """torch.compile around the prepared (wrapped) model, as Accelerate does: DDP's and FSDP2's hooks stay
        outside the compiled graphs (dynamo's DDPOptimizer splits the graphs at DDP's bucket boundaries)."""
        return torch.compile(model, **plugin.compile_kwargs())

    # -- training step -----------------------------------------------------------------------------------------------
    def bind(self, objects: list[Any]) -> None:
        """Called by `prepare` with everything passed in one call, before any of it is prepared (DeepSpeed builds
        its engine from the model, optimizer and loader together)."""

    def backward(self, loss: torch.Tensor, accumulation_steps: int, sync: bool, **kwargs: Any) -> None:
        """Backward of one micro step; `sync` says whether it ends an accumulation window."""
        self.precision.scale_and_backward(loss / accumulation_steps if accumulation_steps > 1 else loss, **kwargs)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A block whose backward synchronizes although it runs under `no_sync` (only DDP needs to do anything)."""
        return contextlib.nullcontext()

    def join(self, joinables: list) -> contextlib.AbstractContextManager:
        """Context for processes whose loaders run out at different steps. One process has nothing to join."""
        if not self.state.distributed:
            note("join_uneven_inputs in a single process: nothing to join")
            return contextlib.nullcontext()
        return Join(joinables)

    def state_plugins(self) -> dict[str, Any]:
        """The plugin `accelerator.state` shows, under Accelerate's name (fsdp_plugin, deepspeed_plugin)."""
        return {}

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    # -- state -------------------------------------------------------------------------------------------------------
    # A checkpoint holds each model and optimizer either as full files written by the main process (safetensors,
    # `optimizer.bin`, both keyed by parameter names) or as a DCP directory (`<stem>_dcp/`) that every process wrote
    # its shards into. Every strategy reads both through torch's distributed state-dict API, so a checkpoint resumes
    # under another strategy or world size.
    sharded_checkpoints = False
    save_options = StateDictOptions()  # how full states are taken from this strategy's models
    load_options = StateDictOptions(strict=False)  # how full states are given back (missing tied keys checked)

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict; collective for sharded strategies, so call it on every process."""
        return get_model_state_dict(model, options=self.save_options)

    def save_model_state(self, model: torch.nn.Module, directory: Path, stem: str, safe_serialization: bool) -> None:
        if self.sharded_checkpoints:
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(Path(directory) / f"{stem}_dcp"))
            return
        state_dict = self.model_state_dict(model)
        if self.state.is_main_process:
            write_weights(state_dict, directory, filename_stem=stem, safe_serialization=safe_serialization,
                          tied_keys=tied_weight_keys(self.unwrap_model(model)))

    def load_model_state(self, model: torch.nn.Module, directory: Path, stem: str) -> None:
        sharded = Path(directory) / f"{stem}_dcp"
        if sharded.is_dir():
            state_dict = {"model": get_model_state_dict(model)}
            dcp.load(state_dict, checkpoint_id=str(sharded))
            set_model_state_dict(model, state_dict["model"])
        else:
            result = set_model_state_dict(model, read_state_dict(directory, stem), options=self.load_options)
            check_loaded(self.unwrap_model(model), result, directory)

    def save_optimizer_state(self, optimizer: Any, directory: Path, name: str) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        model = self.model_of(inner)
        if self.sharded_checkpoints:
            dcp.save({"optimizer": get_optimizer_state_dict(model, inner)},
                     checkpoint_id=str(Path(directory) / f"{name}_dcp"))
            return
        state_dict = get_optimizer_state_dict(model, inner, options=self.save_options)
        if self.state.is_main_process:
            torch.save(state_dict, Path(directory) / f"{name}.bin")

    def load_optimizer_state(self, optimizer: Any, directory: Path, name: str, filename: str | None = None) -> None:
        """Read `<name>_dcp/` or the full file `filename` (default `<name>.bin`), keyed by parameter names or, as
        torch's own `optimizer.state_dict()` (transformers' `optimizer.pt`), by position."""
        inner = getattr(optimizer, "optimizer", optimizer)
        model = self.model_of(inner)
        sharded = Path(directory) / f"{name}_dcp"
        if sharded.is_dir() and filename is None:
            state_dict = {"optimizer": get_optimizer_state_dict(model, inner)}
            dcp.load(state_dict, checkpoint_id=str(sharded))
            set_optimizer_state_dict(model, inner, state_dict["optimizer"])
        else:
            path = Path(directory) / (filename or f"{name}.bin")
            state_dict = _keyed_by_name(load_file(path), inner, self.unwrap_model(model), path)
            set_optimizer_state_dict(model, inner, state_dict, options=self.load_options)

    def model_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The prepared model whose parameters `optimizer` updates."""
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in self.models:
            if any(id(p) in ids for p in model.parameters()):
                return model
        raise HfBackendError("an optimizer's parameters belong to no prepared model; prepare the model with it")


def _keyed_by_name(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                   path: Path) -> dict[str, Any]:
    """A full optimizer state keyed by parameter names. torch's `optimizer.state_dict()` numbers the parameters in
    the order of its param groups; the same groups of this optimizer say which parameter each number is."""
    saved = state_dict.get("param_groups", [])
    if not any(isinstance(p, int) for group in saved for p in group["params"]):
        return state_dict  # already by name
    shapes, mine = [len(g["params"]) for g in saved], [len(g["params"]) for g in optimizer.param_groups]
    if shapes != mine:
        raise HfBackendError(f"{path}: its optimizer has param groups of {shapes} parameters, this one {mine}; "
                             "resume with the optimizer set up as when it was saved")
    names = {id(p): n for n, p in model.named_parameters()}
    name_of = {i: names[id(p)] for group, mine in zip(saved, optimizer.param_groups)
               for i, p in zip(group["params"], mine["params"])}
    return {"state": {name_of[i]: value for i, value in state_dict.get("state", {}).items()},
            "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]} for group in saved]}
