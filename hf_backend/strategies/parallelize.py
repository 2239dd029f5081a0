"""The mesh path's parallelize plan (torchtitan's `parallelize_llama`): an ordered list of named steps, each one
function applied to the model over one mesh. `FSDPStrategy.setup_model` builds the list for a run and applies it;
a new parallelism is one more step here and one more mesh dimension in parallel/dims.py.

The order is torchtitan's: fp32 masters (every rank, so that all shards have one dtype), the weights made equal on
every rank, tensor parallelism, the sequence split (cp or sp), the experts (their own FSDP units), activation
checkpointing, `fully_shard` per block then the root, rank 0's weights sent into the shards, and when FSDP2's
collectives run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..core.errors import HfBackendError
from ..parallel.dims import ExpertMeshes
from .experts import apply_expert_parallel


class Step(NamedTuple):
    """One step of a plan: what it applies (for notes and tests) and the function applying it in place."""

    name: str
    apply: Callable[[torch.nn.Module], Any]


def apply(model: torch.nn.Module, plan: list[Step]) -> torch.nn.Module:
    for step in plan:
        step.apply(model)
    return model


class Rank0Weights(NamedTuple):
    """With cpu_ram_efficient_loading: rank 0's full state and buffers (empty on the other ranks), sent into every
    rank's shards once the model is sharded; rank 0 never holds a second full copy."""

    state: dict[str, Any]  # Module.state_dict()'s type
    buffers: dict[str, torch.Tensor]

    @classmethod
    def take(cls, model: torch.nn.Module, main: bool) -> tuple[Rank0Weights, torch.nn.Module]:
        """The weights (rank 0's), and the model emptied onto the meta device that every rank shards."""
        weights = cls(model.state_dict(), dict(model.named_buffers())) if main else cls({}, {})
        on_meta = any(p.is_meta for p in model.parameters())
        return weights, (model if on_meta else model.to("meta"))

    def send(self, model: torch.nn.Module, device: torch.device) -> None:
        """Every rank's empty shards get rank 0's weights, cast to the shards' dtype; then rank 0's buffers (not
        sharded, and non-persistent ones are in no state dict)."""
        model.to_empty(device=device)
        set_model_state_dict(model, self.state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in self.buffers:
                    buffer.copy_(self.buffers[name])
                torch.distributed.broadcast(buffer, src=0)


def check_loadable(model: torch.nn.Module, rank0_weights: bool, main: bool, split_by_transformers: bool) -> None:
    """One line for a model the mesh path cannot take as it is."""
    if any(p.is_meta for p in model.parameters()) and (main or not rank0_weights):
        raise HfBackendError("prepare(): the model is on the meta device; build it with real weights on rank 0 and "
                             "set cpu_ram_efficient_loading so the other ranks receive them")
    if rank0_weights and split_by_transformers:
        raise HfBackendError("prepare(): cpu_ram_efficient_loading needs rank 0's full weights, and this model was "
                             "split across processes by from_pretrained(tp_plan=...); turn one of them off")


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Ranks that seeded differently train one model (tensor-parallel shards, which differ by rank, are read from
    the weights)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if not isinstance(tensor, DTensor):
            torch.distributed.broadcast(tensor.data, src=0)


def shard_experts(model: torch.nn.Module, meshes: ExpertMeshes, shard_kwargs: dict[str, Any]) -> None:
    """Each MoE layer's experts split over the ep ranks, then their own FSDP units over the ranks holding the same
    experts; on their second dimension, the first being ep's (one all-gather each for a full state, not two
    strided ones)."""
    for experts in apply_expert_parallel(model, meshes.ep):
        fully_shard(experts, **{**shard_kwargs, "mesh": meshes.fsdp}, shard_placement_fn=lambda _: Shard(1))


def checkpoint_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    targets = set(map(id, blocks))
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in targets)


def shard_blocks_then_root(model: torch.nn.Module, blocks: list[torch.nn.Module], shard_kwargs: dict[str, Any]) -> None:
    for block in blocks:
        fully_shard(block, **shard_kwargs)
    fully_shard(model, **shard_kwargs)
