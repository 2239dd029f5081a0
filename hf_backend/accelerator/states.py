"""Accelerate's `PartialState` and `AcceleratorState` (`accelerate.state`'s classes, which scripts and third-party
code build and ask): views of this process's state (runtime/process.py), the second with the distributed type,
precision and plugins of the newest `Accelerator`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..core.enums import DistributedType
from ..core.errors import HfBackendError
from ..runtime.process import ProcessState, ProcessView, forget_process_state, get_process_state, shutdown_process_group


class PartialState(ProcessView):
    """Accelerate's `PartialState()`: this process's place among the processes, set up on first use and
    shared."""

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - {"backend", "timeout"})
        if unknown:
            raise HfBackendError(f"PartialState() does not take {', '.join(unknown)}; pass cpu=, "
                                 "backend= or timeout=")
        self.process = get_process_state(cpu=cpu, **kwargs)

    initialized = True  # built on construction, as Accelerate's shared state is once it exists

    def __repr__(self) -> str:
        """Accelerate's text (scripts log `accelerator.state` as their first line)."""
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (f"Distributed environment: {self.distributed_type.value}{backend}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n")
    debug = False
    fork_launched = False

    @property
    def distributed_type(self) -> DistributedType:
        return self.process.distributed_type

    @property
    def backend(self) -> str | None:
        return self.process.backend

    @property
    def local_num_processes(self) -> int:
        return self.process.local_num_processes

    @property
    def default_device(self) -> torch.device:
        return self.process.device

    def set_device(self) -> None:
        """The device is set when the process group is set up (`torch.cuda.set_device` for CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's `PartialState._reset_state()`: forget this process's state, so that the next
        `PartialState()` or `Accelerator()` sets it up again (with other arguments, `cpu=True` say)
        and `use_configured_state=True` finds none. The process group is kept, as in Accelerate: the
        next state is built on it. Objects that exist keep the state they were built with
        (Accelerate's would raise AttributeError on their next use)."""
        forget_process_state()

    def destroy_process_group(self, group: Any = None) -> None:
        """Tear down the process group (ours, or `group` when given)."""
        if group is not None:
            dist.destroy_process_group(group)
        else:
            shutdown_process_group(force=True)


class AcceleratorState(PartialState):
    """Accelerate's `AcceleratorState`: the process state plus the distributed type, precision and
    plugin of the newest `Accelerator` (`accelerator.state` is the one of that accelerator). Before
    any Accelerator exists it describes plain data parallelism in full precision."""

    _kind: DistributedType
    mixed_precision: str
    fsdp_plugin: Any  # the strategy's plugin, as `of` receives it (None: not FSDP)
    deepspeed_plugin: Any  # (None: not DeepSpeed)

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        super().__init__(cpu=cpu, **kwargs)
        current = _CURRENT_ACCELERATOR_STATE
        self._kind = current._kind if current else self.process.distributed_type
        self.mixed_precision = current.mixed_precision if current else "no"
        self.fsdp_plugin = current.fsdp_plugin if current else None
        self.deepspeed_plugin = current.deepspeed_plugin if current else None

    @classmethod
    def of(cls, process: ProcessState, distributed_type: DistributedType, mixed_precision: str,
           fsdp_plugin: Any = None, deepspeed_plugin: Any = None) -> AcceleratorState:
        """The state of one Accelerator; it becomes what `AcceleratorState()` returns."""
        global _CURRENT_ACCELERATOR_STATE
        state = cls.__new__(cls)
        state.process, state._kind, state.mixed_precision = process, distributed_type, mixed_precision
        state.fsdp_plugin, state.deepspeed_plugin = fsdp_plugin, deepspeed_plugin
        _CURRENT_ACCELERATOR_STATE = state
        return state

    @property
    def distributed_type(self) -> DistributedType:
        return self._kind

    def __repr__(self) -> str:
        return f"{super().__repr__()}\nMixed precision type: {self.mixed_precision}\n"

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Accelerate's `AcceleratorState._reset_state()`, which its test scripts call between runs
        (also as `accelerator.state._reset_state()`): `AcceleratorState()` describes no Accelerator
        again (plain data parallelism, full precision, no plugin) until the next one is built. With
        `reset_partial_state` the process state is forgotten too (`PartialState._reset_state()`)."""
        global _CURRENT_ACCELERATOR_STATE
        _CURRENT_ACCELERATOR_STATE = None
        if reset_partial_state:
            forget_process_state()

    @property
    def is_fsdp2(self) -> bool:
        """hf_backend's FSDP is always FSDP2 (`fully_shard`)."""
        return self.fsdp_plugin is not None

    def get_deepspeed_plugin(self, name: str | None = None) -> Any:
        if name is not None:
            raise HfBackendError(f"get_deepspeed_plugin({name!r}): hf_backend holds one DeepSpeed "
                                 "plugin; call it without a name")
        return self.deepspeed_plugin

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        raise HfBackendError("select_deepspeed_plugin: hf_backend holds one DeepSpeed plugin per "
                             "Accelerator; build one Accelerator per configuration")


_CURRENT_ACCELERATOR_STATE: AcceleratorState | None = None


def forget_accelerator_state() -> None:
    """`AcceleratorState()` describes no Accelerator again: for a process forked from one that had built one
    (`notebook_launcher`'s workers)."""
    global _CURRENT_ACCELERATOR_STATE
    _CURRENT_ACCELERATOR_STATE = None
