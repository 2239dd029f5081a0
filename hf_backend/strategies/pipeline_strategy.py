"""The mesh path with pipeline stages (`ParallelismConfig(pp_size=P)`): the model is cut into this rank's stages
(pipeline.py), each stage sharded by FSDP2 over the data-parallel ranks (per block, then the stage), and the loop
runs forward and backward through the schedule in one call, `accelerator.forward_backward(model, batch)`.

`prepare` hands back this rank's part of the model under the model's own names (`PipelinedModel`): its parameters
are what the optimizer of this rank steps. Calling it, `accelerator.backward` and saving its state are refused in one
line each, naming what to do instead (the state's save and load under pp are not built yet).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import HfBackendError
from ..core.notes import note
from ..parallel.dims import data_parallel_mesh
from .capabilities import Pipelined
from .fsdp import FSDPStrategy, clip_grad_norm
from .pipeline import Decoder, DecoderStage, Pipeline, check_splittable

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class PipelinedModel(nn.Module):
    """This rank's stages of a causal LM, as one module under the model's names (`model.layers.4...`, `lm_head`):
    `parameters()` and `state_dict()` are the whole model's restricted to them. `pipeline` runs them."""

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
                             "model(**batch) and accelerator.backward(loss)")


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
        shape, dp = self.shape, data_parallel_mesh(self.mesh)
        pipeline = Pipeline(cast("PreTrainedModel", model), self.mesh["pp"].get_group(), shape.pp_schedule,
                            shape.pp_microbatches, data_parallel=dp.get_group(), parallelize=self._stage_plan)
        held = {id(p) for p in pipeline.parameters()}
        self._new_params.update({id(old): new for old, new in zip(before, model.parameters()) if id(new) in held})
        note(f"pp {shape.pp}: {shape.pp_schedule} over {pipeline.microbatches} microbatches, rank 0 holds stages "
             f"{list(pipeline.layout.stages)} of {pipeline.layout.num_stages}; bubble "
             f"{pipeline.bubble:.0%} of each step")
        return PipelinedModel(pipeline, model.config)

    def _stage_plan(self, stage: nn.Module) -> None:
        """A stage as the mesh path prepares a model, less what spans the whole model: its weights made equal
        over the data-parallel ranks that hold it, fp32 masters, activation checkpointing, `fully_shard` per
        block then the stage; autocast around its forward."""
        assert isinstance(stage, DecoderStage)
        dp = data_parallel_mesh(self.mesh).get_group()
        for tensor in [*stage.parameters(), *stage.buffers()]:
            dist.broadcast(tensor.data, group=dp, group_src=0)
        for step in self.parallelize_plan(stage):
            if step.name in ("fp32 masters", "activation checkpointing", "fully_shard"):
                step.apply(stage)
        self.precision.wrap_forward(stage)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer keeps the parameters this rank's stages hold (as their shards) and drops the others."""
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in self._new_params]
        return super().setup_optimizer(optimizer)

    def forward_backward(self, model: nn.Module, batch: Mapping[str, Any], accumulation_steps: int) -> torch.Tensor:
        input_ids, labels = batch.get("input_ids"), batch.get("labels", batch.get("input_ids"))
        if not isinstance(model, PipelinedModel) or not isinstance(input_ids, torch.Tensor):
            raise HfBackendError("forward_backward(model, batch): pass the prepared model and a batch with "
                                 "input_ids (and labels; without them the input ids are the targets)")
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):
            raise HfBackendError("forward_backward: the batch has padding (attention_mask with zeros); pipeline "
                                 "stages take full rows so far: pack the sequences or pad the labels with -100 only")
        pipeline, rows = model.pipeline, len(input_ids)
        if rows < pipeline.microbatches:
            raise HfBackendError(f"forward_backward: this rank's batch has {rows} rows, fewer than the schedule's "
                                 f"{pipeline.microbatches} microbatches; give ParallelismConfig(pp_microbatches="
                                 f"{rows}) or fewer, or a larger batch")
        device = self.process.device
        return pipeline.step(input_ids.to(device), labels.to(device), 1.0 / accumulation_steps)

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

    def model_state_dict(self, model: torch.nn.Module, sharded: bool = False, trainable_only: bool = False,
                         masters: bool = False) -> dict[str, torch.Tensor]:
        raise _NO_STATE

    def load_model_state_dict(self, model: torch.nn.Module, state_dict: dict[str, Any], sharded: bool = False) -> Any:
        raise _NO_STATE

    def optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             sharded: bool = False) -> dict[str, Any]:
        raise _NO_STATE

    def load_optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  state_dict: dict[str, Any], sharded: bool = False) -> None:
        raise _NO_STATE


_NO_STATE = HfBackendError("saving or loading a model's state under pipeline parallelism (pp_size > 1) is not "
                           "built yet (issue 56); train with pp_size=1 where a checkpoint is needed")
