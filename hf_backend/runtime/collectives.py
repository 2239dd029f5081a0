"""Collectives on tensors and nested structures of them (dicts, lists, tuples, ModelOutput).

Every function is a cheap identity in a single process, so training scripts call them
unconditionally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..core.checks import show
from ..core.errors import HfBackendError
from ..core.nested import leaves, recursively_apply
from ..core.rank import group_size

world_size = group_size  # the processes a collective spans (rank.py)


def _all_gather_cat(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor[None]
    is_bool = tensor.dtype == torch.bool
    send = tensor.to(torch.uint8) if is_bool else tensor
    out = [torch.empty_like(send) for _ in range(world_size())]
    dist.all_gather(out, send.contiguous())
    result = torch.cat(out, dim=0)
    return result.bool() if is_bool else result


def gather(data: Any) -> Any:
    """Concatenate every process's tensors along dim 0 (0-dim tensors become one row each).

    Shapes must match across processes: use `pad_across_processes` first when they do not.
    """
    for leaf in leaves(data):
        if not isinstance(leaf, torch.Tensor):
            raise HfBackendError(f"gather: {type(leaf).__name__} {show(leaf)} is not a tensor; "
                                 "gather tensors (or nested lists / dicts of them), and Python "
                                 "objects with gather_object")
    if world_size() == 1:
        return recursively_apply(lambda t: t[None] if t.ndim == 0 else t, data)
    return recursively_apply(_all_gather_cat, data)


def gather_object(obj: Any) -> list:
    """Gather a picklable object from every process; lists are concatenated, anything else becomes one
    item each."""
    if world_size() == 1:
        return list(obj) if isinstance(obj, list) else [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    if all(isinstance(o, list) for o in out):
        return [item for sub in out for item in sub]
    return out


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Reduce every tensor in `data` over the processes: "sum", "mean", "max", or "none" (this
    process's values, copied). The result is multiplied by `scale`."""
    if reduction not in (*_REDUCE_OPS, "none"):
        raise HfBackendError(f"reduce(reduction={reduction!r}): use 'sum', 'mean', 'max' or 'none'")
    n = world_size()

    def _reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if n > 1 and reduction != "none":
            dist.all_reduce(out, op=_REDUCE_OPS[reduction])
        if reduction == "mean":
            out = out / n
        return out * scale if scale != 1.0 else out

    return recursively_apply(_reduce, data)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Every process ends with `from_process`'s tensors (same shapes and dtypes required)."""
    if world_size() == 1:
        return data

    def _bcast(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(_bcast, data)


def broadcast_object_list(objects: list, from_process: int = 0) -> list:
    if world_size() > 1:
        dist.broadcast_object_list(objects, src=from_process)
    return objects


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along `dim` to the largest size any process has, so that they can be gathered.
    """
    if world_size() == 1:
        return data

    def _pad(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0 or dim >= t.ndim or dim < -t.ndim:
            return t
        size = torch.tensor([t.shape[dim]], device=t.device)
        largest = int(_all_gather_cat(size).max())
        if largest == t.shape[dim]:
            return t
        shape = list(t.shape)
        shape[dim] = largest
        out = t.new_full(shape, pad_index)
        index = [slice(None)] * t.ndim
        index[dim] = slice(largest - t.shape[dim], largest) if pad_first else slice(0, t.shape[dim])
        out[tuple(index)] = t
        return out

    return recursively_apply(_pad, data)


def gather_uneven(data: Any) -> Any:
    """Like `gather`, but dim 0 may differ between processes (a last batch without padding)."""
    if world_size() == 1:
        return gather(data)

    def _gather(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0:
            t = t[None]
        sizes = _all_gather_cat(torch.tensor([t.shape[0]], device=t.device)).tolist()
        padded = pad_across_processes(t)
        chunks = _all_gather_cat(padded).split(max(sizes))
        return torch.cat([chunk[:n] for chunk, n in zip(chunks, sizes)])

    return recursively_apply(_gather, data)


def gather_for_metrics(input_data: Any, gradient_state: Any, use_gather_object: bool = False,
                       shard: Any = None) -> Any:
    """`gather`, then drop the rows a short last batch was padded with (the active loader knows how
    many are real). `shard` (a strategies.mesh.DataShard): where tensor / context parallel
    neighbours share a batch, only the first of them contributes its rows, so every item is counted
    once."""
    if shard is not None and shard.sequence_slices > 1:
        raise HfBackendError("gather_for_metrics with the sequences split over "
                             f"{shard.sequence_slices} ranks (cp_size or sp_size): each rank holds a "
                             "slice of every sequence; evaluate with cp_size=1 and sp_size=1")
    tensors_only = all(isinstance(t, torch.Tensor) for t in leaves(input_data))
    loader = gradient_state.active_dataloader
    uneven = loader is not None and not getattr(loader.source, "even_batches", True)
    shared = shard is not None and shard.replicas > 1
    if (use_gather_object or not tensors_only) and shared:
        parts = gather_object([input_data] if shard.first else [])
        data = [item for part in parts for item in part] if all(isinstance(p, list) for p in parts) else parts
    elif use_gather_object or not tensors_only:
        data = gather_object(input_data)
    elif shared:
        data = gather_uneven(input_data if shard.first else
                             recursively_apply(lambda t: (t[None] if t.ndim == 0 else t)[:0], input_data))
    else:
        data = gather_uneven(input_data) if uneven else gather(input_data)
    remainder = gradient_state.remainder
    if not gradient_state.end_of_dataloader or remainder <= 0 or uneven:
        return data
    if isinstance(data, list):
        return data[:remainder]
    return recursively_apply(lambda t: t[:remainder], data)


def reduce_flat(tensors: list[torch.Tensor], reduce: Callable[[torch.Tensor], torch.Tensor | None],
                bucket_bytes: int | None = None) -> None:
    """Each tensor replaced by its reduction, a few collectives for many tensors: the tensors flattened into one
    buffer per dtype (with `bucket_bytes`, per run of one dtype in their order, at most about that large), `reduce`
    applied to each buffer (in place, or returning the result), and the parts copied back."""
    for bucket in _buckets(tensors, bucket_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        result = reduce(flat)
        flat = flat if result is None else result
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int | None) -> list[list[torch.Tensor]]:
    if bucket_bytes is None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        return list(by_dtype.values())
    buckets: list[list[torch.Tensor]] = [[]]
    filled = 0
    for t in tensors:
        if buckets[-1] and (buckets[-1][-1].dtype != t.dtype or filled >= bucket_bytes):
            buckets.append([])
            filled = 0
        buckets[-1].append(t)
        filled += t.nbytes
    return [bucket for bucket in buckets if bucket]
