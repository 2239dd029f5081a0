"""`CheckpointIO`: an Accelerator's training state to files and back.

The strategy says *what* a model's or optimizer's state is (a full state dict gathered to the main
process, or each process's shards, through torch's distributed state-dict API; DeepSpeed: gathered
from its ZeRO partitions); this module decides *where and how* it is written: full weights as
safetensors by the main process, shards as one DCP directory that every process writes into. Either
form loads under any strategy and world size, so a checkpoint resumes anywhere. What a checkpoint
holds is read once, from its verified metadata (index.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import HfBackendError
from ..runtime.process import ProcessState
from ..training.optim import EngineStepped
from ..training.precision import Precision
from ..training.prepared import PreparedObjects
from . import adapters, durable, layout, manifest, param_groups
from . import async_save as async_save_
from .directories import automatic_saved, stage
from .files import (
    capture_rng,
    check_loaded,
    load_custom_object,
    load_file,
    read_weights,
    restore_rng,
    tied_weight_keys,
    write_weights,
)
from .index import CheckpointIndex, read_index
from .safe_load import check_dcp, dcp_load

# strategies are not imported at run time: checkpoint/ loads without FSDP and DeepSpeed
if TYPE_CHECKING:
    from ..strategies.base import Strategy


class CheckpointIO:
    """Every read and write of training state; built by the Accelerator, used by it, hf_backend.Trainer
    and hf_backend.ray_train (`accelerator.checkpoint_io`). Every method is called on every process.
    """

    def __init__(self, process: ProcessState, strategy: Strategy, precision: Precision, prepared: PreparedObjects,
                 progress: Callable[[], dict[str, Any]]) -> None:
        self.process = process
        self.strategy = strategy
        self.precision = precision
        self.prepared = prepared
        self.progress = progress  # the facade's counters, written into the metadata
        self.saves = async_save_.AsyncSaves()  # the async save still under way, if any
        self._save_group: Any = None
        self.last_read: CheckpointIndex | None = None  # the checkpoint `read` restored last

    @property
    def sharded(self) -> bool:
        """Whether model and optimizer states are written as each process's shards."""
        return self.strategy.sharded_checkpoints

    # -- whole checkpoints -------------------------------------------------------------------------
    def save(self, target: str | os.PathLike, objects: PreparedObjects | None = None, project: Any = None, *,
             automatic: bool = False, safe_serialization: bool = True, on_each_node: bool | None = None,
             async_save: bool | None = None) -> Path:
        """`write` into a new directory `target`, staged so that it appears complete or not at all, and
        durable (fsynced) once it does. `project`: the ProjectConfiguration whose
        `save_on_each_node` and `async_save` apply where these arguments are None; `automatic`:
        `target` is its next automatic checkpoint, whose iteration counts on now and whose rotation
        runs once it is in place. `on_each_node` is only meaningful on one node.
        `async_save`: return once the state is in host memory; the files are written in the
        background and the checkpoint appears at the next `wait()` (async_save.py)."""
        self.wait()
        on_each_node = bool(getattr(project, "save_on_each_node", False) if on_each_node is None else on_each_node)
        async_save = bool(getattr(project, "async_save", False) if async_save is None else async_save)
        self.check_on_each_node(on_each_node, "save_state")
        target = Path(target)
        if target.exists() and not target.is_dir():
            raise HfBackendError(f"save_state: {target} is a file, not a checkpoint directory; "
                                 "pass a directory (the file is left as it is)")
        writes = async_save_.Writes(async_save, self.save_group() if async_save and self.sharded else None)
        staging = stage(target, self.process)
        self.write(staging.path, objects, safe_serialization=safe_serialization, writes=writes)
        after = automatic_saved(project, self.process) if automatic else None
        pending = async_save_.PendingSave(staging, writes, manifest.seal, after)
        if async_save:
            self.saves.put(pending)
            return target
        return pending.finish()

    def wait(self) -> Path | None:
        """Finish an async save still under way (every process): its checkpoint is in place when this
        returns, or its failure raises here. Returns its directory, or None when none was pending.
        """
        return self.saves.wait()

    def save_group(self) -> Any:
        """The gloo group the background writer's `dcp.save` coordinates on, apart from training's
        (async_save.py); made once, by every process."""
        if self._save_group is None and self.process.distributed:
            self._save_group = torch.distributed.new_group(backend="gloo")
        return self._save_group

    def write(self, directory: str | os.PathLike, objects: PreparedObjects | None = None, *, rng: bool = True,
              scaler: bool = True, extra: dict[str, Any] | None = None, safe_serialization: bool = True,
              on_each_node: bool = False, writes: async_save_.Writes | None = None) -> None:
        """Write `objects` (default: everything prepared and registered) into the existing `directory`,
        unstaged; `rng` / `scaler`: also this process's random states / the fp16 loss scaler
        (hf_backend.Trainer leaves both to transformers); `extra` replaces the facade's counters in
        the metadata. `on_each_node`: the files the main process writes are written by each node's
        local main process (nodes without a shared filesystem); models and optimizers cannot be,
        their states are gathered to (or coordinated by) global rank 0. `writes`: where model and
        optimizer states go (default: written now). The names of full optimizer and scheduler files
        follow from the metadata's `written_by` (a Trainer checkpoint's are transformers':
        layout.state_files)."""
        directory, objects = Path(directory), objects if objects is not None else self.prepared
        files = layout.state_files(extra or {})
        writes = writes if writes is not None else async_save_.Writes()
        if objects.models or objects.optimizers:
            self.check_on_each_node(on_each_node, "save_on_each_node with models or optimizers")
        if rng:
            torch.save(capture_rng(), directory / layout.rng_file(self.process.process_index))
        for i, model in enumerate(objects.models):
            self.save_weights(model, directory, layout.model_stem(i), safe_serialization, writes)
        for i, optimizer in enumerate(objects.optimizers):
            self.save_optimizer(optimizer, directory, layout.optimizer_stem(i), writes, files)
        if not (self.process.is_local_main_process if on_each_node else self.process.is_main_process):
            return
        for i, scheduler in enumerate(objects.schedulers):
            torch.save(scheduler.state_dict(), directory / files.scheduler(i))
        for i, loader in enumerate(objects.dataloaders):
            torch.save(loader.state_dict(), directory / layout.dataloader_file(i))
        for i, obj in enumerate(objects.custom):
            torch.save(obj.state_dict(), directory / layout.custom_file(i))
        grad_scaler = self.precision.scaler if scaler else None
        if grad_scaler is not None:
            torch.save(grad_scaler.state_dict(), directory / layout.SCALER)
        meta = {"format_version": layout.FORMAT_VERSION, "num_processes": self.process.num_processes,
                "strategy": self.strategy.distributed_type.value, "counts": objects.counts(),
                "scaler": grad_scaler is not None,
                **(self.progress() if extra is None else extra)}
        (directory / layout.METADATA).write_text(json.dumps(meta, indent=2))

    def read(self, source: str | os.PathLike | CheckpointIndex, objects: PreparedObjects | None = None, *,
             rng: bool = True, scaler: bool = True, models_taken_by_hooks: bool = False) -> CheckpointIndex:
        """Restore `objects` (default: everything prepared and registered) from the checkpoint `source`
        (a directory, verified here, or the index of one already verified); returns its index.
        `models_taken_by_hooks`: load-state hooks load some models themselves, so fewer models than
        the checkpoint holds are read (in order, as Accelerate does)."""
        index = source if isinstance(source, CheckpointIndex) else read_index(source)
        objects = objects if objects is not None else self.prepared
        for kind, saved in index.counts.items():
            have = len(getattr(objects, kind))
            if saved != have and not (kind == "models" and models_taken_by_hooks and have < saved):
                raise HfBackendError(
                    f"load_state: {index.directory} holds {saved} {kind} but {have} are "
                    "prepared/registered; prepare and register the same objects, in the same "
                    "order, as the run that saved it")
        states = self._read_files(index, objects, rng, scaler)
        for i, model in enumerate(objects.models):
            self.load_weights(model, index, layout.model_stem(i))
        maps = [self.load_optimizer(optimizer, index, layout.optimizer_stem(i), states["optimizers"][i])
                for i, optimizer in enumerate(objects.optimizers)]
        for i, (scheduler, state) in enumerate(zip(objects.schedulers, states["schedulers"])):
            # scheduler i steps optimizer i
            mapping = maps[i] if len(maps) == len(objects.schedulers) else None
            scheduler.load_state_dict(state if mapping is None else
                                      param_groups.fit_scheduler_state(state, mapping, scheduler.state_dict()))
        for loader, state in zip(objects.dataloaders, states["dataloaders"]):
            loader.load_state_dict(state)
        for obj, state in zip(objects.custom, states["custom"]):
            obj.load_state_dict(state)
        if states["scaler"] is not None:
            assert self.precision.scaler is not None  # _read_files reads the scaler's file only then
            self.precision.scaler.load_state_dict(states["scaler"])
        if states["rng"] is not None:
            restore_rng(states["rng"])
        self.last_read = index
        return index

    def _read_files(self, index: CheckpointIndex, objects: PreparedObjects, rng: bool,
                    scaler: bool) -> dict[str, Any]:
        """Every file `read` loads from, read (and refused when it holds more than plain data) before
        any state changes; DCP directories are checked (metadata and non-tensor values) and read
        later, into the model."""
        directory = index.directory
        files: dict[str, Any] = {
            "schedulers": [load_file(index.scheduler_file(i)) for i in range(len(objects.schedulers))],
            "dataloaders": [load_file(directory / layout.dataloader_file(i)) for i in range(len(objects.dataloaders))],
            "custom": [load_custom_object(directory / layout.custom_file(i)) for i in range(len(objects.custom))],
            "scaler": load_file(directory / layout.SCALER)
            if scaler and self.precision.scaler is not None and index.meta.get("scaler") else None,
            # None: shards, read into the optimizer later
            "optimizers": [None] * len(objects.optimizers),
        }
        rng_file = directory / layout.rng_file(self.process.process_index)
        files["rng"] = load_file(rng_file) if rng and rng_file.is_file() else None
        for i in range(len(objects.models)):
            if index.sharded(layout.model_stem(i)):
                check_dcp(index.shards(layout.model_stem(i)))
        for i in range(len(objects.optimizers)):
            stem = layout.optimizer_stem(i)
            if index.sharded(stem):
                check_dcp(index.shards(stem))
            else:
                # copied in later
                files["optimizers"][i] = load_file(index.optimizer_file(stem), mmap=True)
        return files

    # -- one model or optimizer --------------------------------------------------------------------
    def save_weights(self, model: torch.nn.Module, directory: str | os.PathLike, stem: str = "model",
                     safe_serialization: bool = True, writes: async_save_.Writes | None = None) -> None:
        """The model's weights as a checkpoint holds them: each process's shards when `sharded`, else
        full files."""
        directory, writes = Path(directory), writes if writes is not None else async_save_.Writes()
        if self.sharded:
            writes.shards({"model": self.strategy.model_state_dict(model, sharded=True)},
                          directory / layout.sharded_dir(stem))
        else:
            state_dict = self.strategy.model_state_dict(model, masters=True)
            if self.process.is_main_process:
                tied = tied_weight_keys(self.strategy.unwrap_model(model))
                state_dict = writes.snapshot(state_dict)
                writes.file(lambda: full_weights(state_dict, directory, stem, safe_serialization, tied))

    def load_weights(self, model: torch.nn.Module, source: str | os.PathLike | CheckpointIndex,
                     stem: str = "model") -> None:
        """Weights into the prepared model: from a checkpoint (its index says which form), or from a
        directory of full weights (transformers' Trainer checkpoint, `save_model`'s output)."""
        if isinstance(source, CheckpointIndex) and source.sharded(stem):
            state_dict = {"model": self.strategy.model_state_dict(model, sharded=True)}
            dcp_load(state_dict, source.shards(stem))
            self.strategy.load_model_state_dict(model, state_dict["model"], sharded=True)
            return
        directory = source.directory if isinstance(source, CheckpointIndex) else Path(source)
        result = self.strategy.load_model_state_dict(model, read_weights(directory, stem))
        check_loaded(self.strategy.unwrap_model(model), result, directory)

    def trainable_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full weights of the trainable parameters only (a PEFT adapter's), as a checkpoint holds
        them (DeepSpeed: the fp32 masters): the frozen base is not gathered. Collective; the main
        process gets the tensors."""
        return self.strategy.model_state_dict(model, trainable_only=True, masters=True)

    def load_adapter(self, model: torch.nn.Module, directory: str | os.PathLike) -> None:
        """The adapter weights PEFT wrote into `directory` (a checkpoint of a PEFT model, under any
        strategy) into the prepared PEFT model; the frozen base keeps the weights it was built with.
        """
        path = layout.adapter_weights_file(directory)
        if path is None:
            raise HfBackendError(f"{directory} holds no {layout.ADAPTER_WEIGHTS[0]}; resume a PEFT "
                                 "model from a checkpoint written with its adapter")
        unwrapped = self.strategy.unwrap_model(model)
        state_dict = adapters.to_model_names(unwrapped, read_weights(path.parent, path.name.split(".")[0]), path)
        result = self.strategy.load_model_state_dict(model, state_dict)
        if result.unexpected_keys:
            raise HfBackendError(f"{path} does not fit the model: unexpected "
                                 f"{list(result.unexpected_keys)[:5]}; "
                                 "resume with the model it was saved from")

    def save_optimizer(self, optimizer: Any, directory: str | os.PathLike, stem: str = "optimizer",
                       writes: async_save_.Writes | None = None,
                       files: layout.FullStateFiles = layout.STATE_FILES) -> None:
        """Each process's shards into `<stem>_dcp/` when `sharded`, else the full state keyed by
        parameter names (in the order of the param groups, which torch's `Optimizer.load_state_dict`
        also reads) in one file."""
        inner, model = self._optimizer_and_model(optimizer)
        directory, writes = Path(directory), writes if writes is not None else async_save_.Writes()
        if self.sharded:
            writes.shards({"optimizer": self.strategy.optimizer_state_dict(model, inner, sharded=True)},
                          directory / layout.sharded_dir(stem))
            return
        state_dict = self.strategy.optimizer_state_dict(model, inner)
        if self.process.is_main_process:
            state_dict = writes.snapshot(state_dict)
            writes.file(lambda: durable.torch_file(state_dict, directory / files.optimizer(stem)))

    def load_optimizer(self, optimizer: Any, index: CheckpointIndex, stem: str = "optimizer",
                       state: dict[str, Any] | None = None) -> param_groups.GroupMap | None:
        """Read the shards `<stem>_dcp/` or the full file (`state`: its contents, already read).
        Returns how the saved param groups were fitted to this optimizer's (param_groups.py), if
        they were."""
        if not index.sharded(stem):
            return self._load_full_optimizer(optimizer, index.optimizer_file(stem), state)
        inner, model = self._optimizer_and_model(optimizer)
        state_dict = {"optimizer": self.strategy.optimizer_state_dict(model, inner, sharded=True)}
        dcp_load(state_dict, index.shards(stem))
        self.strategy.load_optimizer_state_dict(model, inner, state_dict["optimizer"], sharded=True)
        return None

    def _load_full_optimizer(self, optimizer: Any, path: Path,
                             state: dict[str, Any] | None = None) -> param_groups.GroupMap | None:
        """A full optimizer state keyed by parameter names or, as torch's own `optimizer.state_dict()`
        (transformers' `optimizer.pt`), by position."""
        inner, model = self._optimizer_and_model(optimizer)
        unwrapped = self.strategy.unwrap_model(model)
        groups = self.strategy.optimizer_parameters(model, inner)
        state_dict = keyed_by_name(load_file(path, mmap=True) if state is None else state, groups, unwrapped, path)
        mapping = param_groups.group_map([len(g["params"]) for g in state_dict.get("param_groups", [])],
                                         [len(params) for params in groups], path)
        if mapping is not None:
            state_dict = param_groups.fit_optimizer_state(state_dict, mapping, inner.param_groups)
        self.strategy.load_optimizer_state_dict(model, inner, into_live_state(state_dict, inner, unwrapped))
        return mapping

    def read_trainer_optimizer(self, optimizer: Any, scheduler: Any, directory: str | os.PathLike) -> None:
        """transformers' `optimizer.pt` (keyed by position) and `scheduler.pt` into a prepared
        optimizer and
        scheduler: how a checkpoint of transformers.Trainer (without DeepSpeed) resumes on the
        engine."""
        # positional: same groups
        self._load_full_optimizer(optimizer, Path(directory) / layout.TRAINER_OPTIMIZER)
        scheduler.load_state_dict(load_file(Path(directory) / layout.TRAINER_SCHEDULER))

    def save_pretrained(self, model: torch.nn.Module, directory: str | os.PathLike, max_shard_size: int | str,
                        safe_serialization: bool) -> None:
        """Full weights in the layout `from_pretrained` reads, with the model's config.json when it has
        one."""
        state_dict = self.strategy.model_state_dict(model)
        if not self.process.is_main_process:
            return
        directory = Path(directory)
        if directory.is_file():
            raise HfBackendError(f"save_model: {directory} is a file; pass a directory")
        directory.mkdir(parents=True, exist_ok=True)
        inner = self.strategy.unwrap_model(model)
        write_weights(state_dict, directory, filename_stem=layout.PRETRAINED_STEM, max_shard_size=max_shard_size,
                      safe_serialization=safe_serialization, tied_keys=tied_weight_keys(inner))
        config = getattr(inner, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)

    def check_on_each_node(self, on_each_node: bool, what: str) -> None:
        """Refuse node-local checkpoints where they cannot work: a job of several nodes, for `what`.
        """
        if on_each_node and self.process.num_processes > self.process.local_num_processes:
            raise HfBackendError(f"{what} across "
                                 f"{self.process.num_processes // self.process.local_num_processes} "
                                 "nodes: checkpoints need a filesystem every node shares; put "
                                 "the output directory there and set save_on_each_node=False")

    def _optimizer_and_model(self, optimizer: Any) -> tuple[torch.optim.Optimizer, torch.nn.Module]:
        """The torch optimizer inside a prepared one, and the prepared model whose parameters it
        updates."""
        inner = getattr(optimizer, "optimizer", optimizer)
        # the engine's optimizer steps partitions: the engine says whose
        if isinstance(inner, EngineStepped):
            return inner, inner.model
        ids = {id(p) for group in inner.param_groups for p in group["params"]}
        for model in self.prepared.models:
            if any(id(p) in ids for p in model.parameters()):
                return inner, getattr(model, "_orig_mod", model)  # inside a torch.compile wrapper
        raise HfBackendError("an optimizer's parameters belong to no "
                             "prepared model; prepare the model with it")


def full_weights(state_dict: dict[str, torch.Tensor], directory: Path, stem: str, safe_serialization: bool,
                 tied: list[str]) -> durable.Digests:
    """Full weights of a checkpoint: one safetensors file written from the tensors' memory and hashed
    while written (durable.py); huggingface_hub's writer for `.bin` files, dtypes safetensors lacks,
    or more than 10 GB."""
    tensors = durable.without_aliases({k: v.detach().cpu() for k, v in state_dict.items()}, tied)
    if safe_serialization and durable.writable(tensors) and \
            sum(t.numel() * t.element_size() for t in tensors.values()) <= 10 * 10**9:
        return durable.safetensors_file(tensors, directory / f"{stem}.safetensors", {"format": "pt"})
    write_weights(state_dict, directory, filename_stem=stem, safe_serialization=safe_serialization, tied_keys=tied)
    return {}


def keyed_by_name(state_dict: dict[str, Any], groups: list[list[torch.nn.Parameter]], model: torch.nn.Module,
                  path: Path) -> dict[str, Any]:
    """A full optimizer state keyed by parameter names. torch's `optimizer.state_dict()` numbers the
    parameters in the order of its param groups; the same groups of this optimizer (`groups`: the
    model's parameters in each, `Strategy.optimizer_parameters`) say which parameter each number is."""
    saved = state_dict.get("param_groups", [])
    if not any(isinstance(p, int) for group in saved for p in group["params"]):
        return state_dict  # already by name
    shapes, mine = [len(g["params"]) for g in saved], [len(params) for params in groups]
    if shapes != mine:
        raise HfBackendError(f"{path}: its optimizer has param groups of {shapes} parameters, this "
                             f"one {mine}; resume with the optimizer set up as when it was saved")
    names = {id(p): n for n, p in model.named_parameters()}
    name_of = {i: names[id(p)] for group, params in zip(saved, groups) for i, p in zip(group["params"], params)}
    return {"state": {name_of[i]: value for i, value in state_dict.get("state", {}).items()},
            "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]} for group in saved]}


def into_live_state(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer,
                    model: torch.nn.Module) -> dict[str, Any]:
    """A full optimizer state keyed by parameter names, read with its tensors mapping the file, made
    ready to load: a tensor the optimizer already holds (same shape, dtype and device: a state
    loaded into a trained optimizer) is copied into and kept, so loading costs one copy from the
    page cache; the state of a plain CPU parameter that has none yet is copied into fresh memory, so
    that no optimizer state stays backed by the file. The rest (a sharded or GPU parameter's) is
    left mapped: the strategy copies it where it goes."""
    params = dict(model.named_parameters())
    live_state = getattr(optimizer, "state", {})
    out: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for name, entries in state_dict.get("state", {}).items():
            param = params.get(name)
            live = live_state.get(param, {}) if param is not None else {}
            plain_cpu = param is not None and type(param) in (torch.Tensor, torch.nn.Parameter) \
                and param.device.type == "cpu"
            out[name] = {key: _into(value, live.get(key), plain_cpu) for key, value in entries.items()}
    return {**state_dict, "state": out}


def _into(value: Any, live: Any, plain_cpu: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if type(live) is torch.Tensor and (live.shape, live.dtype, live.device) == (value.shape, value.dtype,
                                                                                 value.device):
        return live.copy_(value)
    return value.clone() if plain_cpu else value


# -- Accelerate's save/load-state hooks ------------------------------------------------------------
def apply_save_hooks(hooks: Iterable[Callable], objects: PreparedObjects, output_dir: str | os.PathLike,
                     state_dict: Callable[[torch.nn.Module], dict]) -> PreparedObjects:
    """Run `register_save_state_pre_hook` hooks as `hook(models, weights, output_dir)`; a model whose
    state dict a hook removed from `weights` is left out of the checkpoint (the hook saves it its
    own way)."""
    hooks = list(hooks)
    if not hooks:
        return objects
    weights = [state_dict(model) for model in objects.models]
    kept = list(weights)
    for hook in hooks:
        hook(objects.models, kept, str(output_dir))
    return objects.with_models([m for m, w in zip(objects.models, weights) if any(w is k for k in kept)])


def apply_load_hooks(hooks: Iterable[Callable], objects: PreparedObjects,
                     input_dir: str | os.PathLike) -> PreparedObjects:
    """Run `register_load_state_pre_hook` hooks as `hook(models, input_dir)`; a model a hook removed
    from `models` is not loaded (the hook loads it its own way)."""
    hooks = list(hooks)
    if not hooks:
        return objects
    models = list(objects.models)
    for hook in hooks:
        hook(models, str(input_dir))
    return objects.with_models(models)


__all__ = ["CheckpointIO", "full_weights", "apply_load_hooks", "apply_save_hooks", "into_live_state", "keyed_by_name"]
