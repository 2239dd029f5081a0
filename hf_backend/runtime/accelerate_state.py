"""Accelerate's own state objects, told the engine's facts, for the code that still asks them.

Libraries and scripts ported by their `Accelerator` import alone call into the accelerate package:
TRL's trainers (`set_seed(seed, device_specific=True)`, `gather_object`, its `PartialState()`
calls), `accelerate.logging`'s loggers, `accelerate.utils` functions. Those ask Accelerate's
`PartialState`, `AcceleratorState` and `GradientState`, which raise until an Accelerate
`Accelerator` exists, and on a CPU under torchrun count one process per rank.

When the accelerate package is loaded (by that code; hf_backend never imports it), the engine fills
those three shared states with its own answers, through their shared dicts (Accelerate's Borg
pattern, which its own `Accelerator` fills the same way): the process facts when the process state
is set up (`tell_process`), and the distributed type, mixed precision, plugins, mesh and
gradient-accumulation state of the newest Accelerator when it is built (`tell_accelerator`).
Accelerate's `GradientState` then follows the engine's: `sync_gradients` and the loader being
iterated are written there as they change, and the accumulation options are the engine's own dict.
Nothing else of accelerate is touched.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

# the engine GradientState whose changes Accelerate's GradientState follows
_GRADIENT_MIRROR: Any = None


def _module() -> Any:
    return sys.modules.get("accelerate.state")


def tell_process(process: Any) -> None:
    """Fill Accelerate's PartialState with this process's facts (when accelerate is loaded), unless it
    holds them already (an Accelerator's distributed type, FSDP say, is kept)."""
    module = _module()
    if module is None:
        return
    shared = module.PartialState._shared_state
    told = (shared.get("num_processes"), shared.get("process_index"), shared.get("device"))
    if told == (process.num_processes, process.process_index, process.device):
        return
    shared.update(
        _cpu=process.device.type == "cpu", backend=process.backend, device=process.device, debug=False,
        distributed_type=module.DistributedType(process.distributed_type.value), num_processes=process.num_processes,
        process_index=process.process_index, local_process_index=process.local_process_index, fork_launched=False)


def tell_accelerator(accelerator: Any) -> None:
    """Fill Accelerate's PartialState, AcceleratorState and GradientState from an engine Accelerator
    (when accelerate is loaded); the newest Accelerator is the one they describe, as in Accelerate.
    """
    module = _module()
    if module is None:
        return
    tell_process(accelerator.process)
    kind = module.DistributedType(accelerator.distributed_type.value)
    module.PartialState._shared_state["distributed_type"] = kind
    state = accelerator.state
    shared = module.AcceleratorState._shared_state
    shared.clear()
    shared.update(module.PartialState._shared_state)
    shared.update(distributed_type=kind, _mixed_precision=accelerator.mixed_precision,
                  deepspeed_plugins=state.deepspeed_plugin, fsdp_plugin=state.fsdp_plugin,
                  megatron_lm_plugin=None, torch_tp_plugin=None, dynamo_plugin=accelerator.dynamo_plugin,
                  parallelism_config=accelerator.parallelism_config, device_mesh=accelerator.torch_device_mesh)
    _mirror_gradient_state(module, accelerator.gradient_state)


def _mirror_gradient_state(module: Any, gradient_state: Any) -> None:
    global _GRADIENT_MIRROR
    if _GRADIENT_MIRROR is not None:
        _GRADIENT_MIRROR.mirror = None
    shared = module.GradientState._shared_state
    shared.clear()
    shared.update(plugin_kwargs=gradient_state.plugin_kwargs, _is_xla_gradients_synced=False)
    gradient_state.mirror = shared
    _GRADIENT_MIRROR = gradient_state
    write_gradient_state(gradient_state)


def write_gradient_state(gradient_state: Any) -> None:
    """Copy what changes of an engine GradientState into Accelerate's (the one it mirrors, unless
    Accelerate's state was reset since)."""
    shared = gradient_state.mirror
    if not shared:
        return
    shared["sync_gradients"] = gradient_state.sync_gradients
    shared["_dataloader_references_ref"] = [None, *(weakref.ref(loader) for loader in gradient_state.active_loaders)]
