"""Context parallelism for causal attention (`cp_size`): ring attention over load-balanced slices.

Each sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r (sequences.py), so that
every rank gets as much of the causal triangle as any other. Attention passes the keys and values
around the ring of cp ranks: at each of the cp steps a rank attends its queries to the block it
holds and merges the result by log-sum-exp, while it sends that block on to the next rank and
receives the previous rank's. The backward goes around the ring again with the blocks and their
gradients. No rank ever holds more than two blocks of keys and values: memory per rank falls with
cp, unlike an all-gather of the whole sequence's.

torch's `context_parallel` does not run on CPU (SDPA's CPU kernels have no sharding strategy, Flex
attention no CPU backward), so this attention is hf_backend's own, registered in transformers'
`AttentionInterface` (sequences.py). The slices come from `accelerator.maybe_context_parallel(
buffers=...)`, Accelerate's API, which transformers' Trainer calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import HfBackendError

NAME = "hf_backend_context_parallel"


class _Hop:
    """`tensors` on their way to the next rank of the ring, while what the previous rank sends
    arrives; `done()` waits for both and returns what arrived."""

    def __init__(self, tensors: list[torch.Tensor], split: Any) -> None:
        self.received = [torch.empty_like(t) for t in tensors]
        ranks = dist.get_process_group_ranks(split.group)
        after, before = ranks[(split.rank + 1) % split.size], ranks[(split.rank - 1) % split.size]
        ops = [dist.P2POp(dist.isend, t, after, split.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, before, split.group) for t in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def done(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


def _scores(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, float("-inf"))


# scores of at most this many elements are made at once (16 MiB in float32): a block's queries are
# taken this many rows at a time, so the memory of attention does not grow with the slice squared
_SCORES = 1 << 22


def _rows(query: torch.Tensor, keys: int) -> list[slice]:
    batch, heads, length, _ = query.shape
    step = max(1, _SCORES // max(1, batch * heads * keys))
    return [slice(start, start + step) for start in range(0, length, step)]


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one block's attention (`part`, normalised by `part_lse`) into rows `rows` of the running
    result, by log-sum-exp."""
    before = lse[:, :, rows]
    merged = torch.logaddexp(before, part_lse)
    keep = torch.where(before.isinf(), 0.0, torch.exp(before - merged))
    add = torch.where(part_lse.isinf(), 0.0, torch.exp(part_lse - merged))
    out[:, :, rows] = out[:, :, rows] * keep.unsqueeze(-1) + part * add.unsqueeze(-1)
    lse[:, :, rows] = merged


def _pairs(split: Any, owner: int, length: int) -> list[tuple[slice, slice, bool]] | None:
    """On a CPU, for causal rows without padding or packing: the (query rows, key rows, causal) chunk
    pairs of this rank's queries and `owner`'s block that are not hidden, for SDPA's fused CPU kernel
    (which returns its log-sum-exp); None elsewhere (the masked blockwise path)."""
    if not (split.balanced and split.layout.plain):
        return None
    chunk, last = length // 2, 2 * split.size - 1
    mine, theirs = (split.rank, last - split.rank), (owner, last - owner)
    return [(slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk), a == b)
            for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def _block_forward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   split: Any, owner: int, scale: float) -> None:
    pairs = _pairs(split, owner, q.shape[2]) if _fused(q) else None
    if pairs is not None:
        for rows, cols, causal in pairs:
            part, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, rows].contiguous(), keys[:, :, cols].contiguous(), values[:, :, cols].contiguous(), 0.0,
                causal, scale=scale)
            _merge(out, lse, rows, part, part_lse)
        return
    mask = split.layout.mask(split.indices(split.rank, q.device), split.indices(owner, q.device))
    if not bool(mask.any()):
        return
    for rows in _rows(q, keys.shape[2]):
        scores = _scores(q[:, :, rows], keys, mask[:, :, rows], scale)
        part_lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - part_lse.unsqueeze(-1)).nan_to_num(0.0)
        _merge(out, lse, rows, torch.matmul(weights, values), part_lse)


def _block_backward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, grad: torch.Tensor, delta: torch.Tensor, grad_q: torch.Tensor, split: Any,
                    owner: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds this block's part to `grad_q`; returns the block's key and value gradients (per query
    head). With the merged output and log-sum-exp, each block's part is exact on its own."""
    grad_keys, grad_values = torch.zeros_like(keys), torch.zeros_like(values)
    pairs = _pairs(split, owner, q.shape[2]) if _fused(q) else None
    if pairs is not None:
        for rows, cols, causal in pairs:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad[:, :, rows].contiguous(), q[:, :, rows].contiguous(), keys[:, :, cols].contiguous(),
                values[:, :, cols].contiguous(), out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), 0.0,
                causal, scale=scale)
            grad_q[:, :, rows] += dq
            grad_keys[:, :, cols] += dk
            grad_values[:, :, cols] += dv
        return grad_keys, grad_values
    mask = split.layout.mask(split.indices(split.rank, q.device), split.indices(owner, q.device))
    if not bool(mask.any()):
        return grad_keys, grad_values
    for rows in _rows(q, keys.shape[2]):
        scores = _scores(q[:, :, rows], keys, mask[:, :, rows], scale)
        weights = torch.exp(scores - lse[:, :, rows].unsqueeze(-1)).nan_to_num(0.0)
        grad_rows = grad[:, :, rows]
        grad_scores = weights * (torch.matmul(grad_rows, values.transpose(-1, -2)) - delta[:, :, rows])
        grad_q[:, :, rows] += torch.matmul(grad_scores, keys) * scale
        grad_keys += torch.matmul(grad_scores.transpose(-1, -2), q[:, :, rows]) * scale
        grad_values += torch.matmul(weights.transpose(-1, -2), grad_rows)
    return grad_keys, grad_values


class _RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over the whole sequence's keys and values, one block of the
    ring at a time (on a CPU without padding or packing, chunk pairs by SDPA's fused kernel;
    elsewhere a bounded number of query rows at a time under the layout's mask); float32 inside,
    the inputs' dtype out."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, split: Any,
                scale: float) -> torch.Tensor:
        dtype = query.dtype
        q, k, v = (t.float().contiguous() for t in (query, key, value))
        repeats = q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=q.dtype)
        block_k, block_v = k, v
        for step in range(split.size):
            owner = (split.rank - step) % split.size
            # the next block travels while this one is computed
            hop = _Hop([block_k, block_v], split) if step < split.size - 1 else None
            _block_forward(q, block_k.repeat_interleave(repeats, 1), block_v.repeat_interleave(repeats, 1), out, lse,
                           split, owner, scale)
            if hop is not None:
                block_k, block_v = hop.done()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.scale, ctx.dtype, ctx.repeats = split, scale, dtype, repeats
        return out.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        split, scale, repeats = ctx.split, ctx.scale, ctx.repeats
        grad = grad.float().contiguous()
        delta = (grad * out).sum(-1, keepdim=True)
        grad_q = torch.zeros_like(q)
        block_k, block_v = k, v
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)  # travel with their block
        for step in range(split.size):
            owner = (split.rank - step) % split.size
            keys, values = block_k.repeat_interleave(repeats, 1), block_v.repeat_interleave(repeats, 1)
            grad_keys, grad_values = _block_backward(q, keys, values, out, lse, grad, delta, grad_q, split, owner,
                                                     scale)
            grad_k += _fold(grad_keys, repeats)
            grad_v += _fold(grad_values, repeats)
            if step < split.size - 1:
                block_k, block_v, grad_k, grad_v = _Hop([block_k, block_v, grad_k, grad_v], split).done()
        # the block now held is the next rank's: one more hop takes each block's gradients home
        grad_k, grad_v = _Hop([grad_k, grad_v], split).done() if split.size > 1 else (grad_k, grad_v)
        dtype = ctx.dtype
        return grad_q.to(dtype), grad_k.to(dtype), grad_v.to(dtype), None, None


def _fold(grad: torch.Tensor, repeats: int) -> torch.Tensor:
    """The gradient of `repeat_interleave(repeats, dim=1)`: each key head's query heads summed."""
    if repeats == 1:
        return grad
    batch, heads, length, dim = grad.shape
    return grad.view(batch, heads // repeats, repeats, length, dim).sum(2)


class _Whole:
    """A ring of one: attention over a whole sequence held here (Ulysses' head groups), masked by
    `layout`, a bounded number of query rows at a time."""

    size, rank, group, balanced = 1, 0, None, False

    def __init__(self, layout: Any, length: int) -> None:
        self.layout, self.length = layout, length

    def indices(self, rank: int, device: torch.device | None = None) -> torch.Tensor:
        return torch.arange(self.length, device=device)


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Any,
                     scale: float) -> torch.Tensor:
    """(batch, heads, sequence, dim) attention of a whole sequence under `layout`'s mask (padding,
    packing), without the sequence-squared mask and scores that SDPA with a mask makes."""
    return _RingAttention.apply(query, key, value, _Whole(layout, query.shape[2]), scale)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (batch, heads, slice, head dim) in, (batch, slice, heads,
    head dim) out. The model's mask is for the slice, so the one used is made from the layout its
    forward gathered, at this slice's places in the sequence."""
    if dropout:
        raise HfBackendError(f"context parallelism: attention dropout ({dropout}) is not applied by the "
                             "ring attention; set the model's attention_dropout=0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _RingAttention.apply(query, key, value, module.sequence_split, scale)
    return out.transpose(1, 2).contiguous(), None
