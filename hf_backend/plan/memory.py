"""Memory per process of a training run, worked out before it is launched (`hf-backend plan`).

The model is built on the meta device (no weights, no hardware); each of its parameters is then
placed the way the strategy places it: whole on every process (DDP), cut along its first dimension
with padding (FSDP2's `fully_shard`), flattened and partitioned (DeepSpeed ZeRO), after tensor
parallelism has cut it by the model's own `tp_plan` (the same plan `strategies/tensor_parallel.py`
applies), and a mixture of experts' expert tensors by its `ep_plan` (strategies/experts.py: whole
experts per ep rank, then FSDP over the ranks holding the same ones, on their second dimension).
How each strategy places what is left is its placement (strategies/placement.py), which the plan asks.
Parameters, gradients and AdamW's state follow from those local sizes; what each strategy adds
(DDP's gradient buckets, DeepSpeed's fp32 master partition) is counted where the strategy allocates
it. Activations are an estimate from the model's shape. docs/memory.md says what was
measured against real runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.errors import HfBackendError
from ..parallel.dims import MeshShape
from . import stages

# torch is imported where a model is built: the command line's parser loads without it
if TYPE_CHECKING:
    import torch

# the names `--strategy` takes; strategies/placement.py says how each places a model (imported with a model built,
# so the command line's parser loads without torch)
STRATEGIES = ("no", "ddp", "fsdp", "zero1", "zero2", "zero3")
# How each tp_plan style cuts a weight (dimension) and its bias (None: kept whole);
# strategies/tensor_parallel.py
_TP_DIMS = {"colwise": (0, 0), "colwise_rep": (0, 0), "colwise_gather_output": (0, 0), "rowwise": (1, None),
            "rowwise_rep": (1, None), "rowwise_split_input": (1, None), "embedding_rowwise": (0, None)}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per process (the largest share where processes differ), by what holds them."""

    strategy: str
    shape: MeshShape
    parameters: int  # how many the model has
    trainable: int
    # the model's weights as this process holds them, plus DeepSpeed's fp32 master partition
    parameter_bytes: int
    gradient_bytes: int  # gradients, plus DDP's gradient buckets
    optimizer_bytes: int  # AdamW's two moments
    activation_bytes: int  # an estimate for one micro batch
    notes: tuple[str, ...] = ()
    experts_per_rank: int = 0  # of each mixture-of-experts layer, the experts one rank runs (0: no experts split)

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shape"] = {**dict(zip(MeshShape.DIMS, self.shape.sizes)), "ep": self.shape.ep}
        out["total_bytes"] = self.total_bytes
        out["notes"] = list(self.notes)
        return out


def plan_memory(model: torch.nn.Module, strategy: str, num_processes: int = 1, *, mixed_precision: str = "no",
                shape: MeshShape | None = None, batch_size: int = 1, sequence_length: int = 512,
                activation_checkpointing: bool = False) -> MemoryPlan:
    """The plan for `model` (on the meta device or not: only shapes, dtypes and `requires_grad` are
    read) trained with AdamW under `strategy` by `num_processes` processes. `shape`: a
    ParallelismConfig's mesh (FSDP over dp_shard x cp, tensor parallelism over tp); default: every
    process a data-parallel replica (DDP, ZeRO) or shard (FSDP)."""
    if strategy not in STRATEGIES:
        raise HfBackendError(f"plan: strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if num_processes < 1:
        raise HfBackendError(f"plan: num_processes={num_processes}; give 1 or more")
    if num_processes == 1:
        # the engine trains one process unsharded whatever was asked (docs/fsdp.md, docs/deepspeed.md)
        strategy = "no"
    from ..strategies.placement import PLACEMENTS

    placement = PLACEMENTS[strategy]
    if shape is None:
        shape = placement.default_shape(num_processes)
    if shape.world != num_processes:
        raise HfBackendError("plan: the parallelism sizes "
                             f"{dict(zip(MeshShape.DIMS, shape.sizes))} make "
                             f"{shape.world} processes, not {num_processes}; "
                             f"make them multiply to {num_processes}")
    if shape.pp > 1 and hasattr(model, "peft_config"):
        raise HfBackendError("plan: pipeline stages take a transformers causal LM, not a PEFT model; drop pp or "
                             "--lora")
    if shape.needs_mesh and not placement.takes_mesh:
        raise HfBackendError("plan: dp_shard, cp and tp sizes run under FSDP (the engine's mesh), "
                             f"not {strategy}; pass --strategy fsdp")
    if shape.tp > 1 and hasattr(model, "peft_config"):
        raise HfBackendError("plan: tensor parallelism does not take a PEFT adapter (the engine "
                             "refuses it); drop tp or --lora")
    tp_dims = _tp_dims(model) if shape.tp > 1 else {}
    experts, experts_per_rank = _expert_tensors(model, shape.ep) if shape.ep > 1 else (set(), 0)
    shards = placement.shards(shape, num_processes)
    ranks = stages.pp_ranks(model, shape) if shape.pp > 1 else [stages.EVERYTHING]
    priced = []
    for rank in ranks:
        sums, count, _ = _sums(model, rank.holds, tp_dims, experts, shape, placement, shards)
        held = placement.held(sums, num_processes)
        activations = _activations(model, mixed_precision, batch_size, sequence_length, shape,
                                   activation_checkpointing, rank)
        priced.append((held.parameters + held.gradients + held.optimizer + activations, count, rank, held,
                       activations))
    _, _, rank, held, activations = max(priced, key=lambda p: p[0])  # the most loaded rank, the first of equals
    notes = held.notes
    if shape.pp > 1:
        notes += (stages.describe(shape, [(p[2], p[1], p[0]) for p in priced], rank),)
    _, count, trainable = _sums(model, None, tp_dims, experts, shape, placement, shards)
    return MemoryPlan(strategy=strategy, shape=shape, parameters=count, trainable=trainable,
                      parameter_bytes=held.parameters, gradient_bytes=held.gradients, optimizer_bytes=held.optimizer,
                      activation_bytes=activations, notes=notes, experts_per_rank=experts_per_rank)


def _sums(model: torch.nn.Module, holds: Callable[[str], bool] | None, tp_dims: dict[str, int], experts: set[str],
          shape: MeshShape, placement: Any, shards: int) -> tuple[Any, int, int]:
    """What one process holds of the parameters `holds` says are its (None: all): the placement's sums, and how
    many parameters and trainable ones there are."""
    from ..strategies.placement import Sums

    weights = grads = full_trainable = 0
    seen: set[int] = set()
    count = trainable = 0
    for name, param in model.named_parameters():
        if id(param) in seen or (holds is not None and not holds(name)):
            continue  # a tied weight is held once
        seen.add(id(param))
        count += param.numel()
        local = list(param.shape)
        dim = tp_dims.get(name)
        if dim is not None and dim < len(local):
            local[dim] = math.ceil(local[dim] / shape.tp)
        if name in experts:  # whole experts per ep rank, FSDP over the rest on the second dimension
            local[0] //= shape.ep
            numel = local[0] * math.ceil(local[1] / shape.expert_shards) * math.prod(local[2:])
        else:
            numel = placement.local_numel(local, shards)
        size = param.element_size()
        weights += numel * size
        if param.requires_grad:
            trainable += param.numel()
            grads += numel * size
            full_trainable += math.prod(local) * size
    return Sums(weights, grads, full_trainable, trainable, _element_size(model)), count, trainable


def _element_size(model: torch.nn.Module) -> int:
    return next((p.element_size() for p in model.parameters() if p.requires_grad), 4)


def _expert_tensors(model: torch.nn.Module, ep: int) -> tuple[set[str], int]:
    """The parameters the model's ep_plan splits over the `ep` ranks, and how many experts each rank runs."""
    from ..strategies.experts import ep_plan, expert_tensors

    names = expert_tensors(model, ep_plan(model))
    if not names:
        raise HfBackendError(f"plan: {type(model).__name__} has no ep_plan (it is not a mixture-of-experts model "
                             "transformers can split); drop ep")
    count = dict(model.named_parameters())[min(names)].shape[0]
    if count % ep:
        raise HfBackendError(f"plan: {type(model).__name__} has {count} experts per layer, which do not split "
                             f"over ep {ep}; use an ep that divides it")
    return names, count // ep


def _tp_dims(model: torch.nn.Module) -> dict[str, int]:
    """Which dimension tensor parallelism cuts, per parameter name, by the model's tp_plan."""
    from ..strategies.tensor_parallel import tp_plan

    plan = tp_plan(model)
    if not plan:
        raise HfBackendError(f"plan: {type(model).__name__} has no tp_plan "
                             "(BERT and GPT-2 have none); drop tp")
    patterns = [(re.compile(path.replace(".", r"\.").replace("*", r"[^.]+")), style) for path, style in plan.items()]
    dims: dict[str, int] = {}
    for module_name, module in model.named_modules():
        style = next((s for pattern, s in patterns if pattern.fullmatch(module_name)), None)
        if style not in _TP_DIMS:
            continue
        weight_dim, bias_dim = _TP_DIMS[style]
        for pname, dim in (("weight", weight_dim), ("bias", bias_dim)):
            if dim is not None and getattr(module, pname, None) is not None:
                dims[f"{module_name}.{pname}"] = dim
    return dims


def _activations(model: torch.nn.Module, mixed_precision: str, batch: int, seq: int, shape: MeshShape,
                 checkpointing: bool, rank: stages.Rank) -> int:
    """What backward keeps of one micro batch, for a transformer (an estimate; 0 for a model without a
    config that says its width): per layer about 8 hidden-wide and 5 MLP-wide tensors per token
    (norms, q/k/v, attention output, residuals; gate, up, activation, product, down input), only the
    layer's input under activation checkpointing; plus the fp32 logits and their gradient. On pipeline stages
    (`rank`): the rank's layers, for each of the microbatches its schedule holds at once, and the logits on the
    last stage's rank."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(hidden, int) or not isinstance(layers, int):
        return 0
    width = getattr(text, "intermediate_size", None) or 4 * hidden
    element = 2 if mixed_precision in ("bf16", "fp16") else 4
    rows, logits_held = batch, 1
    if rank.holds is not None:  # pipeline stages: the layers of each microbatch kept at once
        rows, layers, logits_held = stages.microbatch_rows(batch, shape), rank.layer_microbatches, rank.logits_held
    tokens = rows * math.ceil(seq / shape.sequence_slices)
    per_layer = tokens * element * (8 * hidden + 5 * width // shape.tp)
    kept = layers * tokens * element * hidden + per_layer if checkpointing else layers * per_layer
    output_embeddings = getattr(model, "get_output_embeddings", None)
    vocab = getattr(text, "vocab_size", 0) if callable(output_embeddings) and output_embeddings() is not None else 0
    return kept + logits_held * 2 * tokens * vocab * 4


def build_on_meta(source: str, lora_rank: int = 0, lora_targets: list[str] | None = None,
                  dtype: str | None = None) -> torch.nn.Module:
    """The model a config (a directory with config.json, or the file) describes, built on the meta
    device, with a LoRA adapter when `lora_rank` (peft)."""
    from pathlib import Path

    import torch
    import transformers

    path = Path(source)
    if not path.exists():
        raise HfBackendError(f"plan: {source} does not exist; pass "
                             "a model directory or its config.json")
    config = transformers.AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    chosen = dtype or str(getattr(config, "dtype", None) or "float32")
    torch_dtype = getattr(torch, chosen.replace("torch.", ""), None)
    if not isinstance(torch_dtype, torch.dtype):
        raise HfBackendError(f"plan: dtype {chosen!r} is not a torch "
                             "dtype; pass float32, bfloat16 or float16")
    with torch.device("meta"):
        if cls is None:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        else:
            model = cls._from_config(config, dtype=torch_dtype)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = lora_targets or ["q_proj", "v_proj"]
        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules=targets))
    return model
