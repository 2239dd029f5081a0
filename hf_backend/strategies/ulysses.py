"""Ulysses sequence parallelism (`sp_size`): each of the sp ranks holds one slice of every sequence
(sequences.py cuts them), and around attention an all-to-all trades it for the whole sequence of a
group of heads: queries, keys and values go from (batch, heads, slice, dim) to (batch, heads / sp,
sequence, dim), attention runs over the whole sequence for those heads, and one more all-to-all
brings the output back to this rank's slice. Memory per rank: the activations of one slice, and
attention's of heads / sp heads; no rank ever holds every head's keys and values.

Heads split by tensor parallelism first (the attention modules hold heads / tp), then by sp; key
heads fewer than the sp ranks (grouped-query attention) are repeated to the query heads first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ..core.errors import HfBackendError
from .context_parallel import masked_attention

if TYPE_CHECKING:
    from .sequences import SequenceSplit

NAME = "hf_backend_ulysses"


class _Routed(Protocol):
    """An attention module `SequenceSplit.apply` routed here."""

    sequence_split: SequenceSplit


def _all_to_all(x: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
    """Chunk i of `x` along `scatter` goes to rank i; what rank i sends back lands as chunk i along
    `gather`."""
    size = dist.get_world_size(group)
    sent = [t.contiguous() for t in x.chunk(size, dim=scatter)]
    received = [torch.empty_like(sent[0]) for _ in range(size)]
    dist.all_to_all(received, sent, group=group)
    return torch.cat(received, dim=gather)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` with its inverse (gather and scatter swapped) as the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def attention(module: _Routed, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (batch, heads, slice, head dim) in, (batch, slice, heads,
    head dim) out. The model's mask is for the slice, so the whole sequences' one is made from the
    layout its forward gathered: with padding or packing, the ring's blockwise attention over one
    block (context_parallel.py), which never makes the sequence-squared mask."""
    split = module.sequence_split
    heads, size = query.shape[1], split.size
    if heads % size:
        raise HfBackendError(f"sequence parallelism: {heads} attention heads per rank do not split over "
                             f"sp_size={size}; choose an sp_size that divides them")
    if key.shape[1] % size:
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    query, key, value = (_AllToAll.apply(t, split.group, 1, 2) for t in (query, key, value))
    if split.layout.plain:  # causal over the whole sequence: SDPA's fused kernel
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True,
                                                               scale=scaling, enable_gqa=True)
    elif dropout:
        raise HfBackendError(f"sequence parallelism: attention dropout ({dropout}) with padded or packed batches "
                             "is not applied; set the model's attention_dropout=0")
    else:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = masked_attention(query, key, value, split.layout, scale)
    return _AllToAll.apply(out, split.group, 2, 1).transpose(1, 2).contiguous(), None


def check_heads(model: torch.nn.Module, tp: int, sp: int) -> None:
    """One line, when the model is prepared, for heads that tp x sp cannot split."""
    config: Any = model.config  # transformers' config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and (heads % tp or (heads // tp) % sp):
        per = f" ({heads // tp} per tp rank)" if tp > 1 and heads % tp == 0 else ""
        raise HfBackendError(f"sequence parallelism: {type(model).__name__} has {heads} attention heads{per}, "
                             f"which do not split over sp_size={sp}; choose an sp_size that divides them")
