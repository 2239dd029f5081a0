"""`Trainer`: transformers' Trainer with hf_backend's Accelerator underneath.

The training loop, logging, callbacks, evaluation and the checkpoint directories
(`output_dir/checkpoint-{step}` with `trainer_state.json` and RNG files, their rotation) are
transformers' own code. Overridden, and only these:
- `create_accelerator_and_postprocess`: builds hf_backend.Accelerator from the TrainingArguments;
- `_get_num_items_in_batch`: decides once whether the model's loss honours `num_items_in_batch`
  (trainer/loss.py);
- `floating_point_ops`: the same estimate, with the model's parameters counted once rather than at
  every step (trainer/loss.py);
- `_run_epoch`: transformers' loop with `logging_nan_inf_filter` computed on the device
  (`_loss_to_log`, trainer/loss.py), where transformers' test waits for the device after every
  backward (transformers_compat.loss_filter_on_device);
- checkpoint I/O: one layout under every strategy (checkpoint/layout.py), written and read by the
  engine's CheckpointIO. The weights (full `model.safetensors`, FSDP's shards under
  SHARDED_STATE_DICT, or a PEFT model's adapter), the optimizer (`optimizer.pt` keyed by parameter
  names, or shards) and `scheduler.pt`, the train loader's position and
  `hf_backend_checkpoint.json`: a checkpoint resumes under any strategy and world size with the
  exact batch order, and (one process, DDP) under transformers.Trainer too. transformers still
  writes and reads its own files around them (trainer_state.json, RNG, scaler, arguments, config).
- under pipeline parallelism, `training_step`, `prediction_step` and `get_total_train_batch_size`
  (pipeline_steps.py): the steps through the schedule;
- `_save_checkpoint` seals a manifest of every file into the checkpoint;
  `train(resume_from_checkpoint=...)` verifies it before loading anything, and `True` resumes the
  newest *complete and intact* checkpoint.
transformers' methods that use names it imports from accelerate (`skip_first_batches` in the epoch
loop, `DistributedType`, ...) run unchanged with the engine's objects of those names
(accelerate_names.py): the Trainer needs no accelerate package. docs/trainer.md lists the
transformers internals this relies on; transformers_compat.py, what differs between the transformers
versions it supports.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers.trainer_pt_utils import AcceleratorConfig

from .. import checkpoint
from ..accelerator import elastic
from ..accelerator.facade import Accelerator
from ..config.options import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    TorchDynamoPlugin,
)
from ..core.errors import ConfigError, HfBackendError
from ..core.notes import note
from ..parallel.config import ParallelismConfig
from ..parallel.dims import MeshShape, loaded_shape
from ..training.prepared import PreparedObjects
from . import async_checkpoint
from . import transformers_compat as compat
from .accelerate_names import engine_named
from .arguments import TrainingArguments
from .jit_checkpoint import JITCheckpoint
from .loss import LossMembers
from .pipeline_steps import PipelineSteps
from .replica_groups import ReplicaGroupSteps, writes_for_the_run

# older than transformers_compat.OLDEST is an ImportError, newer than NEWEST a warning
compat.check_version()


# after self, model, args
_TRAINER_PARAMETERS = list(inspect.signature(transformers.Trainer.__init__).parameters)[3:]


# Config fields of transformers models whose set of used parameters changes from step to step:
# dropped layers and routed experts. For those, unset ddp_find_unused_parameters keeps transformers'
# True: one step cannot tell.
_VARYING_GRAPH_FIELDS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop", "num_experts", "num_local_experts",
                         "n_routed_experts", "moe_num_experts")


def _graph_may_vary(model: Any) -> bool:
    config = getattr(model, "config", None)
    if not isinstance(model, transformers.PreTrainedModel) or config is None:
        return True  # transformers' default for any other module: it may branch on anything
    return any(isinstance(v := getattr(config, name, None), (int, float)) and v > 0 for name in _VARYING_GRAPH_FIELDS)


if TYPE_CHECKING:  # engine_named(cls) is a subclass of cls with the same members
    _EngineNamed = transformers.Trainer
else:
    _EngineNamed = engine_named(transformers.Trainer)


class Trainer(PipelineSteps, LossMembers, _EngineNamed):
    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *rest: Any, **kwargs: Any) -> None:
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, TrainingArguments):
            what = type(args).__name__
            fix = ("build them with "
                   "hf_backend.TrainingArguments" if type(args) is transformers.TrainingArguments
                   else f"put its class on the engine too: `{what} = hf_backend.on_engine({what})`")
            raise HfBackendError(f"{type(self).__name__} on hf_backend's engine got {what} "
                                 f"arguments, which are not on the engine; {fix} (docs/llm.md)")
        # Handed on by name: the next class in a subclass's order may take other parameters in other
        # places (TRL's preference trainers take ref_model second).
        twice = sorted(set(_TRAINER_PARAMETERS[:len(rest)]) & set(kwargs))
        if twice or len(rest) > len(_TRAINER_PARAMETERS):
            raise TypeError(f"{type(self).__name__}() got {len(rest) + 2} positional arguments "
                            "where transformers' Trainer takes "
                            f"{len(_TRAINER_PARAMETERS) + 2}" if not twice else
                            f"{type(self).__name__}() got multiple "
                            f"values for argument {twice[0]!r}")
        kwargs.update(zip(_TRAINER_PARAMETERS, rest))
        self._train_loader: Any = None
        self._loss_checked = False
        # floating_point_ops: the model whose parameters were counted, and how many
        self._counted_model: Any = None
        self._counted_parameters = 0
        # the checkpoint train() verified (hashed once)
        self._resume_index: checkpoint.CheckpointIndex | None = None
        with _checkpoints_allowed(model, args):
            super().__init__(model=model, args=args, **kwargs)
        if self.accelerator.replica_groups is not None:  # right after DefaultFlowCallback (replica_groups.py)
            callbacks = self.callback_handler.callbacks
            flow = [i for i, c in enumerate(callbacks) if isinstance(c, transformers.DefaultFlowCallback)]
            callbacks.insert(flow[0] + 1 if flow else 0, ReplicaGroupSteps(self))
        if args.enable_jit_checkpoint:
            self._coordinate_jit_checkpoint()
        self.check_pipeline_fits()

    def _coordinate_jit_checkpoint(self) -> None:
        """transformers' per-process SIGTERM callback is replaced by one all processes act on together.
        """
        from transformers.trainer_jit_checkpoint import JITCheckpointCallback

        for callback in list(self.callback_handler.callbacks):
            if isinstance(callback, JITCheckpointCallback):
                self.remove_callback(callback)
                manager = callback.jit_manager
                if manager is not None and manager._original_sigterm_handler is not None:
                    signal.signal(signal.SIGTERM, manager._original_sigterm_handler)
        self.add_callback(JITCheckpoint(self))

    # -- the engine --------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        args = self.args
        parallelism = args.parallelism_config
        # sharded by from_pretrained(distributed_config= / tp_plan=...)
        loaded = loaded_shape(self.model)
        # as transformers does: the grid the model was loaded for
        if loaded is not None:
            if parallelism is None:
                parallelism = ParallelismConfig.of_shape(loaded)
            elif parallelism.shape(args.world_size) != loaded:
                raise ConfigError(_loaded_elsewhere(loaded, parallelism.shape(args.world_size)))
        config = args.accelerator_config
        assert isinstance(config, AcceleratorConfig)  # TrainingArguments.__post_init__ reads it into one
        accumulation = dict(config.gradient_accumulation_kwargs or {})
        if "num_steps" in accumulation:
            # transformers' phrase is kept: code may match on it
            if args.gradient_accumulation_steps > 1:
                raise ConfigError("The `AcceleratorConfig`'s `num_steps` is set but "
                                  "`gradient_accumulation_steps` is greater than 1 in the passed "
                                  "`TrainingArguments`: keep one of them "
                                  "(gradient_accumulation_steps)")
            args.gradient_accumulation_steps = accumulation["num_steps"]
        # the Trainer accumulates itself and tells the engine when to sync
        accumulation["num_steps"] = 1
        if config.dispatch_batches:
            note("accelerator_config dispatch_batches=True: every "
                 "process reads its own shard in hf_backend")
        if not config.use_seedable_sampler:
            note("accelerator_config use_seedable_sampler=False: "
                 "hf_backend's epoch order is always seedable")
        self.accelerator = Accelerator(
            mixed_precision=args.mixed_precision,
            dataloader_config=DataLoaderConfiguration(
                split_batches=config.split_batches, dispatch_batches=config.dispatch_batches,
                even_batches=config.even_batches, use_seedable_sampler=config.use_seedable_sampler,
                non_blocking=config.non_blocking, data_seed=args.data_seed),
            gradient_accumulation_plugin=GradientAccumulationPlugin(**accumulation),
            kwargs_handlers=[self._ddp_kwargs()],
            dynamo_plugin=TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
            if args.torch_compile else None,
            backend=args.backend,  # decided once, by the arguments
            parallelism_config=parallelism,
            fault_tolerance=args.replica_group or False,
        )
        self.gather_function = functools.partial(self.accelerator.gather_for_metrics,
                                                 use_gather_object=args.eval_use_gather_object)
        state = self.accelerator.state
        self.is_deepspeed_enabled = state.deepspeed_plugin is not None
        self.is_fsdp_enabled = state.fsdp_plugin is not None
        self._check_combinations()

    def _ddp_kwargs(self) -> DistributedDataParallelKwargs:
        args = self.args
        find_unused = args.ddp_find_unused_parameters
        if find_unused is None:
            # transformers' default is True except for a PreTrainedModel with activation
            # checkpointing, where DDP's search breaks reentrant checkpointing. hf_backend's None:
            # DDP finds the unused parameters on the first step and keeps searching on every step
            # only if there were some (strategies/ddp.py)
            base_model = getattr(self.model, "get_base_model", None)  # a PEFT model's
            model = base_model() if base_model is not None else self.model
            checkpointing = isinstance(model, transformers.PreTrainedModel) and (
                compat.model_activation_checkpointing(model) or compat.activation_checkpointing(args))
            find_unused = False if checkpointing else True if _graph_may_vary(model) else None
        kwargs: dict[str, Any] = {"find_unused_parameters": find_unused}
        for name in ("bucket_cap_mb", "broadcast_buffers", "static_graph"):
            if getattr(args, f"ddp_{name}") is not None:
                kwargs[name] = getattr(args, f"ddp_{name}")
        return DistributedDataParallelKwargs(**kwargs)

    def _check_combinations(self) -> None:
        args, state = self.args, self.accelerator.state
        if (self.is_fsdp_enabled and state.fsdp_plugin.activation_checkpointing
                and compat.activation_checkpointing(args)):
            raise HfBackendError("fsdp_config activation_checkpointing and the "
                                 f"{compat.ACTIVATION_CHECKPOINTING_ARGUMENT} argument are both "
                                 "set; keep FSDP's (fsdp_config) under FSDP")
        # before training, not at the first save
        self.accelerator.checkpoint_io.check_on_each_node(args.save_on_each_node, "save_on_each_node")
        if args.save_only_model and self._sharded_weights():
            raise HfBackendError("save_only_model does not go with FSDP's "
                                 "SHARDED_STATE_DICT; use FULL_STATE_DICT")
        if self.is_deepspeed_enabled and state.deepspeed_plugin.zero_stage == 3 and args.auto_find_batch_size:
            raise HfBackendError("auto_find_batch_size does not work with "
                                 "DeepSpeed ZeRO-3; set the batch size")

    def _sharded_weights(self) -> bool:
        return self.accelerator.checkpoint_io.sharded and not self._adapter_weights()

    def _adapter_weights(self) -> bool:
        """A PEFT model's weights are its adapter, in PEFT's files, under every strategy: the engine
        gathers and writes only the trainable parameters."""
        return checkpoint.adapters.is_peft_model(self.accelerator.unwrap_model(self.model))

    def get_train_dataloader(self) -> Any:
        self._train_loader = super().get_train_dataloader()
        return self._train_loader

    # replica groups: every group evaluates the whole set, not its part of each global batch (fault_tolerance/groups.py)
    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return self._evaluation_loader(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return self._evaluation_loader(super().get_test_dataloader(test_dataset))

    def _evaluation_loader(self, loader: Any) -> Any:
        groups = self.accelerator.replica_groups
        return loader if groups is None else groups.evaluation_loader(loader)

    # -- the logged loss ---------------------------------------------------------------------------
    # transformers' epoch loop, its NaN/inf filter of the logged loss computed on the device
    _run_epoch = compat.loss_filter_on_device(_EngineNamed._run_epoch)

    # -- checkpoints -------------------------------------------------------------------------------
    _async_writes: Any = None  # while an async checkpoint is being saved: where its large writes go

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """A checkpoint is verified (its manifest) before anything of it is loaded; `True` resumes the
        newest one that is complete and verifies, passing over newer ones with a note. An async
        checkpoint still being written is finished first, and the last one is complete when
        `train()` returns."""
        self.accelerator.checkpoint_io.wait()
        self._resume_index = None

        def usable(directory: str | os.PathLike) -> None:
            self._resume_index = checkpoint.check_trainer_checkpoint(
                directory, fresh_optimizer=self.args.save_only_model, caller=RESUME)

        # under torch elastic a first start has none yet: it starts fresh
        if resume_from_checkpoint is True:
            assert self.args.output_dir is not None  # transformers' __post_init__ sets a default
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir, usable, elastic.under_elastic())
        elif resume_from_checkpoint and os.path.isdir(resume_from_checkpoint):
            usable(resume_from_checkpoint)
        elif resume_from_checkpoint:  # transformers' phrase is kept: code may match on it
            raise ConfigError(f"{RESUME}: Can't find a valid checkpoint at "
                              f"{resume_from_checkpoint}: no such directory; pass a checkpoint-* "
                              "directory, or True for the newest in output_dir")
        with self._chunked_loss():
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        self.accelerator.checkpoint_io.wait()
        return result

    def is_world_process_zero(self) -> bool:
        return super().is_world_process_zero() and writes_for_the_run(self.args)

    def is_local_process_zero(self) -> bool:
        return super().is_local_process_zero() and writes_for_the_run(self.args)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """transformers' save, then the manifest of every file in the checkpoint (once every process
        has written). With save_only_model the train loader's position is written too, so the
        manifest has its metadata. A directory of the same step left by an earlier run (one a resume
        passed over) is removed first: transformers would write into it, among its stale or damaged
        files. With async_save the large files are written in the background and the manifest is
        sealed when they are (trainer/async_checkpoint.py)."""
        if not writes_for_the_run(self.args):  # replica group 0 writes the run's checkpoints
            return
        output_dir = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if self.args.should_save and os.path.lexists(output_dir):
            note(f"removing {output_dir}, left by an earlier run, before saving this step again")
            if os.path.isdir(output_dir):
                shutil.rmtree(output_dir)
            else:
                os.remove(output_dir)
        self.accelerator.wait_for_everyone()
        with async_checkpoint.deferred(self, trial) if self.args.async_save else contextlib.nullcontext():
            super()._save_checkpoint(model, trial)
            if self.args.save_only_model:
                self._write_engine_part(output_dir, optimizer_and_scheduler=False)
        if self.args.async_save:
            return
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            checkpoint.manifest.seal(Path(output_dir))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A PEFT model's adapter (only the trainable parameters gathered), else the full weights
        `from_pretrained` reads, gathered under every strategy. A checkpoint's weights
        (`_internal_call`) are written as CheckpointIO writes them: shards under FSDP's
        SHARDED_STATE_DICT, in the background with async_save."""
        if not writes_for_the_run(self.args):  # replica group 0 writes; every group holds the same weights
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        assert output_dir is not None  # transformers' __post_init__ sets a default
        io, adapter = self.accelerator.checkpoint_io, self._adapter_weights()
        if _internal_call and not adapter:
            os.makedirs(output_dir, exist_ok=True)
            io.save_weights(self.model_wrapped, output_dir, writes=self._async_writes)
            self._save_model_files(output_dir)
            return
        if self.pipeline is not None and not adapter:  # the stages' weights gathered, with the model's config
            io.save_pretrained(self.model_wrapped, output_dir, "5GB", safe_serialization=True)
            self._save_model_files(output_dir)
        elif getattr(self.model, "is_distributed_loading_by_transformers", False) and not adapter:
            # on every process: save_pretrained gathers the model transformers sharded itself
            self._save(output_dir)
        else:
            state_dict = io.trainable_weights(self.model_wrapped) if adapter else \
                self.accelerator.get_state_dict(self.model_wrapped)
            # before 5.23 transformers' _save writes from every process (compat)
            if self.args.should_save:
                self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_model_files(self, output_dir: str) -> None:
        """What `_save` writes besides the weights: model and generation config, tokenizer or
        processor, training arguments."""
        if not self.args.should_save:
            return
        # any module: the parts of a transformers model are looked up by name
        model: Any = self.accelerator.unwrap_model(self.model)
        if getattr(model, "config", None) is not None:
            model.config.save_pretrained(output_dir)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, checkpoint.layout.TRAINER_ARGUMENTS))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._write_engine_part(output_dir, optimizer_and_scheduler=True)

    def _write_engine_part(self, output_dir: str, optimizer_and_scheduler: bool) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.accelerator.checkpoint_io.write(output_dir, self._engine_objects(optimizer_and_scheduler), rng=False,
                                             scaler=False, extra={"written_by": checkpoint.layout.TRAINER_WRITER},
                                             on_each_node=self.args.save_on_each_node, writes=self._async_writes)

    def _engine_objects(self, optimizer_and_scheduler: bool) -> PreparedObjects:
        """The train loader position, with the optimizer and scheduler; transformers writes the RNG and
        scaler files, save_model the weights."""
        loaders = [self._train_loader] if self._train_loader is not None else []
        if not optimizer_and_scheduler:
            return PreparedObjects(dataloaders=loaders)
        return PreparedObjects(optimizers=[self.optimizer], schedulers=[self.lr_scheduler], dataloaders=loaders)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None) -> Any:
        """transformers' preparation, then the checkpoint read into the prepared objects by the engine,
        the same way under every strategy (transformers would read DeepSpeed's own files here, and
        other strategies' weights before preparing: `_load_from_checkpoint` passes over that call).
        """
        prepared = super()._prepare_for_training(max_steps, train_dataloader, None)
        if resume_from_checkpoint is not None:
            self._load_weights(self.model_wrapped, resume_from_checkpoint)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        return prepared

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # transformers' call before preparing has none: read after it (_prepare_for_training)
        if model is not None:
            self._load_weights(model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        io, index = self.accelerator.checkpoint_io, self._index(checkpoint_dir)
        if index is None:  # written by transformers.Trainer
            # (none: saved with save_only_model)
            if checkpoint.layout.holds_trainer_optimizer(checkpoint_dir):
                io.read_trainer_optimizer(self.optimizer, self.lr_scheduler, checkpoint_dir)
            return
        with_optimizer = index.counts.get("optimizers", 0) > 0  # none: saved with save_only_model
        io.read(index, self._engine_objects(with_optimizer), rng=False, scaler=False)
        if self.args.ignore_data_skip and self._train_loader is not None:
            # the resumed epoch from its first batch, as transformers
            self._train_loader.skip_first_batches(0)

    def _load_best_model(self) -> None:
        # the best checkpoint may be the one still being written
        self.accelerator.checkpoint_io.wait()
        best = self.state.best_model_checkpoint
        assert best is not None  # transformers calls this only once there is one
        note(f"loading the best model from {best} (score: {self.state.best_metric})")
        self._load_weights(self.model_wrapped, best)

    def _load_weights(self, model: torch.nn.Module, directory: str) -> None:
        io = self.accelerator.checkpoint_io
        if self._adapter_weights():
            io.load_adapter(model, directory)
        else:
            io.load_weights(model, self._index(directory) or directory)

    def _index(self, directory: str | Path) -> checkpoint.CheckpointIndex | None:
        """The index of an hf_backend checkpoint (the one `train()` verified is not read again), None
        for one transformers.Trainer wrote (full files, no engine metadata)."""
        if self._resume_index is not None and self._resume_index.directory == Path(directory):
            return self._resume_index
        if not checkpoint.layout.holds_engine_state(directory):
            return None
        return checkpoint.read_index(directory, caller=RESUME, sharing=checkpoint.manifest.machine_sharing())


@contextlib.contextmanager
def _checkpoints_allowed(model: Any, args: TrainingArguments) -> Iterator[None]:
    """transformers.Trainer refuses checkpoints of a model sharded at load time
    (`from_pretrained(distributed_config= ...)`): its own checkpoint code cannot write their
    optimizer state. The engine's writes and reads it like any sharded model's, so that refusal is
    passed over: transformers' constructor sees `save_only_model`, which nothing else there reads,
    and the argument is put back right after."""
    if not getattr(model, "is_distributed_loading_by_transformers", False) or args.save_only_model:
        yield
        return
    args.save_only_model = True
    try:
        yield
    finally:
        args.save_only_model = False


def _loaded_elsewhere(loaded: MeshShape, asked: MeshShape) -> str:
    return (f"the model was sharded over {loaded.describe()} by from_pretrained (tp_plan= or "
            "distributed_config=: transformers' own mesh over every process, whatever device_mesh "
            f"says) but parallelism_config asks for {asked.describe()}; drop parallelism_config "
            "(the model's grid becomes the run's), or load the model whole: the Trainer applies "
            "its tp_plan over the run's mesh (docs/parallelism.md)")


RESUME = "resume_from_checkpoint"


def last_complete_checkpoint(output_dir: str, usable: Callable[[Path], None] | None = None,
                             none_ok: bool = False) -> str | None:
    """The newest `checkpoint-{step}` in `output_dir` whose save finished (and that `usable` accepts);
    newer, interrupted or damaged ones are passed over with a note. None when there is none and
    `none_ok` (a process started by torch elastic, whose first start has no checkpoint yet), else an
    error as transformers raises."""
    found = checkpoint.last_complete_trainer_checkpoint(output_dir, usable)
    if found is not None:
        return str(found)
    if none_ok:
        note(f"resume_from_checkpoint=True: no complete checkpoint in {output_dir} yet (restart "
             f"{elastic.restart_count()}); training from the beginning")
        return None
    raise ConfigError("resume_from_checkpoint=True: No valid checkpoint found in output directory "
                      f"({output_dir}): no complete checkpoint-* directory there; train without "
                      "resuming or pass a checkpoint path")
