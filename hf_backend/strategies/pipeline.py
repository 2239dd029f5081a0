"""Pipeline parallelism (issue 56, its first part): a transformers decoder cut into stages over the pp ranks and
trained by one of torch.distributed.pipelining's schedules, the torchtitan way.

The stages come from the model's own `base_model_pp_plan` (Llama, Qwen, Mistral, ...): the parts before its
repeated blocks (the embeddings) on the first stage, the blocks split evenly, the parts after them (the final norm)
and the model's head on the last. Each stage keeps the model's module names (`model.layers.5.mlp...`, `lm_head`),
so its state dict is the whole model's restricted to its parts. Single-stage schedules (GPipe, 1F1B) put stage r on
pp rank r; looped ones (interleaved 1F1B, looped BFS, interleaved zero bubble) `stages_per_rank` stages r, r + pp,
...; V-shaped ones (ZBV zero bubble, DualPipeV) stages r and 2 pp - 1 - r.

The loss is the model's causal-LM cross-entropy, each microbatch's sum over its tokens divided by the tokens of the
whole batch, so the microbatches' losses add up to the batch's mean and their gradients to the batch's (the schedule
scales nothing). Every pp rank has the rows, so each stage takes their padding mask and position ids as the decoder
does; tied embeddings across stages and a model without a pp plan are refused in one line. On the engine:
pipeline_strategy.py (`ParallelismConfig(pp_size=P)`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


class Layout(NamedTuple):
    """Which stages one pp rank holds (`stages`, in schedule order) of `num_stages`, and each stage's blocks."""

    num_stages: int
    stages: tuple[int, ...]
    blocks: tuple[range, ...]  # per stage index, the decoder layers it holds


def schedule_class(name: str) -> type:
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        return get_schedule_class(name)
    except ValueError:
        raise ConfigError(f"pp_schedule={name!r} is not one of torch.distributed.pipelining's schedules; use "
                          "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or "
                          "DualPipeV") from None


def is_looped(name: str) -> bool:
    """Whether the schedule drives several stages per rank."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(schedule_class(name), PipelineScheduleMulti)


def layout(schedule: str, pp: int, pp_rank: int, num_layers: int, stages_per_rank: int = 2) -> Layout:
    """The stages of `pp_rank` and every stage's decoder layers, contiguous and as even as they can be (a stage
    with one layer more sits after the first, which holds the embeddings too)."""
    per_rank = (2 if schedule in V_SHAPED else stages_per_rank) if is_looped(schedule) else 1
    num_stages = pp * per_rank
    if num_layers < num_stages:
        raise ConfigError(f"pp_size={pp} with {per_rank} stage(s) per rank ({schedule}) needs at least {num_stages} "
                          f"decoder layers; the model has {num_layers}")
    if schedule in V_SHAPED:
        stages: tuple[int, ...] = (pp_rank, 2 * pp - 1 - pp_rank)
    else:
        stages = tuple(pp_rank + k * pp for k in range(per_rank))
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if 1 <= stage <= extra else 0) for stage in range(num_stages)]
    starts = [sum(sizes[:stage]) for stage in range(num_stages)]
    return Layout(num_stages, stages, tuple(range(s, s + n) for s, n in zip(starts, sizes)))


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> float:
    """The share of a step each rank idles in the schedule's warm-up and cool-down, in units of one stage's
    forward and backward: (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) with v stages per rank
    interleaved; the zero-bubble schedules fill it with weight gradients (0 in that model)."""
    if "ZeroBubble" in schedule or schedule == "DualPipeV":
        return 0.0
    v = stages_per_rank if is_looped(schedule) else 1
    return (pp - 1) / (v * microbatches + pp - 1)


class Decoder(nn.Module):
    """A stage's part of the decoder, under the decoder's own attribute names."""

    embed_tokens: nn.Module | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    rotary_emb: nn.Module


class DecoderStage(nn.Module):
    """Part of a transformers causal LM: the decoder (`model.<base>`) with only this stage's blocks, the embeddings
    on the first stage, the final norm and the head on the last. Its forward is the decoder's: token ids or hidden
    states in, hidden states or logits out."""

    lm_head: nn.Module | None

    def __init__(self, model: PreTrainedModel, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.base_name = model.base_model_prefix
        base = getattr(model, self.base_name)
        part = Decoder()
        for name in base.config.base_model_pp_plan:
            if name == "layers":
                part.layers = nn.ModuleDict({str(i): base.layers[i] for i in blocks})
            elif name == "embed_tokens":
                part.embed_tokens = base.embed_tokens if first else None
            else:  # after the blocks: the final norm
                setattr(part, name, getattr(base, name) if last else None)
        part.rotary_emb = base.rotary_emb  # every stage computes the positions' rotations (buffers only)
        self.add_module(self.base_name, part)
        self.lm_head = getattr(model, "lm_head") if last else None  # noqa: B009  (a transformers attribute)
        self._no_split_modules = getattr(model, "_no_split_modules", None)  # its blocks' class (FSDP's units)
        self.base_model_prefix = self.base_name  # with the model's names, its tp plan applies to the stage
        self._tp_plan = getattr(model, "_tp_plan", None) if last else None

    @property
    def part(self) -> Decoder:
        return cast(Decoder, getattr(self, self.base_name))

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`attention_mask` and `position_ids` (every pp rank has its rows') as the decoder takes them: a padding
        mask, positions that restart where packed sequences do."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        part = self.part
        hidden = part.embed_tokens(inputs) if part.embed_tokens is not None else inputs
        positions = position_ids if position_ids is not None else \
            torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        given: dict[str, Any] = {"config": self.config, "inputs_embeds": hidden, "attention_mask": attention_mask,
                 "past_key_values": None, "position_ids": positions}
        masks = {"full_attention": create_causal_mask(**given)}
        layer_types = getattr(self.config, "layer_types", None) or []
        if "sliding_attention" in layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**given)
        rotations = part.rotary_emb(hidden, position_ids=positions)
        for index, layer in part.layers.items():
            kind = layer_types[int(index)] if layer_types else "full_attention"
            hidden = layer(hidden, attention_mask=masks[kind], position_embeddings=rotations, position_ids=positions)
        if self.lm_head is None or part.norm is None:
            return hidden
        return self.lm_head(part.norm(hidden))


def check_splittable(model: nn.Module) -> None:
    """One line for a model the stages cannot be cut from."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    plan = getattr(getattr(base, "config", None), "base_model_pp_plan", None)
    if base is None or not plan or "layers" not in plan or not hasattr(model, "lm_head"):
        raise ConfigError(f"pipeline parallelism: {type(model).__name__} has no base_model_pp_plan with its "
                          "layers and no lm_head; pp takes transformers causal LMs that have one (Llama, Qwen, "
                          "Mistral, ...)")
    if getattr(model.config, "tie_word_embeddings", False):
        raise ConfigError("pipeline parallelism: the model ties its embeddings to its head (first and last stage); "
                          "load it with tie_word_embeddings=False")


class Pipeline:
    """This rank's stages of `model` and the schedule that trains them over `group` (the pp ranks, in order).
    `step(input_ids, labels)` runs forward and backward over the microbatches and returns the global batch's mean
    loss on every rank; `parameters()` are the stages' (what an optimizer of this rank takes).

    With `data_parallel` (the ranks holding the same stages, each with other rows of the global batch), `parallelize`
    is applied to each stage before the schedule sees it (FSDP's `fully_shard` per block then the stage, over those
    ranks), and the loss is the global batch's: each rank's share of the mean over every rank's targets, times the
    data-parallel size, since FSDP averages the ranks' gradients."""

    def __init__(self, model: PreTrainedModel, group: dist.ProcessGroup, schedule: str = "1F1B",
                 microbatches: int | None = None, stages_per_rank: int = 2,
                 data_parallel: dist.ProcessGroup | None = None,
                 parallelize: Callable[[nn.Module], object] | None = None,
                 sequence: dist.ProcessGroup | None = None) -> None:
        from torch.distributed.pipelining import PipelineStage

        check_splittable(model)
        self.group, self.pp, rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.data_parallel = data_parallel
        self.dp = dist.get_world_size(data_parallel) if data_parallel is not None else 1
        num_layers = len(getattr(model, model.base_model_prefix).layers)
        self.schedule_name = schedule
        # the ranks holding the other slices of this rank's sequences (cp, sp), whose targets come shifted
        self.sequence = sequence
        self.shifted = sequence is not None
        self.layout = layout(schedule, self.pp, rank, num_layers, stages_per_rank)
        device = next(model.parameters()).device
        last = self.layout.num_stages - 1
        self.modules = [DecoderStage(model, self.layout.blocks[s], s == 0, s == last) for s in self.layout.stages]
        for module in self.modules:
            if parallelize is not None:
                parallelize(module)
        stages = [PipelineStage(module, s, self.layout.num_stages, device, group=group)
                  for module, s in zip(self.modules, self.layout.stages)]
        self.holds_last = last in self.layout.stages
        # the pp rank holding the last stage (V-shaped schedules: rank 0)
        self.last_rank = next(r for r in range(self.pp) if last in layout(schedule, self.pp, r, num_layers,
                                                                            stages_per_rank).stages)
        self._shape: tuple[bool, tuple[int, ...]] | None = None  # (training?, input shape) of the last batch
        self._scale = torch.ones(())  # what each microbatch's summed loss is divided by, set by step
        self.microbatches = microbatches or self.layout.num_stages  # by default one per stage
        cls = schedule_class(schedule)
        self.schedule = cls(stages if is_looped(schedule) else stages[0], self.microbatches, loss_fn=self._loss,
                            scale_grads=False)
        self.bubble = bubble_fraction(schedule, self.pp, self.microbatches, len(self.layout.stages))

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's causal-LM loss (targets shifted by one, -100 ignored), summed over this microbatch and
        divided by the global batch's target tokens (times the data-parallel size: FSDP averages)."""
        targets = labels if self.shifted else nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        total = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                            reduction="sum")
        return total / self._scale

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, gradient_scale: float = 1.0,
             num_items: torch.Tensor | float | None = None, **extra: torch.Tensor) -> torch.Tensor:
        """One forward and backward of this rank's rows of the global batch; the global batch's mean loss.
        `gradient_scale`: what the gradients are multiplied by (1 / the accumulation steps). `num_items`: the
        target tokens of every rank's rows of the whole accumulation window (transformers' `num_items_in_batch`):
        the loss is then the window's sum so far divided by them, and so are the gradients. `extra`: the
        `attention_mask` and `position_ids` of the rows, given to every stage."""
        self._check_shape(input_ids, training=True)
        if num_items is None:
            tokens = self._targets(labels)
            if self.data_parallel is not None:
                dist.all_reduce(tokens, group=self.data_parallel)
            divisor = tokens.clamp(min=1) / gradient_scale
        else:
            divisor = torch.as_tensor(num_items, dtype=torch.float32, device=labels.device).clamp(min=1)
        self._scale = divisor / self.dp  # FSDP averages the data-parallel ranks' gradients
        losses: list[torch.Tensor] = []
        inputs = (input_ids,) if 0 in self.layout.stages else ()
        # the logits stay on the last stage, a microbatch at a time: never merged into the whole batch's
        self.schedule.step(*inputs, target=labels if self.holds_last else None, losses=losses, return_outputs=False,
                           **extra)
        loss = self._batch_loss(losses, self.dp, self.data_parallel)
        return loss if num_items is not None else loss / gradient_scale

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None,
                 num_items: torch.Tensor | float | None = None, logits: bool = False,
                 **extra: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Forward only, through the stages: the loss of this rank's rows (their mean over their targets; with
        `num_items`, every rank's sum divided by it) on every pp rank, None without labels; with `logits`, the
        rows' logits in fp32, sent from the last stage's rank to every pp rank. With `sequence`, the rows are
        every slice's: their loss is summed over the slices."""
        if self.schedule_name in V_SHAPED:
            raise ConfigError(f"evaluation through pipeline stages with pp_schedule={self.schedule_name}: torch's "
                              "V-shaped schedules run no forward-only step; to evaluate, train with GPipe, 1F1B, "
                              "Interleaved1F1B, LoopedBFS or InterleavedZeroBubble")
        self._check_shape(input_ids, training=False)
        if labels is not None:
            local = num_items is None
            divisor = self._targets(labels) if local else \
                torch.as_tensor(num_items, dtype=torch.float32, device=labels.device)
            if local and self.sequence is not None:  # this rank's rows are every slice's
                dist.all_reduce(divisor, group=self.sequence)
            self._scale = divisor.clamp(min=1)
        losses: list[torch.Tensor] = []
        inputs = (input_ids,) if 0 in self.layout.stages else ()
        # the schedule computes a loss whenever it has a loss function: without labels, the ids' (not returned)
        target = (labels if labels is not None else input_ids) if self.holds_last else None
        out = self.schedule.eval(*inputs, target=target, losses=losses, **extra)
        loss = None if labels is None else \
            self._batch_loss(losses, 1, self.sequence if num_items is None else self.data_parallel)
        if not logits:
            return loss, None
        vocab = self.modules[-1].config.vocab_size
        buffer = out.float() if self.holds_last else torch.empty((*input_ids.shape, vocab), device=input_ids.device)
        dist.broadcast(buffer, group=self.group, group_src=self.last_rank)
        return loss, buffer

    def _targets(self, labels: torch.Tensor) -> torch.Tensor:
        return ((labels if self.shifted else labels[..., 1:]) != -100).sum().float()

    def _batch_loss(self, losses: list[torch.Tensor], ranks: int, over: dist.ProcessGroup | None) -> torch.Tensor:
        """The microbatches' losses (on the last stage) summed, divided by `ranks`, summed over the pp ranks (from
        the last stage's) and over `over`."""
        device = self._scale.device
        loss = torch.stack(losses).sum().detach() / ranks if self.holds_last else torch.zeros((), device=device)
        dist.all_reduce(loss, group=self.group)
        if over is not None:
            dist.all_reduce(loss, group=over)
        return loss

    def _check_shape(self, input_ids: torch.Tensor, training: bool) -> None:
        """torch's stages size their buffers from the first batch after each switch between training and
        evaluation; a batch of another shape in between is refused here, on every rank at once, rather than left
        to break the stages' sends and receives."""
        shape = (training, tuple(input_ids.shape))
        changed = torch.tensor(int(self._shape is not None and self._shape[0] == training and self._shape != shape),
                               device=input_ids.device)  # (NCCL reduces device tensors only)
        if self.data_parallel is not None:  # the pp ranks of one data-parallel index read the same rows
            dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.data_parallel)
        if changed:
            before = self._shape[1] if self._shape is not None else ()
            raise ConfigError(f"pipeline stages: a batch of {' x '.join(map(str, shape[1]))} tokens after batches of "
                              f"{' x '.join(map(str, before))}; every batch of a run must have one shape: pad to "
                              "a fixed length (padding='max_length') or pack the sequences")
        self._shape = shape

    def parameters(self) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for module in self.modules:
            for parameter in module.parameters():
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    yield parameter

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """The stages' parameters under the whole model's names."""
        return {name: p for module in self.modules for name, p in module.named_parameters()}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Every stage's gradients (their shards under FSDP) scaled by one factor from the norm over all of them;
        the norm, on every rank."""
        from .fsdp import clip_grad_norm

        return clip_grad_norm(self.parameters(), max_norm, norm_type, across=(self.group,))

    def describe(self) -> dict[str, Any]:
        return {"stages": list(self.layout.stages), "num_stages": self.layout.num_stages,
                "blocks": [list(self.layout.blocks[s]) for s in self.layout.stages], "bubble": self.bubble}
