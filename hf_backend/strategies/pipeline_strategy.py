"""The mesh path with pipeline stages (`ParallelismConfig(pp_size=P)`): the model is cut into this rank's stages
(pipeline.py), each stage sharded by FSDP2 over the data-parallel ranks (per block, then the stage), and the loop
runs forward and backward through the schedule in one call, `accelerator.forward_backward(model, batch)`.

`prepare` hands back this rank's part of the model under the model's own names (`PipelinedModel`): its parameters
are what the optimizer of this rank steps, and its state is the whole model's restricted to them (see "state"
below). Calling it and `accelerator.backward` are refused in one line each, naming `forward_backward`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ..core.errors import HfBackendError
from ..core.notes import note
from .capabilities import Pipelined
from .fsdp import FSDPStrategy, clip_grad_norm
from .pipeline import Decoder, DecoderStage, Pipeline, check_splittable

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class PipelinedModel(nn.Module):
    """This rank's stages of a causal LM, as one module under the model's names (`model.layers.4...`, `lm_head`):
    `parameters()` and `state_dict()` are the whole model's restricted to them. `pipeline` runs them."""

    accepts_loss_kwargs = True  # the stages' loss takes transformers' num_items_in_batch (Trainer: no probe)

    def __init__(self, pipeline: Pipeline, config: Any) -> None:
        super().__init__()
        self.config = config
        self.pipeline = pipeline
        part = Decoder()  # the stages' parts of the decoder, joined (several stages per rank)
        part.layers = nn.ModuleDict()
        for stage in pipeline.modules:
            part.layers.update(dict(stage.part.layers.items()))
            for name, child in stage.part.named_children():
                if name != "layers" and getattr(part, name, None) is None:
                    setattr(part, name, child)
            if stage.lm_head is not None:
                self.lm_head = stage.lm_head
        self.add_module(pipeline.modules[0].base_name, part)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise HfBackendError("under pipeline parallelism (pp_size > 1) forward and backward run together through "
                             "the schedule: loss = accelerator.forward_backward(model, batch) instead of "
                             "model(**batch) and accelerator.backward(loss); to evaluate, "
                             "accelerator.forward_only(model, batch)")


class PipelineStrategy(FSDPStrategy, Pipelined):
    """FSDP2 over the data-parallel ranks inside each pipeline stage; the stages over the pp ranks."""

    def setup_model(self, model: torch.nn.Module, device_placement: bool = True,
                    evaluation_mode: bool = False) -> torch.nn.Module:
        if self.receives_rank0_weights:
            raise HfBackendError("prepare(): cpu_ram_efficient_loading with pp_size > 1 is not supported yet; "
                                 "build the model on every rank (from_pretrained) and turn it off")
        check_splittable(model)
        before = list(model.parameters())
        if device_placement:
            model = model.to(self.process.device)
        shape = self.shape
        # every rank of a stage with other tokens: the data-parallel ranks and the sequence slices
        pipeline = Pipeline(cast("PreTrainedModel", model), self.mesh["pp"].get_group(), shape.pp_schedule,
                            shape.pp_microbatches, data_parallel=self.mesh["dp_cp"].get_group(),
                            parallelize=self._stage_plan,
                            sequence=self.sequences.group if self.sequences is not None else None)
        held = {id(p) for p in pipeline.parameters()}
        self._new_params.update({id(old): new for old, new in zip(before, model.parameters()) if id(new) in held})
        note(f"pp {shape.pp}: {shape.pp_schedule} over {pipeline.microbatches} microbatches, rank 0 holds stages "
             f"{list(pipeline.layout.stages)} of {pipeline.layout.num_stages}; bubble "
             f"{pipeline.bubble:.0%} of each step")
        return PipelinedModel(pipeline, model.config)

    def _stage_plan(self, stage: nn.Module) -> None:
        """A stage as the mesh path prepares a model, less what spans the whole model: its weights made equal
        over the ranks that hold it, fp32 masters, tp, the sequence split (cp, sp), activation checkpointing,
        `fully_shard` per block then the stage; autocast around its forward."""
        assert isinstance(stage, DecoderStage)
        for tensor in [*stage.parameters(), *stage.buffers()]:
            dist.broadcast(tensor.data, group=self.mesh["dp_cp"].get_group(), group_src=0)
        for step in self.parallelize_plan(stage):
            if step.name in ("fp32 masters", "tp", "cp", "sp", "activation checkpointing", "fully_shard"):
                step.apply(stage)
        self.precision.wrap_forward(stage)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer keeps the parameters this rank's stages hold (as their shards) and drops the others."""
        held = {id(p) for p in self._new_params.values()}  # built before prepare or from the prepared model
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in self._new_params or id(p) in held]
        return super().setup_optimizer(optimizer)

    def forward_backward(self, model: nn.Module, batch: Mapping[str, Any], accumulation_steps: int,
                         num_items_in_batch: torch.Tensor | float | None = None) -> torch.Tensor:
        input_ids, labels, extra = _rows(model, batch, "forward_backward")
        assert isinstance(model, PipelinedModel) and labels is not None  # _rows checked both
        with self._sliced(input_ids, labels, extra) as (input_ids, labels, extra):
            return model.pipeline.step(input_ids, labels, 1.0 / accumulation_steps, num_items_in_batch, **extra)

    def forward_only(self, model: nn.Module, batch: Mapping[str, Any], num_items_in_batch: torch.Tensor | float | None
                     = None, logits: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        input_ids, labels, extra = _rows(model, batch, "forward_only", targets=False)
        assert isinstance(model, PipelinedModel)
        if logits and self.sequences is not None:
            raise HfBackendError(f"forward_only(logits=True) with {self.sequences.kind}_size="
                                 f"{self.sequences.size}: each rank holds a slice of every sequence's logits; "
                                 "evaluate the loss only (prediction_loss_only=True), or without the split")
        with self._sliced(input_ids, labels, extra) as (input_ids, labels, extra):
            return model.pipeline.evaluate(input_ids, labels, num_items_in_batch, logits, **extra)

    @contextlib.contextmanager
    def _sliced(self, input_ids: torch.Tensor, labels: torch.Tensor | None,
                extra: dict[str, torch.Tensor]) -> Iterator[tuple[torch.Tensor, Any, dict[str, torch.Tensor]]]:
        """The batch on this rank's device and, with cp or sp, cut into this rank's slice of every sequence
        (the targets shifted first, the positions the whole sequences'), the stages' attention seeing across
        the slices while the schedule runs."""
        device = self.process.device
        moved = {k: v.to(device) for k, v in extra.items()}
        input_ids, labels = input_ids.to(device), labels.to(device) if labels is not None else None
        if self.sequences is None:
            yield input_ids, labels, moved
            return
        rows, length = input_ids.shape
        buffers = {"input_ids": input_ids.clone(), **{k: v.clone() for k, v in moved.items()}}
        buffers.setdefault("position_ids", torch.arange(length, device=device).expand(rows, -1).clone())
        if labels is not None:
            buffers["labels"] = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        tensors = list(buffers.values())
        with self.sequences.split(tensors, [1] * len(tensors), keep=tensors):
            sliced = dict(buffers)
            yield sliced.pop("input_ids"), sliced.pop("labels", None), sliced

    @contextlib.contextmanager
    def context_parallel(self, buffers: Any, seq_dims: Any, keep: Any) -> Iterator[None]:
        """A loop's `maybe_context_parallel` under pp: `forward_backward` cuts the sequences itself."""
        yield

    def backward(self, loss: torch.Tensor, accumulation_steps: int, sync: bool, **kwargs: Any) -> None:
        raise HfBackendError("accelerator.backward under pipeline parallelism (pp_size > 1): the schedule "
                             "runs the backward; loss = accelerator.forward_backward(model, batch) does both")

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        stages = model.pipeline.modules if isinstance(model, PipelinedModel) else []
        with contextlib.ExitStack() as stack:
            for stage in stages:
                stack.enter_context(super().no_sync(stage))
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm(parameters, max_norm, norm_type, across=(self.mesh["pp"].get_group(),))

    # -- state -------------------------------------------------------------------------------------
    # Each rank's stages are the whole model's modules under its names, so a sharded state (DCP) is the model's
    # own, every rank writing its stages' shards: it loads under any layout, pp or not. Full states are gathered
    # over the data-parallel ranks of each stage, then over the stages onto the main process.

    def model_state_dict(self, model: torch.nn.Module, sharded: bool = False, trainable_only: bool = False,
                         masters: bool = False) -> dict[str, torch.Tensor]:
        if sharded:
            return super().model_state_dict(model, sharded=True, trainable_only=trainable_only)
        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=trainable_only)
        return self._onto_main(_to_cpu(get_model_state_dict(model, options=options)))

    def load_model_state_dict(self, model: torch.nn.Module, state_dict: dict[str, Any], sharded: bool = False) -> Any:
        """A whole model's state (full or sharded), of which each rank loads its stages' part."""
        held = model.state_dict().keys()
        return super().load_model_state_dict(model, {k: v for k, v in state_dict.items() if k in held}, sharded)

    def optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             sharded: bool = False) -> dict[str, Any]:
        """Every rank's param groups name every stage's parameters, so the one copy a DCP checkpoint keeps of
        them (and a full state's) serves any layout; the state is this rank's stages' (sharded) or every
        stage's on the main process (full)."""
        if sharded:
            state = super().optimizer_state_dict(model, optimizer, sharded=True)
            return {**state, "param_groups": self._whole_groups(state["param_groups"])}
        full = cast("dict[str, Any]", get_optimizer_state_dict(model, optimizer,
                                                               options=StateDictOptions(full_state_dict=True)))
        groups = self._whole_groups(full["param_groups"])
        merged = self._onto_main(_to_cpu(full["state"]))
        return {"state": merged, "param_groups": groups} if self.process.is_main_process else {}

    def load_optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  state_dict: dict[str, Any], sharded: bool = False) -> None:
        held = dict(model.named_parameters()).keys()
        state_dict = {"state": {k: v for k, v in state_dict.get("state", {}).items() if k in held},
                      "param_groups": [{**group, "params": [n for n in group["params"] if n in held]}
                                       for group in state_dict.get("param_groups", [])]}
        super().load_optimizer_state_dict(model, optimizer, state_dict, sharded)

    def _whole_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """This rank's param groups with the names of the parameters every pp rank's groups hold."""
        everyone: list[Any] = [None] * self.shape.pp
        dist.all_gather_object(everyone, [list(group["params"]) for group in groups], group=self.mesh["pp"].get_group())
        return [{**group, "params": [name for theirs in everyone for name in theirs[i]]}
                for i, group in enumerate(groups)]

    def _onto_main(self, part: dict[str, Any]) -> dict[str, Any]:
        """Each stage's entries (the same on its data-parallel, cp, sp and tp ranks) merged on the main process;
        {} elsewhere."""
        if self.mesh["dp_cp"].get_local_rank() != 0 or self.mesh["tp"].get_local_rank() != 0:
            return {}
        parts: list[Any] = [None] * self.shape.pp if self.process.is_main_process else []
        dist.gather_object(part, parts if self.process.is_main_process else None,
                           group=self.mesh["pp"].get_group(), group_dst=0)
        return {k: v for theirs in parts for k, v in theirs.items()}


def _rows(model: nn.Module, batch: Mapping[str, Any], what: str,
          targets: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """A batch's input ids, targets (`labels`; else the ids when `targets`) and what every stage takes besides
    (`attention_mask`, `position_ids`), checked for what the stages cannot take."""
    input_ids = batch.get("input_ids")
    labels = batch.get("labels", batch.get("input_ids") if targets else None)
    if not isinstance(model, PipelinedModel) or not isinstance(input_ids, torch.Tensor):
        raise HfBackendError(f"{what}(model, batch): pass the prepared model and a batch with input_ids (and "
                             "labels; without them the input ids are the targets)")
    rows, microbatches = len(input_ids), model.pipeline.microbatches
    if rows < microbatches:
        raise HfBackendError(f"{what}: this rank's batch has {rows} rows, fewer than the schedule's {microbatches} "
                             f"microbatches; give ParallelismConfig(pp_microbatches={rows}) or fewer, or a larger "
                             "batch")
    unused = sorted(k for k in ("shift_labels", "inputs_embeds", "token_type_ids") if k in batch)
    if unused:
        raise HfBackendError(f"{what}: the batch has {', '.join(unused)}; pipeline stages take input_ids, labels, "
                             "attention_mask and position_ids")
    extra = {k: batch[k] for k in ("attention_mask", "position_ids") if isinstance(batch.get(k), torch.Tensor)}
    if "attention_mask" in extra and bool(extra["attention_mask"].all()):
        del extra["attention_mask"]  # nothing padded: the causal mask alone, as the decoder makes it then
    return input_ids, labels, extra


def _to_cpu(tree: Any) -> Any:
    """A state's tensors moved to the CPU (what gather_object sends), the rest as it is."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    return tree
