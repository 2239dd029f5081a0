"""A DeepSpeed engine's model and optimizer state in the strategy-neutral form every other strategy writes: full
weights and an optimizer state keyed by parameter name (what `get_optimizer_state_dict` gives under DDP), so that a
ZeRO checkpoint resumes under DDP, FSDP, one process or ZeRO at another world size, and theirs under ZeRO.

The states are read and written through DeepSpeed's tensor-fragment API (`deepspeed.utils.safe_get_full_fp32_param`
and friends): the fp32 master weights and the optimizer's moments, wherever ZeRO partitioned them. Those calls are
collective (ZeRO-1/2 all-reduce, ZeRO-3 all-gather), so every function here runs on every process, in the same
order. An optimizer that keeps no fp32 master copy (no ZeRO, fp32) is read through torch's state-dict API instead.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from ..errors import HfBackendError
from ..log import note


class LoadResult(NamedTuple):
    """What `nn.Module.load_state_dict` returns, for `checkpoint.files.check_loaded`."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def partitioned(engine: Any) -> bool:
    """Whether the engine's optimizer steps fp32 master partitions (ZeRO-1/2/3, or bf16 without ZeRO) rather than
    the module's own parameters."""
    return _lp_groups(engine.optimizer) is not None


def _lp_groups(optimizer: Any) -> list[list[torch.nn.Parameter]] | None:
    """The module's trainable parameters in each param group of the torch optimizer DeepSpeed wraps."""
    for attribute in ("bit16_groups", "bf16_groups"):  # ZeRO-1/2; bf16 without ZeRO
        if hasattr(optimizer, attribute):
            return [list(group) for group in getattr(optimizer, attribute)]
    if hasattr(optimizer, "sub_group_to_group_id"):  # ZeRO-3 steps sub groups of the param groups
        groups: list[list[torch.nn.Parameter]] = [[] for _ in optimizer.optimizer.param_groups]
        for sub, params in enumerate(optimizer.fp16_groups):
            groups[optimizer.sub_group_to_group_id[sub]].extend(params)
        return groups
    return None


def _flats(optimizer: Any) -> list[list[torch.Tensor]]:
    """The fp32 partitions (the tensors the torch optimizer's state is keyed by) of each param group. ZeRO-3 puts
    each sub group's into its param group only while it steps that sub group."""
    inner = optimizer.optimizer
    if hasattr(optimizer, "sub_group_to_group_id"):
        flats: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
        for sub, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
            flats[optimizer.sub_group_to_group_id[sub]].append(flat)
        return flats
    return [list(group["params"]) for group in inner.param_groups]


def _numel(param: torch.nn.Parameter) -> int:
    return int(getattr(param, "ds_numel", param.numel()))  # ZeRO-3 leaves an empty tensor in the module


# -- weights ---------------------------------------------------------------------------------------------------------
def full_weights(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    """The module's state dict with every trainable parameter's fp32 master weight in place of its (16-bit) module
    copy. Collective; under ZeRO-3 only the main process gets a non-empty dict."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    masters = {}
    for param in module.parameters():  # one call per parameter, in the same order on every process
        if param.requires_grad:
            value = safe_get_full_fp32_param(param)
            if value is not None:
                masters[id(param)] = value.detach().cpu()
    state = (engine._zero3_consolidated_16bit_state_dict() or {}) if stage == 3 else module.state_dict()
    if not state:
        return {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in masters and name in state:
            state[name] = masters[id(param)]
    return state


def load_full_weights(engine: Any, stage: int, state_dict: dict[str, torch.Tensor]) -> LoadResult:
    """Full weights into the module (cast to its dtype; under ZeRO-3 gathered, loaded and partitioned again) and into
    the fp32 master partitions the optimizer steps."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    module = engine.module
    gathered = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0) if stage == 3 \
        else contextlib.nullcontext()
    with gathered:
        result = module.load_state_dict(state_dict, strict=False)
    for name, param in module.named_parameters():
        if param.requires_grad and name in state_dict:
            safe_set_full_fp32_param(param, state_dict[name].to(torch.float32))
    return LoadResult(list(result.missing_keys), list(result.unexpected_keys))


# -- optimizer ---------------------------------------------------------------------------------------------------------
def full_optimizer_state(engine: Any) -> dict[str, Any]:
    """`{"state": {name: {key: tensor}}, "param_groups": [{..., "params": [names]}]}` from the partitions: each
    moment gathered whole per parameter, the step (one per partition in ZeRO) repeated for each parameter.
    Collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    optimizer, names = engine.optimizer, _names(engine.module)
    inner = optimizer.optimizer
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for params, flats, group in zip(_lp_groups(optimizer), _flats(optimizer), inner.param_groups):
        own = [(flat, inner.state.get(flat, {})) for flat in flats]
        moments = sorted({k for flat, s in own for k, v in s.items() if _shaped_like(v, flat.numel())})
        scalars = {k: v for _, s in own for k, v in s.items() if k not in moments}
        for param in params:
            entry = {k: safe_get_full_optimizer_state(param, k).detach().cpu().clone() for k in moments}
            if entry or scalars:
                state[names[id(param)]] = {**{k: _copy(v) for k, v in scalars.items()}, **entry}
        param_groups.append({**{k: v for k, v in group.items() if k != "params"},
                             "params": [names[id(p)] for p in params]})
    return {"state": state, "param_groups": param_groups}


def load_full_optimizer_state(engine: Any, state_dict: dict[str, Any], source: str) -> None:
    """A state keyed by parameter name (from any strategy) into the engine's partitions: each group's
    hyperparameters, each parameter's moments into its fragments, the step into each partition's state."""
    from deepspeed.utils import safe_set_full_optimizer_state

    optimizer, names = engine.optimizer, _names(engine.module)
    inner = optimizer.optimizer
    saved_state = state_dict.get("state", {})
    group_of = {name: i for i, group in enumerate(state_dict.get("param_groups", [])) for name in group["params"]}
    plan = []
    for params, flats, group in zip(_lp_groups(optimizer), _flats(optimizer), inner.param_groups):
        keys = [names[id(p)] for p in params]
        indices = {group_of.get(k) for k in keys}
        if len(indices) != 1 or None in indices:
            raise HfBackendError(f"load_state: {source} groups the parameters differently from this optimizer (or "
                                 "lacks some); resume with the optimizer's param groups set up as when it was saved")
        saved_group = state_dict["param_groups"][indices.pop()]
        group.update({k: v for k, v in saved_group.items() if k != "params"})
        entries = [(p, saved_state.get(k, {})) for p, k in zip(params, keys)]
        moments = sorted({k for p, e in entries for k, v in e.items() if _shaped_like(v, _numel(p))})
        scalars = _scalars(entries, moments, source)
        for flat in flats:
            flat_state = inner.state[flat]
            for key in moments:
                if key not in flat_state:
                    flat_state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format).detach()
            flat_state.update({k: _copy(v) for k, v in scalars.items()})
        plan.append((entries, moments))
    if hasattr(optimizer, "_hp_optimizer_states_linked"):  # ZeRO-1/2, bf16: point the fragments at the new states
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    for entries, moments in plan:
        for param, entry in entries:
            for key in moments:
                value = entry.get(key)
                safe_set_full_optimizer_state(param, torch.zeros(_numel(param)) if value is None
                                              else value.to(torch.float32), key)


def _names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _shaped_like(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _copy(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _scalars(entries: list[tuple[torch.nn.Parameter, dict[str, Any]]], moments: list[str],
             source: str) -> dict[str, Any]:
    """The per-parameter scalars (Adam's `step`) of one group, which ZeRO keeps once per partition: they must agree."""
    found: dict[str, Any] = {}
    for _, entry in entries:
        for key, value in entry.items():
            if key in moments:
                continue
            if key in found and not _equal(found[key], value):
                note(f"load_state: {source}: the parameters of one group have different '{key}' values; ZeRO keeps "
                     "one per group, the first is used")
                continue
            found.setdefault(key, value)
    return found


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return a == b
