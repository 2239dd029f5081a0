"""The Accelerator's members that save and load: weights (`save_model`, `get_state_dict`, `save`),
the whole training state (`save_state`, `load_state`, `wait_for_checkpoint`) and what joins it
(`register_for_checkpointing`, the state hooks). Each hands over to hf_backend.checkpoint
(`accelerator.checkpoint_io`), which decides where and how bytes are written.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from .. import checkpoint
from ..checkpoint import CheckpointIO
from ..config.options import ProjectConfiguration
from ..core.errors import HfBackendError
from ..core.notes import note
from ..strategies.base import Strategy
from ..training.prepared import PreparedObjects

_NOT_CHECKPOINTABLE = ("register_for_checkpointing: {names} lack "
                       "state_dict()/load_state_dict(); give them both methods")
_OTHER_WORLD = ("load_state: {directory} was saved by {saved} processes and is resumed by {now}; "
                "random states of processes the checkpoint lacks start fresh")


class SavingMembers:
    """Saving and loading, mixed into the Accelerator (which holds what is declared here)."""

    strategy: Strategy
    checkpoint_io: CheckpointIO
    project_configuration: ProjectConfiguration
    _objects: PreparedObjects
    _save_state_pre_hooks: OrderedDict[int, Callable]
    _load_state_pre_hooks: OrderedDict[int, Callable]
    step: int
    if TYPE_CHECKING:  # the facade's read-only properties (ProcessView's)
        @property
        def num_processes(self) -> int: ...
        @property
        def is_main_process(self) -> bool: ...

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict.

        Args:
            model: a prepared model.
            unwrap: take it through the strategy (gathered when sharded: call it on every
                process); False: the wrapper's own `state_dict()`.

        Returns:
            parameter and buffer names to tensors.
        """
        return self.strategy.model_state_dict(model) if unwrap else model.state_dict()

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save `obj` from the main process only (safetensors for a dict of tensors when asked)."""
        if self.is_main_process:
            checkpoint.save_object(obj, f, safe_serialization)

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike,
                   max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        """Write the full weights in the layout `from_pretrained` reads; call it on every process.

        Args:
            model: a prepared model (a transformers model also gets its config.json).
            save_directory: created when missing.
            max_shard_size: the largest weights file, e.g. "5GB"; larger states are sharded with an
                index.
            safe_serialization: safetensors (True) or torch files.
        """
        self.checkpoint_io.save_pretrained(model, save_directory, max_shard_size, safe_serialization)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """`hook(models, weights, output_dir)` runs before `save_state` writes; a model whose state
        dict it removes from `weights` is not written (the hook saves it its own way). Returns a
        handle with `.remove()`."""
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """`hook(models, input_dir)` runs before `load_state` reads; a model it removes from `models`
        is not loaded (the hook loads it its own way). Returns a handle with `.remove()`."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Objects with `state_dict()` and `load_state_dict()` that `save_state` saves and
        `load_state` restores, with the prepared ones."""
        bad = [type(o).__name__ for o in objects
               if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise HfBackendError(_NOT_CHECKPOINTABLE.format(names=", ".join(bad)))
        self._objects.custom.extend(objects)

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   async_save: bool | None = None) -> str:
        """Save everything needed to continue training exactly where it stands; call it on every
        process. The directory appears complete or not at all.

        Args:
            output_dir: where; None: the next automatic checkpoint under the project directory
                (ProjectConfiguration's automatic_checkpoint_naming, rotated to total_limit).
            safe_serialization: full weights as safetensors (True) or torch files.
            async_save: return once the state is in host memory and write it in the background
                (`wait_for_checkpoint`); None: ProjectConfiguration.async_save.

        Returns:
            the checkpoint's directory.
        """
        config, automatic = self.project_configuration, output_dir is None
        target = checkpoint.automatic_dir(config) if output_dir is None else output_dir
        objects = checkpoint.apply_save_hooks(self._save_state_pre_hooks.values(), self._objects, target,
                                              functools.partial(self.get_state_dict, unwrap=False))
        return str(self.checkpoint_io.save(target, objects, config, automatic=automatic,
                                           safe_serialization=safe_serialization, async_save=async_save))

    def wait_for_checkpoint(self) -> None:
        """Block until an async `save_state` is on disk (every process); its failure raises here."""
        self.checkpoint_io.wait()

    def load_state(self, input_dir: str | os.PathLike | None = None) -> None:
        """Restore what `save_state` wrote, under any strategy and number of processes; call it on
        every process. The checkpoint is verified before anything changes. The next pass over each
        prepared dataloader continues with the batch after the last one seen, in the same order.

        Args:
            input_dir: the checkpoint; None: the newest automatic checkpoint that verifies.
        """
        self.checkpoint_io.wait()  # a save under way is finished first
        config = self.project_configuration
        # a machine's processes divide the checksums
        sharing = checkpoint.manifest.machine_sharing()
        index = checkpoint.latest_automatic_checkpoint(config, sharing) if input_dir is None else \
            checkpoint.read_index(input_dir, sharing=sharing)
        objects = checkpoint.apply_load_hooks(self._load_state_pre_hooks.values(), self._objects,
                                              index.directory)
        taken = len(objects.models) < len(self._objects.models)
        index = self.checkpoint_io.read(index, objects, models_taken_by_hooks=taken)
        if index.meta["num_processes"] != self.num_processes:
            note(_OTHER_WORLD.format(directory=index.directory, saved=index.meta["num_processes"],
                                     now=self.num_processes))
        self.step = index.meta.get("accumulation_step", 0)
        if config.automatic_checkpoint_naming:  # continue the numbering after the checkpoint loaded
            config.iteration = max(config.iteration, index.meta.get("iteration", -1) + 1)
