"""Context parallelism for causal attention (`cp_size`): each of the cp ranks holds one contiguous
slice of every sequence (sequences.py cuts them), and attention all-gathers the keys and values of
the whole sequence across the cp group.

torch's `context_parallel` does not run on CPU (SDPA's CPU kernels have no sharding strategy, Flex
attention no CPU backward), so the attention is hf_backend's own, registered in transformers'
`AttentionInterface` (sequences.py). The slices come from `accelerator.maybe_context_parallel(
buffers=...)`, Accelerate's API, which transformers' Trainer calls with the input ids, labels,
shifted labels and position ids.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

NAME = "hf_backend_context_parallel"


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dimension; backward sums each slice's gradient over the group
    (every rank's queries attended to every rank's keys) and keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (batch, heads, slice, head dim) in, (batch, slice, heads,
    head dim) out. The model's mask is for the slice, so the one used is made from the layout its
    forward gathered, at this slice's place in the sequence."""
    split = module.sequence_split
    key, value = _GatherSequence.apply(key, split.group, 2), _GatherSequence.apply(value, split.group, 2)
    length, total = query.shape[2], key.shape[2]
    start = split.rank * length
    queries = torch.arange(start, start + length, device=query.device)
    mask = split.layout.mask(queries, torch.arange(total, device=query.device))
    # grouped-query attention: each key head serves `repeats` query heads
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.transpose(1, 2).contiguous(), None
