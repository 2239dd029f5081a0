"""Process state: which process this is, how many there are, and which device it computes on.

Detection order (set up once per process, shared by every `Accelerator`):
1. a process group someone else already initialized (Ray Train, the user's own `init_process_group`): used as is;
2. a torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): we initialize the group,
   NCCL when the process has a CUDA device, gloo otherwise;
3. otherwise a single process.
"""

from __future__ import annotations

import atexit
import datetime
import enum
import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import HfBackendError

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedType(str, enum.Enum):
    """How the work is spread over processes; the values match Accelerate's so configs and checks port over."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"


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
        """Plain data parallelism or none; an Accelerator's strategy may refine it (FSDP, DEEPSPEED)."""
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


class AcceleratorState:
    """What Accelerate scripts and transformers' Trainer read from `accelerator.state`: the process state (ranks,
    device, ...) plus this Accelerator's distributed type, precision and the plugin of its strategy (or None)."""

    def __init__(self, process: ProcessState, distributed_type: DistributedType, mixed_precision: str,
                 fsdp_plugin: Any = None, deepspeed_plugin: Any = None) -> None:
        self.process = process
        self.distributed_type = distributed_type
        self.mixed_precision = mixed_precision
        self.fsdp_plugin = fsdp_plugin
        self.deepspeed_plugin = deepspeed_plugin

    def __getattr__(self, name: str) -> Any:
        return getattr(self.process, name)


_STATE: ProcessState | None = None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise HfBackendError(f"environment variable {name}={value!r} is not an integer; unset it or fix it") from None


def _pick_device(cpu: bool, local_rank: int) -> torch.device:
    """The CPU when asked; else the device a launcher named (Ray Train sets ACCELERATE_TORCH_DEVICE for each worker,
    as Accelerate reads it); else the local rank's GPU when there is one."""
    named = os.environ.get("ACCELERATE_TORCH_DEVICE")
    if not cpu and named:
        try:
            return torch.device(named)
        except RuntimeError:
            raise HfBackendError(f"ACCELERATE_TORCH_DEVICE={named!r} is not a torch device; unset it or name one "
                                 "such as cpu or cuda:0") from None
    if not cpu and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def get_process_state(cpu: bool = False, timeout: datetime.timedelta | None = None,
                      backend: str | None = None) -> ProcessState:
    """Return this process's state, setting up the process group the first time it is asked for."""
    global _STATE
    if _STATE is not None:
        if cpu and _STATE.device.type != "cpu":
            raise HfBackendError(
                "the process state was already set up on a GPU; pass cpu=True to the first Accelerator of the process"
            )
        return _STATE

    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_available() and dist.is_initialized():
        device = _pick_device(cpu, local_rank)
        _STATE = _from_group(device, local_rank)
        return _STATE

    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if _env_int("WORLD_SIZE", 1) > 1 and missing:
        raise HfBackendError(
            f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but {', '.join(missing)} not set; "
            "start the processes with `hf-backend launch` or `torchrun`"
        )
    if not missing and _env_int("WORLD_SIZE", 1) > 1:
        device = _pick_device(cpu, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
        kwargs = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group(chosen, init_method="env://", **kwargs)
        atexit.register(shutdown_process_group)
        _STATE = _from_group(device, local_rank, owns_group=True)
        return _STATE

    _STATE = ProcessState(torch.device(_pick_device(cpu, 0)), 1, 0, 0, 1, None)
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


def shutdown_process_group() -> None:
    """Destroy the process group we created, before the interpreter starts finalizing.

    Left to interpreter exit, a gloo worker thread can still be releasing Python objects of the last collectives
    when Python stops handing out the GIL; the thread is then killed inside C++ and the process aborts
    ("terminate called without an active exception"), failing a run that had finished. Collecting garbage around
    the destroy releases those objects while the threads can still run.
    """
    global _STATE
    if _STATE is None or not _STATE.owns_group:
        return
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    _STATE = None
