"""Nested structures of tensors (dicts, lists, tuples, namedtuples, ModelOutput): apply a function to
every tensor, send them to a device, list the leaves, split them between processes. Nothing here
communicates."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def recursively_apply(fn: Callable[[torch.Tensor], Any], data: Any,
                      leaf: Callable[[Any], Any] | None = None) -> Any:
    """Apply `fn` to every tensor inside `data`, rebuilding the containers (mappings, lists, tuples,
    namedtuples, ModelOutput) around the results; `leaf` to everything else (default: kept as it
    is)."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        items = {k: recursively_apply(fn, v, leaf) for k, v in data.items()}
        mapping: Any = type(data)  # a dict, a ModelOutput, a user's Mapping: built as they build
        try:
            return mapping(**items) if hasattr(data, "to_tuple") else mapping(items)
        except TypeError:
            return items
    if isinstance(data, (list, tuple)):
        values = [recursively_apply(fn, v, leaf) for v in data]
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*values)
        return type(data)(values)
    return data if leaf is None else leaf(data)


def send_to_device(data: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Move every tensor in `data` to `device`; objects with their own `.to` (BatchEncoding) are moved
    as a whole."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if hasattr(data, "to") and not isinstance(data, (Mapping, list, tuple)):
        try:
            return data.to(device, non_blocking=non_blocking)
        except TypeError:
            return data.to(device)
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)


def split_between(inputs: Any, num_processes: int, process_index: int, apply_padding: bool = False) -> Any:
    """This process's contiguous part of a list, tuple, tensor or dict of them (the first parts are one
    longer)."""
    if isinstance(inputs, Mapping):
        mapping: Any = type(inputs)
        return mapping({k: split_between(v, num_processes, process_index, apply_padding)
                             for k, v in inputs.items()})
    length = len(inputs)
    per, extra = divmod(length, num_processes)
    start = process_index * per + min(process_index, extra)
    end = start + per + (1 if process_index < extra else 0)
    part = inputs[start:end]
    if apply_padding and extra and process_index >= extra and length:
        last = inputs[-1:]
        part = torch.cat([part, last]) if isinstance(part, torch.Tensor) else part + type(part)(last)
    return part


def leaves(data: Any) -> Iterator[Any]:
    if isinstance(data, Mapping):
        for value in data.values():
            yield from leaves(value)
    elif isinstance(data, (list, tuple)):
        for value in data:
            yield from leaves(value)
    else:
        yield data
