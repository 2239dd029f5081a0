"""`CheckpointIO`: an Accelerator's training state to files and back.

The strategy says *what* a model's or optimizer's state is (a full state dict gathered to the main process, or each
process's shards, through torch's distributed state-dict API; DeepSpeed: gathered from its ZeRO partitions); this
module decides *where and how* it is written: full weights as safetensors by the main process, shards as one DCP
directory that every process writes into. Either form loads under any strategy and world size, so a checkpoint
resumes anywhere (DeepSpeed's own format, written by earlier versions, only under DeepSpeed as it was).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import HfBackendError
from ..precision import Precision
from ..prepared import PreparedObjects
from ..state import ProcessState
from . import adapters, durable, layout, manifest, param_groups
from . import async_save as async_save_
from .directories import automatic_saved, interrupted_overwrite, stage
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
from .safe_load import check_dcp, dcp_load

if TYPE_CHECKING:  # strategies are not imported at run time: checkpoint/ loads without FSDP and DeepSpeed
    from ..strategies.base import Strategy


class CheckpointIO:
    """Every read and write of training state; built by the Accelerator, used by it, hf_backend.Trainer and
    hf_backend.ray_train (`accelerator.checkpoint_io`). Every method is called on every process."""

    def __init__(self, process: ProcessState, strategy: Strategy, precision: Precision, prepared: PreparedObjects,
                 progress: Callable[[], dict[str, Any]]) -> None:
        self.process = process
        self.strategy = strategy
        self.precision = precision
        self.prepared = prepared
        self.progress = progress  # the facade's counters, written into the metadata
        self.saves = async_save_.AsyncSaves()  # the async save still under way, if any
        self._save_group: Any = None

    @property
    def sharded(self) -> bool:
        """Whether model and optimizer states are written as each process's shards."""
        return self.strategy.sharded_checkpoints

    # -- whole checkpoints ---------------------------------------------------------------------------------------------
    def save(self, target: str | os.PathLike, objects: PreparedObjects | None = None, *,
             safe_serialization: bool = True, on_each_node: bool = False, async_save: bool = False,
             project: Any = None) -> Path:
        """`write` into a new directory `target`, staged so that it appears complete or not at all, and durable
        (fsynced) once it does. `on_each_node` (ProjectConfiguration.save_on_each_node) is only meaningful on one
        node. `async_save`: return once the state is in host memory; the files are written in the background and the
        checkpoint appears at the next `wait()` (async_save.py). `project`: the ProjectConfiguration whose automatic
        checkpoint this is: its iteration counts on now, its rotation runs once the checkpoint is in place."""
        self.wait()
        self.check_on_each_node(on_each_node, "save_state")
        target = Path(target)
        if target.exists() and not target.is_dir():
            raise HfBackendError(f"save_state: {target} is a file, not a checkpoint directory; pass a directory (the "
                                 "file is left as it is)")
        writes = async_save_.Writes(async_save, self.save_group() if async_save and self.sharded else None)
        staging = stage(target, self.process)
        self.write(staging.path, objects, safe_serialization=safe_serialization, writes=writes)
        after = automatic_saved(project, self.process) if project else None
        pending = async_save_.PendingSave(staging, writes, manifest.seal, after)
        if async_save:
            self.saves.put(pending)
            return target
        return pending.finish()

    def wait(self) -> Path | None:
        """Finish an async save still under way (every process): its checkpoint is in place when this returns, or
        its failure raises here. Returns its directory, or None when none was pending."""
        return self.saves.wait()

    def save_group(self) -> Any:
        """The gloo group the background writer's `dcp.save` coordinates on, apart from training's (async_save.py);
        made once, by every process."""
        if self._save_group is None and self.process.distributed:
            self._save_group = torch.distributed.new_group(backend="gloo")
        return self._save_group

    def write(self, directory: str | os.PathLike, objects: PreparedObjects | None = None, *, rng: bool = True,
              scaler: bool = True, extra: dict[str, Any] | None = None, safe_serialization: bool = True,
              on_each_node: bool = False, writes: async_save_.Writes | None = None) -> None:
        """Write `objects` (default: everything prepared and registered) into the existing `directory`, unstaged;
        `rng` / `scaler`: also this process's random states / the fp16 loss scaler (hf_backend.Trainer leaves both to
        transformers); `extra` replaces the facade's counters in the metadata. `on_each_node`: the files the main
        process writes are written by each node's local main process (nodes without a shared filesystem); models
        and optimizers cannot be, their states are gathered to (or coordinated by) global rank 0. `writes`: where
        model and optimizer states go (default: written now). The names of full optimizer and scheduler files follow
        from the metadata's `written_by` (a Trainer checkpoint's are transformers': layout.state_files)."""
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

    def read(self, directory: str | os.PathLike, objects: PreparedObjects | None = None, *, rng: bool = True,
             scaler: bool = True, checksums: bool = True, models_taken_by_hooks: bool = False) -> dict[str, Any]:
        """Restore `objects` (default: everything prepared and registered) from `directory`; returns its metadata.
        `checksums=False`: the manifest's sizes only (the caller has just verified the checksums).
        `models_taken_by_hooks`: load-state hooks load some models themselves, so fewer models than the checkpoint
        holds are read (in order, as Accelerate does)."""
        directory, objects = interrupted_overwrite(Path(directory)), objects if objects is not None else self.prepared
        meta = read_metadata(directory, checksums)
        for kind, saved in meta["counts"].items():
            have = len(getattr(objects, kind))
            if saved != have and not (kind == "models" and models_taken_by_hooks and have < saved):
                raise HfBackendError(
                    f"load_state: {directory} holds {saved} {kind} but {have} are prepared/registered; prepare and "
                    "register the same objects, in the same order, as the run that saved it")
        files = layout.state_files(meta)
        states = self._read_files(directory, objects, meta, rng, scaler, files)
        for i, model in enumerate(objects.models):
            self.load_weights(model, directory, layout.model_stem(i))
        maps: list[param_groups.GroupMap | None] = []
        if not (directory / layout.native_dir(layout.model_stem(0))).is_dir():  # else DeepSpeed's, read with it
            for i, optimizer in enumerate(objects.optimizers):
                stem, state = layout.optimizer_stem(i), states["optimizers"][i]  # state None: shards, read now
                maps.append(self.load_optimizer(optimizer, directory, stem, file=None if state is None else
                                                files.optimizer(stem), state=state))
        for i, (scheduler, state) in enumerate(zip(objects.schedulers, states["schedulers"])):
            mapping = maps[i] if len(maps) == len(objects.schedulers) else None  # scheduler i steps optimizer i
            scheduler.load_state_dict(state if mapping is None else
                                      param_groups.fit_scheduler_state(state, mapping, scheduler.state_dict()))
        for loader, state in zip(objects.dataloaders, states["dataloaders"]):
            loader.load_state_dict(state)
        for obj, state in zip(objects.custom, states["custom"]):
            obj.load_state_dict(state)
        if states["scaler"] is not None:
            self.precision.scaler.load_state_dict(states["scaler"])
        if states["rng"] is not None:
            restore_rng(states["rng"])
        return meta

    def _read_files(self, directory: Path, objects: PreparedObjects, meta: dict[str, Any], rng: bool,
                    scaler: bool, names: layout.FullStateFiles) -> dict[str, Any]:
        """Every file `read` loads from, read (and refused when it holds more than plain data) before any state
        changes; DCP directories are checked (metadata and non-tensor values) and read later, into the model."""
        files: dict[str, Any] = {
            "schedulers": [load_file(directory / names.scheduler(i)) for i in range(len(objects.schedulers))],
            "dataloaders": [load_file(directory / layout.dataloader_file(i)) for i in range(len(objects.dataloaders))],
            "custom": [load_custom_object(directory / layout.custom_file(i)) for i in range(len(objects.custom))],
            "scaler": load_file(directory / layout.SCALER)
            if scaler and self.precision.scaler is not None and meta.get("scaler") else None,
            "optimizers": [None] * len(objects.optimizers),
        }
        rng_file = directory / layout.rng_file(self.process.process_index)
        files["rng"] = load_file(rng_file) if rng and rng_file.is_file() else None
        if (directory / layout.native_dir(layout.model_stem(0))).is_dir():  # an earlier version's DeepSpeed files
            return files  # read by DeepSpeed's engine, model and optimizer together (load_weights)
        for i in range(len(objects.models)):
            if holds_sharded(directory, layout.sharded_dir(layout.model_stem(i))):
                check_dcp(directory / layout.sharded_dir(layout.model_stem(i)))
        for i in range(len(objects.optimizers)):
            stem = layout.optimizer_stem(i)
            if holds_sharded(directory, layout.sharded_dir(stem)):
                check_dcp(directory / layout.sharded_dir(stem))
            else:
                files["optimizers"][i] = load_file(directory / names.optimizer(stem))
        return files

    # -- one model or optimizer ----------------------------------------------------------------------------------------
    def save_weights(self, model: torch.nn.Module, directory: str | os.PathLike, stem: str = "model",
                     safe_serialization: bool = True, writes: async_save_.Writes | None = None) -> None:
        """The model's weights as a checkpoint holds them: each process's shards when `sharded`, else full files."""
        directory, writes = Path(directory), writes if writes is not None else async_save_.Writes()
        if self.sharded:
            writes.shards({"model": self.strategy.model_state_dict(model, sharded=True)},
                          directory / layout.sharded_dir(stem))
        else:
            state_dict = self.strategy.checkpoint_state_dict(model)
            if self.process.is_main_process:
                tied = tied_weight_keys(self.strategy.unwrap_model(model))
                state_dict = writes.snapshot(state_dict)
                writes.file(lambda: full_weights(state_dict, directory, stem, safe_serialization, tied))

    def load_weights(self, model: torch.nn.Module, directory: str | os.PathLike, stem: str = "model") -> None:
        """Weights in either form (or an earlier version's DeepSpeed checkpoint, under DeepSpeed) into the prepared
        model."""
        directory = Path(directory)
        if (directory / layout.native_dir(stem)).is_dir():  # model and optimizer, in DeepSpeed's own format
            self.strategy.load_native(directory, layout.native_dir(stem))
            return
        shards = directory / layout.sharded_dir(stem)
        if holds_sharded(directory, shards.name):
            state_dict = {"model": self.strategy.model_state_dict(model, sharded=True)}
            dcp_load(state_dict, shards)
            self.strategy.load_model_state_dict(model, state_dict["model"], sharded=True)
        else:
            result = self.strategy.load_model_state_dict(model, read_weights(directory, stem))
            check_loaded(self.strategy.unwrap_model(model), result, directory)

    def trainable_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full weights of the trainable parameters only (a PEFT adapter's), as a checkpoint holds them (DeepSpeed:
        the fp32 masters): the frozen base is not gathered. Collective; the main process gets the tensors."""
        return self.strategy.checkpoint_state_dict(model, trainable_only=True)

    def load_adapter(self, model: torch.nn.Module, directory: str | os.PathLike) -> None:
        """The adapter weights PEFT wrote into `directory` (a checkpoint of a PEFT model, under any strategy) into
        the prepared PEFT model; the frozen base keeps the weights it was built with."""
        path = layout.adapter_weights_file(directory)
        if path is None:
            raise HfBackendError(f"{directory} holds no {layout.ADAPTER_WEIGHTS[0]}; resume a PEFT model from a "
                                 "checkpoint written with its adapter")
        unwrapped = self.strategy.unwrap_model(model)
        state_dict = adapters.to_model_names(unwrapped, read_weights(path.parent, path.name.split(".")[0]), path)
        result = self.strategy.load_model_state_dict(model, state_dict)
        if result.unexpected_keys:
            raise HfBackendError(f"{path} does not fit the model: unexpected {list(result.unexpected_keys)[:5]}; "
                                 "resume with the model it was saved from")

    def save_optimizer(self, optimizer: Any, directory: str | os.PathLike, stem: str = "optimizer",
                       writes: async_save_.Writes | None = None,
                       files: layout.FullStateFiles = layout.STATE_FILES) -> None:
        """Each process's shards into `<stem>_dcp/` when `sharded`, else the full state keyed by parameter names (in
        the order of the param groups, which torch's `Optimizer.load_state_dict` also reads) in one file."""
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

    def load_optimizer(self, optimizer: Any, directory: str | os.PathLike, stem: str = "optimizer",
                       file: str | None = None, state: dict[str, Any] | None = None) -> param_groups.GroupMap | None:
        """Read the shards `<stem>_dcp/`, or the full file `file` (default `<stem>.bin`; `state`: its contents, already
        read) keyed by parameter names or, as torch's own `optimizer.state_dict()` (transformers' `optimizer.pt`), by
        position. Returns how the saved param groups were fitted to this optimizer's (param_groups.py), if they were."""
        inner, model = self._optimizer_and_model(optimizer)
        directory = Path(directory)
        shards = directory / layout.sharded_dir(stem)
        if file is None and holds_sharded(directory, shards.name):
            state_dict = {"optimizer": self.strategy.optimizer_state_dict(model, inner, sharded=True)}
            dcp_load(state_dict, shards)
            self.strategy.load_optimizer_state_dict(model, inner, state_dict["optimizer"], sharded=True)
        else:
            path = directory / (file or layout.full_optimizer_file(stem))
            state_dict = keyed_by_name(load_file(path) if state is None else state, inner,
                                       self.strategy.unwrap_model(model), path)
            mapping = param_groups.group_map([len(g["params"]) for g in state_dict.get("param_groups", [])],
                                             [len(g["params"]) for g in inner.param_groups], path)
            if mapping is not None:
                state_dict = param_groups.fit_optimizer_state(state_dict, mapping, inner.param_groups)
            self.strategy.load_optimizer_state_dict(model, inner, state_dict)
            return mapping
        return None

    def read_trainer_optimizer(self, optimizer: Any, scheduler: Any, directory: str | os.PathLike) -> None:
        """transformers' `optimizer.pt` (keyed by position) and `scheduler.pt` into a prepared optimizer and
        scheduler: how a checkpoint of transformers.Trainer (without DeepSpeed) resumes on the engine."""
        self.load_optimizer(optimizer, directory, file=layout.TRAINER_OPTIMIZER)  # positional: the same groups
        scheduler.load_state_dict(load_file(Path(directory) / layout.TRAINER_SCHEDULER))

    def save_pretrained(self, model: torch.nn.Module, directory: str | os.PathLike, max_shard_size: int | str,
                        safe_serialization: bool) -> None:
        """Full weights in the layout `from_pretrained` reads, with the model's config.json when it has one."""
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
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)

    def check_on_each_node(self, on_each_node: bool, what: str) -> None:
        """Refuse node-local checkpoints where they cannot work: a job of several nodes, for `what`."""
        if on_each_node and self.process.num_processes > self.process.local_num_processes:
            raise HfBackendError(f"{what} across {self.process.num_processes // self.process.local_num_processes} "
                                 "nodes: checkpoints need a filesystem every node shares; put the output directory "
                                 "there and set save_on_each_node=False")

    def _optimizer_and_model(self, optimizer: Any) -> tuple[torch.optim.Optimizer, torch.nn.Module]:
        """The torch optimizer inside a prepared one, and the prepared model whose parameters it updates."""
        inner = getattr(optimizer, "optimizer", optimizer)
        owner = self.strategy.model_of(inner)
        if owner is not None:
            return inner, owner
        ids = {id(p) for group in inner.param_groups for p in group["params"]}
        for model in self.prepared.models:
            if any(id(p) in ids for p in model.parameters()):
                return inner, getattr(model, "_orig_mod", model)  # inside a torch.compile wrapper
        raise HfBackendError("an optimizer's parameters belong to no prepared model; prepare the model with it")


def full_weights(state_dict: dict[str, torch.Tensor], directory: Path, stem: str, safe_serialization: bool,
                 tied: list[str]) -> durable.Digests:
    """Full weights of a checkpoint: one safetensors file written from the tensors' memory and hashed while written
    (durable.py); huggingface_hub's writer for `.bin` files, dtypes safetensors lacks, or more than 10 GB."""
    tensors = durable.without_aliases({k: v.detach().cpu() for k, v in state_dict.items()}, tied)
    if safe_serialization and durable.writable(tensors) and \
            sum(t.numel() * t.element_size() for t in tensors.values()) <= 10 * 10**9:
        return durable.safetensors_file(tensors, directory / f"{stem}.safetensors", {"format": "pt"})
    write_weights(state_dict, directory, filename_stem=stem, safe_serialization=safe_serialization, tied_keys=tied)
    return {}


def read_metadata(source: str | os.PathLike, checksums: bool = True, caller: str = "load_state") -> dict[str, Any]:
    """The checkpoint's metadata, once its format version and manifest check out (`checksums`: hash every file).
    Whatever is wrong is one line naming the file (`caller` starts it)."""
    source = Path(source)
    if not source.is_dir():
        raise HfBackendError(f"{caller}: no checkpoint directory at {source}; pass the directory save_state wrote")
    meta_path = source / layout.METADATA
    path = source
    try:
        os.listdir(source)  # pathlib would report the files of an unreadable directory as missing
        path = meta_path
        text = _read_metadata_file(meta_path, source, caller)
    except OSError as err:
        raise HfBackendError(f"{caller}: {path} cannot be read ({type(err).__name__}); give this process read access "
                             "to it") from None
    meta = _parse_metadata(meta_path, text, caller)
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= layout.FORMAT_VERSION:
        raise HfBackendError(f"{caller}: {meta_path} has format_version {version!r}; this hf_backend reads versions "
                             f"1 to {layout.FORMAT_VERSION}: load it with the hf_backend that wrote it, or upgrade")
    manifest.check_metadata(meta_path, meta, caller)  # after the version: a newer format may seal otherwise
    for key, kind in (("num_processes", int), ("counts", dict)):
        if not isinstance(meta.get(key), kind):
            raise HfBackendError(f"{caller}: {meta_path} has no valid {key!r}; the checkpoint is damaged, use another "
                                 "one")
    if "files" in meta:  # sealed; checkpoints of earlier versions (and Ray's per-process parts) have none
        manifest.verify(source, meta["files"], checksums, caller)
    return meta


def _read_metadata_file(meta_path: Path, source: Path, caller: str) -> str:
    if meta_path.is_dir():
        raise HfBackendError(f"{caller}: {meta_path} is a directory where the metadata file should be; the checkpoint "
                             "is damaged, use another one")
    if not meta_path.is_file():
        raise HfBackendError(f"{caller}: {source} is not an hf_backend checkpoint (no {layout.METADATA}); pass a "
                             "directory written by Accelerator.save_state")
    try:
        return meta_path.read_bytes().decode()
    except UnicodeDecodeError:
        raise HfBackendError(f"{caller}: {meta_path} is corrupt (not UTF-8 text); use another checkpoint") from None


def _parse_metadata(meta_path: Path, text: str, caller: str) -> dict[str, Any]:
    if not text.strip():
        raise HfBackendError(f"{caller}: {meta_path} is empty; use another checkpoint")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        raise HfBackendError(f"{caller}: {meta_path} is corrupt (line {err.lineno}); use another checkpoint") \
            from None
    if not isinstance(meta, dict):
        raise HfBackendError(f"{caller}: {meta_path} is corrupt (not a JSON object); use another checkpoint")
    return meta


def holds_sharded(directory: Path, name: str) -> bool:
    """Whether the DCP directory `name` is part of the checkpoint: listed in its manifest when it has one (a
    directory added after the save is never read), else present (checkpoints written before the manifest)."""
    try:
        files = json.loads((directory / layout.METADATA).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if not isinstance(files, dict):
        return (directory / name).is_dir()
    return any(Path(f).parts[:1] == (name,) for f in files)


def keyed_by_name(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module,
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


# -- Accelerate's save/load-state hooks --------------------------------------------------------------------------------
def apply_save_hooks(hooks: Iterable[Callable], objects: PreparedObjects, output_dir: str | os.PathLike,
                     state_dict: Callable[[torch.nn.Module], dict]) -> PreparedObjects:
    """Run `register_save_state_pre_hook` hooks as `hook(models, weights, output_dir)`; a model whose state dict a
    hook removed from `weights` is left out of the checkpoint (the hook saves it its own way)."""
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
    """Run `register_load_state_pre_hook` hooks as `hook(models, input_dir)`; a model a hook removed from `models` is
    not loaded (the hook loads it its own way)."""
    hooks = list(hooks)
    if not hooks:
        return objects
    models = list(objects.models)
    for hook in hooks:
        hook(models, str(input_dir))
    return objects.with_models(models)


__all__ = ["CheckpointIO", "full_weights", "apply_load_hooks", "apply_save_hooks", "keyed_by_name", "read_metadata"]
