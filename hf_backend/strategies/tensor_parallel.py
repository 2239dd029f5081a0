"""Tensor parallelism from a transformers model's own `tp_plan`, applied with torch's
`parallelize_module`.

A plan maps module paths (`layers.*.self_attn.q_proj`) to style names; each name becomes a torch
ParallelStyle. Colwise layers keep their output sharded on the last dimension (each rank computes
its own attention heads and MLP columns), rowwise layers all-reduce it back, so nothing between them
changes but the number of local heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from ..core.errors import HfBackendError
from ..core.notes import note


class VocabularyParallelEmbedding(RowwiseParallel):
    """An embedding's vocabulary rows split over the tensor-parallel ranks, as torch's RowwiseParallel
    splits them, but looked up, all-reduced and waited for in one eager call that dynamo leaves out of
    any compiled graph. torch 2.13 cannot compile the lookup (its masked partial sum: "Mixing fake
    modes"), and torch's own style returns the output unwaited (an `AsyncCollectiveTensor`), which
    aot_autograd reads, as the input of a compiled block, as not requiring grad: the first block's
    compiled norm then silently drops its share of the embedding's gradient (measured)."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate())

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        distribute_module(module, device_mesh, self._partition_embedding_fn)
        lookup = module.forward

        def vocabulary_parallel_forward(input_ids: torch.Tensor) -> torch.Tensor:
            ids = DTensor.from_local(input_ids, device_mesh, (Replicate(),), run_check=False)
            return lookup(ids).redistribute(placements=(Replicate(),)).to_local()

        module.forward = torch.compiler.disable(vocabulary_parallel_forward)
        return module


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module applied to each rank's own heads with one weight for every head (Qwen3's `q_norm` and `k_norm`,
    RMSNorms over the head dimension, the dimension before the last): its input's heads gathered from every tp rank,
    the module run on all of them with its weight replicated, and this rank's heads handed on. Every rank then
    computes the weight's whole gradient, a replicated one (as FSDP and clipping take it); on this rank's heads
    alone it would be a partial sum. The cost: the heads all-gathered, forward and backward."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        def every_head(_: torch.nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
            x = inputs[0]
            whole = DTensor.from_local(x, mesh, (Shard(x.dim() - 2),), run_check=False)
            return (whole.redistribute(placements=(Replicate(),)), *inputs[1:])

        def own_heads(_: torch.nn.Module, output: Any, mesh: DeviceMesh) -> Any:
            return output.redistribute(placements=(Shard(output.dim() - 2),)).to_local()

        # no partition function: every parameter a replicated DTensor
        return distribute_module(module, device_mesh, input_fn=every_head, output_fn=own_heads)


STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # an nn.Embedding: vocabulary rows
    "embedding_rowwise": VocabularyParallelEmbedding,
    "replicate": lambda: None,  # every rank keeps the whole module
    "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce,
}


def is_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh | None) -> bool:
    """Whether `from_pretrained(..., tp_plan="auto")` sharded the model already over a mesh equal to
    the run's tensor-parallel dimension (transformers lays its own mesh over every process: so when
    tp_size is the world size): prepare then takes it as it is. Sharded over any other mesh, it
    cannot join the run's: one line."""
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if not meshes:
        return False
    if tp_mesh is None or any(mesh != tp_mesh for mesh in meshes.values()):
        raise HfBackendError("prepare(): the model was sharded by from_pretrained(tp_plan=...) "
                             "over a mesh that is not this run's tensor-parallel dimension "
                             "(transformers spans every process); load it without tp_plan and set "
                             "tp_size: prepare applies the model's tp_plan over the run's mesh")
    return True


def config_plan(model: torch.nn.Module, kind: str) -> dict[str, str]:
    """The base model's `kind` plan ("tp", "ep") from its config (`base_model_tp_plan`), with full
    module paths: under the base model's prefix."""
    base_plan = dict(getattr(getattr(model, "config", None), f"base_model_{kind}_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    nested = prefix and isinstance(getattr(model, prefix, None), torch.nn.Module)
    return {f"{prefix}.{path}" if nested else path: style for path, style in base_plan.items()}


def refuse_unknown_styles(plan: dict[str, str], known: Any, what: str, name: str, kind: str) -> None:
    """One line for a `kind` plan ("tp", "ep") naming a style hf_backend does not apply."""
    unknown = sorted({style for style in plan.values() if style not in known})
    if unknown:
        raise HfBackendError(f"{what}: {name}'s {kind}_plan uses style {unknown[0]!r}, which hf_backend does "
                             f"not apply (it applies {', '.join(known)}); set {kind}_size=1")


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's plan with full module paths: the base model's (from its config) under its prefix,
    then the head's own (`lm_head`)."""
    return {**config_plan(model, "tp"), **(getattr(model, "_tp_plan", None) or {})}


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard `model` in place over `tp_mesh` by its plan; one line for a model that cannot be."""
    size = tp_mesh.size()
    name = type(model).__name__
    if hasattr(model, "peft_config"):
        raise HfBackendError(f"tensor parallelism: {name} carries a PEFT adapter; apply tensor "
                             "parallelism to the base model (adapters on sharded layers are not "
                             "supported yet) or train the adapter with FSDP (dp_shard_size) alone")
    plan = tp_plan(model)
    if not plan:
        raise HfBackendError(f"tensor parallelism: {name} has no tp_plan (BERT and GPT-2 have "
                             "none); set tp_size=1 and shard with dp_shard_size (FSDP) instead")
    refuse_unknown_styles(plan, STYLES, "tensor parallelism", name, "tp")
    _check_divisible(model, size)
    output = getattr(model, "get_output_embeddings", lambda: None)()
    tied = output is not None and any(output.weight is p for p in _input_weights(model))
    styles: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        made = STYLES[style]()
        if made is None:
            continue
        if tied and path.rsplit(".", 1)[-1] == "lm_head":
            note("tensor parallelism: lm_head shares its weight with the input embeddings, so it "
                 "stays whole on every rank")
            continue
        styles[path] = made
    parallelize_module(model, tp_mesh, styles)
    sharded = sum(1 for p in model.parameters() if isinstance(p, DTensor) and any(isinstance(pl, Shard)
                                                                                  for pl in p.placements))
    if not sharded:
        raise HfBackendError(f"tensor parallelism: {name}'s tp_plan "
                             "matched none of its modules; set tp_size=1")


def _input_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    return [embeddings.weight] if embeddings is not None else []


def _check_divisible(model: torch.nn.Module, size: int) -> None:
    """Heads and MLP width split evenly across the tensor-parallel ranks, or the local attention
    reshapes fail."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(text, field, None)
        if isinstance(value, int) and value % size:
            raise HfBackendError(f"tensor parallelism: {type(model).__name__} has "
                                 f"{field}={value}, which does not split over "
                                 f"tp_size={size}; use a tp_size that divides it")
