"""Memory helpers Accelerate scripts import: retrying a function at smaller batch sizes after
out-of-memory errors, and dropping references so the memory can be returned."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import HfBackendError
from ..core.notes import note

# What torch's allocators say when they run out (CUDA, cuDNN's workspace, the CPU allocator).
_OOM_MESSAGES = ("out of memory", "CUDNN_STATUS_NOT_SUPPORTED", "DefaultCPUAllocator: can't allocate memory")


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and len(error.args) == 1 and any(
        message in str(error.args[0]) for message in _OOM_MESSAGES)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Accelerate's `clear_device_cache`: empty the CUDA allocator's cache (collecting garbage first if
    asked)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _empty_caches() -> None:
    clear_device_cache(garbage_collection=True)


def release_memory(*objects: Any) -> list[None]:
    """Return `None` for each object (assign the result back to drop the references), then collect
    garbage and empty the CUDA cache."""
    released: list[None] = [None] * len(objects)
    del objects
    _empty_caches()
    return released


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Callable:
    """Decorator: call `function(batch_size, *args)` starting at `starting_batch_size`; after an
    out-of-memory error, free memory and retry with a smaller batch (90% of the last, or what
    `reduce_batch_size_fn()` returns). The decorated function is called without its batch size."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    if not isinstance(starting_batch_size, int) or starting_batch_size < 1:
        raise HfBackendError("find_executable_batch_size: "
                             f"starting_batch_size={starting_batch_size!r} "
                             "must be a positive integer")
    batch_size = starting_batch_size

    def smaller() -> int:
        return reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(batch_size * 0.9)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        _empty_caches()
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            raise HfBackendError(f"find_executable_batch_size: call {function.__name__}() without "
                                 f"its first argument ({params[0] if params else 'batch_size'}); "
                                 "the decorator passes the batch size")
        while True:
            if batch_size < 1:
                raise HfBackendError(f"find_executable_batch_size: {function.__name__} runs out of "
                                     "memory even at batch size 1; use a smaller model, gradient "
                                     "checkpointing or more memory")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:  # noqa: BLE001 - only out-of-memory errors are retried
                if not is_out_of_memory(error):
                    raise
                _empty_caches()
                batch_size = smaller()
                note(f"find_executable_batch_size: out of memory, retrying {function.__name__} at "
                     f"batch size {batch_size}")

    return run
