"""Process state: which process this is, how many there are, and which device it computes on.

Detection order (set up once per process, shared by every `Accelerator`):
1. a process group someone else already initialized (Ray Train, the user's own
   `init_process_group`): used as is;
2. a torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): we
   initialize the group, NCCL when the process has a CUDA device, gloo otherwise; for a world of
   one too, on every device (`hf-backend launch --num_processes 1`, torchrun), so a script's own
   `dist.all_reduce` runs there as under `accelerate launch`;
3. otherwise a single process.

Process-group plugins (`add_process_group_plugin`: the hang watch, hf_backend/launch/hang_watch.py, which
`hf-backend launch` installs and a user may pass) start once the group is set up and stop before it
is destroyed; none runs unless added.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..core import torch_window
from ..core.enums import DistributedType
from ..core.errors import HfBackendError
from . import accelerate_state

torch_window.check()  # the torch release, in one line, before any strategy reaches into torch

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ProcessState:
    device: torch.device
    num_processes: int
    process_index: int
    local_process_index: int
    local_num_processes: int
    backend: str | None
    owns_group: bool = False  # True when we called init_process_group and so tear it down

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def distributed_type(self) -> DistributedType:
        """Plain data parallelism or none; an Accelerator's strategy may refine it (FSDP, DEEPSPEED).
        """
        if not self.distributed:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    def wait_for_everyone(self) -> None:
        if self.distributed:
            dist.barrier()


class ProcessView:
    """Accelerate's process members (ranks, `print`, `wait_for_everyone`, `main_process_first`,
    `on_main_process`, ...), read from `self.process`. `PartialState`, `AcceleratorState` and the
    `Accelerator` share them."""

    process: ProcessState

    @property
    def device(self) -> torch.device:
        return self.process.device

    @property
    def num_processes(self) -> int:
        return self.process.num_processes

    @property
    def process_index(self) -> int:
        return self.process.process_index

    @property
    def local_process_index(self) -> int:
        return self.process.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.process.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.process.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.process.distributed

    def wait_for_everyone(self) -> None:
        self.process.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        from ..core.nested import split_between

        yield split_between(inputs, self.num_processes, self.process_index, apply_padding)

    def on_main_process(self, function: Callable) -> Callable:
        return self._only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self._only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        return self._only_if(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Run `function` on process `process_index` only (also usable as
        `@on_process(process_index=i)`)."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_if(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _only_if(function: Callable, condition: Callable[[], bool]) -> Callable:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if condition() else None

        return wrapper


_STATE: ProcessState | None = None
# the default process group when we called init_process_group for it: kept when the state is
_OUR_GROUP: Any = None
                       # forgotten (_reset_state), so a state built again on that group still tears
                       # it down at exit


_PLUGINS: list[ProcessGroupPlugin] = []


@runtime_checkable
class ProcessGroupPlugin(Protocol):
    """Something that runs beside a process group of two or more processes: started once the group is
    set up (`group_timeout`: its timeout, when this process set it up), stopped before it is
    destroyed."""

    def start(self, group_timeout: datetime.timedelta | None) -> None: ...

    def stop(self) -> None: ...


def add_process_group_plugin(plugin: ProcessGroupPlugin) -> None:
    """Run `plugin` beside this process's group: from its set-up, or at once when it is already set up.
    Adding the same plugin again does nothing."""
    if not isinstance(plugin, ProcessGroupPlugin):
        raise HfBackendError(f"{type(plugin).__name__} is not a process-group plugin: it needs "
                             "start(group_timeout) and stop() methods, e.g. "
                             "hf_backend.HangWatch(timeout=300)")
    if plugin in _PLUGINS:
        return
    _PLUGINS.append(plugin)
    if _STATE is not None:
        _start_plugins([plugin], None)


def _start_plugins(plugins: list[ProcessGroupPlugin], group_timeout: datetime.timedelta | None) -> None:
    if _STATE is not None and _STATE.num_processes > 1:
        for plugin in plugins:
            plugin.start(group_timeout)


def _group_is_ours() -> bool:
    return _OUR_GROUP is not None and dist.is_initialized() and dist.group.WORLD is _OUR_GROUP


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise HfBackendError(f"environment variable {name}={value!r} is not "
                             "an integer; unset it or fix it") from None


def _pick_device(cpu: bool, local_rank: int) -> torch.device:
    """The CPU when asked; else the device a launcher named (Ray Train sets ACCELERATE_TORCH_DEVICE for
    each worker, as Accelerate reads it); else the local rank's GPU when there is one."""
    named = os.environ.get("ACCELERATE_TORCH_DEVICE")
    if not cpu and named:
        try:
            return torch.device(named)
        except RuntimeError:
            raise HfBackendError(f"ACCELERATE_TORCH_DEVICE={named!r} is not a torch device; unset "
                                 "it or name one such as cpu or cuda:0") from None
    if not cpu and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def process_state_is_set_up() -> bool:
    """Whether this process's state exists already (an Accelerator or PartialState was created)."""
    return _STATE is not None


def get_process_state(cpu: bool = False, timeout: datetime.timedelta | None = None,
                      backend: str | None = None) -> ProcessState:
    """Return this process's state, setting up the process group the first time it is asked for."""
    global _STATE, _OUR_GROUP
    if _STATE is not None:
        if cpu and _STATE.device.type != "cpu":
            raise HfBackendError(
                "the process state was already set up on a GPU; pass cpu=True to the first "
                "Accelerator of the process"
            )
        return _STATE

    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_available() and dist.is_initialized():
        device = _pick_device(cpu, local_rank)
        _STATE = _from_group(device, local_rank, owns_group=_group_is_ours())
        _start_plugins(_PLUGINS, None)
        accelerate_state.tell_process(_STATE)
        return _STATE

    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if _env_int("WORLD_SIZE", 1) > 1 and missing:
        raise HfBackendError(
            f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but {', '.join(missing)} not set; "
            "start the processes with `hf-backend launch` or `torchrun`"
        )
    if not missing:  # a launcher's environment, a world of one too (as on Accelerate)
        device = _pick_device(cpu, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(chosen, init_method="env://", timeout=timeout)
        atexit.register(shutdown_process_group)
        _OUR_GROUP = dist.group.WORLD
        _STATE = _from_group(device, local_rank, owns_group=True)
        _start_plugins(_PLUGINS, timeout)
        accelerate_state.tell_process(_STATE)
        return _STATE

    _STATE = ProcessState(torch.device(_pick_device(cpu, 0)), 1, 0, 0, 1, None)
    accelerate_state.tell_process(_STATE)
    return _STATE


def _from_group(device: torch.device, local_rank: int, owns_group: bool = False) -> ProcessState:
    world = dist.get_world_size()
    return ProcessState(
        device=device,
        num_processes=world,
        process_index=dist.get_rank(),
        local_process_index=local_rank,
        local_num_processes=_env_int("LOCAL_WORLD_SIZE", world),
        backend=str(dist.get_backend()),
        owns_group=owns_group,
    )


def reset_process_state() -> None:
    """Forget this process's state without touching any process group: for a process forked from one
    that had already set its state up (`notebook_launcher`'s workers), which must set up its own."""
    global _STATE, _OUR_GROUP
    _STATE = None
    _OUR_GROUP = None  # the parent's group, if any, is not this process's to tear down


def forget_process_state() -> None:
    """`PartialState._reset_state()`: the next `get_process_state` sets the state up again, on the
    process group when there is one (which stays ours to tear down at exit if we created it); the
    watchdog keeps running."""
    global _STATE
    _STATE = None


def shutdown_process_group(force: bool = False) -> None:
    """Destroy the process group we created, before the interpreter starts finalizing.

    Left to interpreter exit, a gloo worker thread can still be releasing Python objects of the last
    collectives when Python stops handing out the GIL; the thread is then killed inside C++ and the
    process aborts ("terminate called without an active exception"), failing a run that had
    finished. Collecting garbage around the destroy releases those objects while the threads can
    still run.
    """
    global _STATE, _OUR_GROUP
    # the group we created (also when _reset_state forgot the state), or the state's group when
    # forced
    if not (_group_is_ours() or (_STATE is not None and (_STATE.owns_group or force))):
        return
    for plugin in _PLUGINS:
        plugin.stop()
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    _STATE = None
    _OUR_GROUP = None
