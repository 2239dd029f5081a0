"""`accelerator.profile()`: a torch.profiler context built from `ProfileKwargs`, with one Chrome trace
per process."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..config.options import ProfileKwargs
from ..core.errors import HfBackendError

# Accelerate's file name for each process's trace (accelerate.utils.constants.PROFILE_PATTERN_NAME),
# so tools that collect `profile_{rank}.json` from an Accelerate run find ours too.
TRACE_FILE = "profile_{rank}.json"


def _activities(names: list[str] | None) -> list[torch.profiler.ProfilerActivity] | None:
    if names is None:
        return None  # torch's default: the CPU, plus CUDA when it is available
    known = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
    activities = []
    for name in names:
        key = str(name).lower()
        if key not in known:
            raise HfBackendError(f"ProfileKwargs(activities=[..., {name!r}]): not an activity "
                                 "hf_backend profiles; use 'cpu' and/or 'cuda'")
        if key == "cuda" and not torch.cuda.is_available():
            raise HfBackendError("ProfileKwargs(activities=[..., 'cuda']): this machine has no "
                                 "CUDA device; profile with activities=['cpu']")
        activities.append(known[key])
    return activities


def _schedule(option: dict[str, int] | None) -> Callable[[int], torch.profiler.ProfilerAction] | None:
    """torch.profiler.schedule from the option dict; `wait` and `warmup` default to 0 (torch requires
    both)."""
    if option is None:
        return None
    allowed = list(inspect.signature(torch.profiler.schedule).parameters)
    unknown = sorted(set(option) - set(allowed))
    if unknown:
        raise HfBackendError(f"ProfileKwargs(schedule_option=...): unknown key {unknown[0]!r}; use "
                             f"{', '.join(allowed)}")
    if "active" not in option:
        raise HfBackendError("ProfileKwargs(schedule_option=...): 'active' (the number of steps "
                             "recorded) is missing")
    try:
        return torch.profiler.schedule(**{"wait": 0, "warmup": 0, **option})
    except (AssertionError, TypeError, ValueError) as err:
        raise HfBackendError(f"ProfileKwargs(schedule_option={option}): {err}") from None


def build_profiler(handler: ProfileKwargs) -> torch.profiler.profile:
    """The (not yet started) torch profiler `handler` describes."""
    return torch.profiler.profile(
        activities=_activities(handler.activities),
        schedule=_schedule(handler.schedule_option),
        on_trace_ready=handler.on_trace_ready,
        record_shapes=handler.record_shapes,
        profile_memory=handler.profile_memory,
        with_stack=handler.with_stack,
        with_flops=handler.with_flops,
        with_modules=handler.with_modules,
    )


@contextlib.contextmanager
def profile(handler: ProfileKwargs | None, process_index: int) -> Iterator[torch.profiler.profile]:
    """Profile the block; yields the running profiler (call its `step()` per iteration when a schedule
    is set).

    On a normal exit with `output_trace_dir` set, every process writes
    `output_trace_dir/profile_{process_index}.json` (Chrome trace format), then the processes wait
    for each other so that all files exist when the block is left.
    """
    handler = handler or ProfileKwargs()
    profiler = build_profiler(handler)
    with profiler:
        yield profiler
    if handler.output_trace_dir is None:
        return
    os.makedirs(handler.output_trace_dir, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, TRACE_FILE.format(rank=process_index)))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
