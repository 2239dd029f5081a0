"""Accelerate's module path `accelerate.state` (a script's `from accelerate.state import PartialState` ports by its
import line). The process state lives in hf_backend.runtime.process, the gradient state in
hf_backend.training.gradient_state."""

from .accelerator.states import AcceleratorState, PartialState
from .runtime.process import (
           ProcessGroupPlugin,
           ProcessState,
           add_process_group_plugin,
           get_process_state,
           process_state_is_set_up,
           reset_process_state,
)
from .training.gradient_state import GradientState

__all__ = ["AcceleratorState", "GradientState", "PartialState", "ProcessGroupPlugin", "ProcessState",
           "add_process_group_plugin", "get_process_state", "process_state_is_set_up", "reset_process_state"]
