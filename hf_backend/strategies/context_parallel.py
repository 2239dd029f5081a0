"""Context parallelism for causal attention: each of the cp ranks holds one contiguous slice of every
sequence, and attention all-gathers the keys and values of the whole sequence across the cp group.

torch's `context_parallel` does not run on CPU (SDPA's CPU kernels have no sharding strategy, Flex
attention no CPU backward), so the attention is hf_backend's own, registered in transformers'
`AttentionInterface` and given to the model's attention modules through a copy of their config (the
model's own config keeps its implementation, which transformers' Trainer checks). The slices come
from `accelerator.maybe_context_parallel(buffers=...)`, Accelerate's API, which transformers'
Trainer calls with the input ids, labels, shifted labels and position ids.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import HfBackendError

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
    """transformers' attention signature: (batch, heads, local length, head dim) in, (batch, local
    length, heads, head dim) out. The mask is the causal one at this slice's global offset (padding
    is on the right only, which `check_inputs` makes sure of, so real tokens never see it)."""
    group = module.context_parallel_group
    key, value = _GatherSequence.apply(key, group, 2), _GatherSequence.apply(value, group, 2)
    length, total = query.shape[2], key.shape[2]
    start = dist.get_rank(group) * length
    positions = torch.arange(start, start + length, device=query.device)
    causal = positions[:, None] >= torch.arange(total, device=query.device)[None, :]
    # grouped-query attention: each key head serves `repeats` query heads
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=causal, dropout_p=dropout,
                                                           scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def apply_context_parallel(model: torch.nn.Module, cp_mesh: DeviceMesh) -> None:
    """Point the model's attention modules at `attention` over `cp_mesh`; one line for a model that
    cannot be."""
    from transformers import AttentionInterface

    name = type(model).__name__
    modules = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "config")]
    if not modules or not all(m.is_causal for m in modules):
        raise HfBackendError(f"context parallelism: {name} has non-causal attention; cp splits the "
                             "sequences of causal LMs only: set cp_size=1")
    config = modules[0].config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "sliding_window", None) or getattr(text, "use_sliding_window", False):
        raise HfBackendError(f"context parallelism: {name} uses sliding-window attention, which cp "
                             "does not split; set cp_size=1")
    # a name of hf_backend's own; no other model sees it
    AttentionInterface.register(NAME, attention)
    copies: dict[int, Any] = {}
    group = cp_mesh.get_group()
    for module in modules:
        if id(module.config) not in copies:
            own = copy.copy(module.config)
            own._attn_implementation_internal = NAME
            copies[id(module.config)] = own
        module.config = copies[id(module.config)]
        module.context_parallel_group = group


@contextlib.contextmanager
def split_sequences(buffers: Sequence[torch.Tensor], dims: Sequence[int], keep: Sequence[torch.Tensor],
                    cp_mesh: DeviceMesh) -> Iterator[None]:
    """Replace each buffer, in place, by this rank's contiguous slice along its sequence dimension; the
    buffers not in `keep` get their whole contents back afterwards (Accelerate's
    `maybe_context_parallel`). A tensor listed twice (the labels and the shifted labels of
    Accelerate's examples are one tensor) is split once."""
    if len(buffers) != len(dims):
        raise HfBackendError(f"maybe_context_parallel: {len(buffers)} buffers but {len(dims)} "
                             "buffer_seq_dims; give one sequence dimension per buffer")
    unique: dict[int, tuple[torch.Tensor, int]] = {}
    for buffer, dim in zip(buffers, dims):
        if unique.setdefault(id(buffer), (buffer, dim))[1] != dim:
            raise HfBackendError("maybe_context_parallel: one tensor is listed twice with "
                                 "different buffer_seq_dims; list it once")
    buffers, dims = [b for b, _ in unique.values()], [d for _, d in unique.values()]
    size, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    saved = []
    for buffer, dim in zip(buffers, dims):
        length = buffer.shape[dim]
        if length % size:
            raise HfBackendError(f"context parallelism: a sequence of {length} tokens does not "
                                 f"split over cp_size={size}; pad the batches to a multiple of "
                                 f"{size} (pad_to_multiple_of)")
        whole = buffer.clone()
        saved.append(None if any(buffer is k for k in keep) else whole)
        local = whole.chunk(size, dim=dim)[rank]
        buffer.resize_(local.shape)
        buffer.copy_(local)
    try:
        yield
    finally:
        for buffer, whole in zip(buffers, saved):
            if whole is not None:
                buffer.resize_(whole.shape)
                buffer.copy_(whole)


def check_inputs(kwargs: dict[str, Any], active: bool, cp_mesh: DeviceMesh) -> None:
    """What a forward under context parallelism needs: the sequences split, global position ids, and
    padding on the right only (no packing, no left padding)."""
    if not active:
        raise HfBackendError("context parallelism: call the model inside "
                             "accelerator.maybe_context_parallel(buffers=[input_ids, labels, "
                             "position_ids], buffer_seq_dims=[1, 1, 1]) so that each rank holds "
                             "its slice of the sequences")
    if kwargs.get("position_ids") is None:
        raise HfBackendError("context parallelism: pass position_ids (and split them with the "
                             "other buffers): each slice's positions are global")
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2:
            raise HfBackendError("context parallelism: a 3-D or 4-D attention_mask (packing, "
                                 "custom masks) is not supported; pass a 2-D padding mask or none")
        parts = [torch.empty_like(mask) for _ in range(cp_mesh.size())]
        dist.all_gather(parts, mask.contiguous(), group=cp_mesh.get_group())
        whole = torch.cat(parts, dim=1)
        if bool((whole[:, 1:] > whole[:, :-1]).any()):
            raise HfBackendError("context parallelism: the attention_mask has padding before real "
                                 "tokens (left padding or packing); pad on the right (tokenizer "
                                 "padding_side='right')")
