"""A DeepSpeed engine's model and optimizer state in the strategy-neutral form every other strategy
writes: full weights and an optimizer state keyed by parameter name (what `get_optimizer_state_dict`
gives under DDP), so that a ZeRO checkpoint resumes under DDP, FSDP, one process or ZeRO at another
world size, and theirs under ZeRO.

The states are read and written through DeepSpeed's tensor-fragment API
(`deepspeed.utils.safe_get_full_fp32_param` and friends): the fp32 master weights and the
optimizer's moments, wherever ZeRO partitioned them. Those calls are collective (ZeRO-1/2
all-reduce, ZeRO-3 all-gather), so every function here runs on every process, in the same order. An
optimizer that keeps no fp32 master copy (no ZeRO, fp32) is read through torch's state-dict API
instead.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, NamedTuple, Protocol, cast

import torch

from ..core.errors import HfBackendError
from ..core.notes import note


class _Zero3Parameter(Protocol):
    """What ZeRO-3 adds to a module's parameter."""

    ds_numel: int

    def partition_numel(self) -> int: ...


class LoadResult(NamedTuple):
    """What `nn.Module.load_state_dict` returns, for `checkpoint.files.check_loaded`."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def partitioned(engine: Any) -> bool:
    """Whether the engine's optimizer steps fp32 master partitions or copies (ZeRO-1/2/3; bf16 without
    ZeRO) rather than the module's own parameters."""
    return _lp_groups(engine.optimizer) is not None or _unfused(engine.optimizer) is not None


def _unfused(optimizer: Any) -> list[list[tuple[torch.nn.Parameter, torch.Tensor]]] | None:
    """bf16 without ZeRO (DeepSpeed's FP16_UnfusedOptimizer): each trainable parameter paired with the
    fp32 copy the torch optimizer steps, of the same shape."""
    if hasattr(optimizer, "sub_group_to_group_id") or not hasattr(optimizer, "fp32_groups"):
        return None
    pairs = [list(zip(lp, hp)) for lp, hp in zip(optimizer.fp16_groups, optimizer.fp32_groups)]
    if any(lp.shape != hp.shape for group in pairs for lp, hp in group):
        raise HfBackendError(f"DeepSpeed's {type(optimizer).__name__} keeps "
                             "flat fp32 copies that hf_backend cannot map to "
                             "parameters; use ZeRO stage 1 or more for bf16")
    return pairs


def _lp_groups(optimizer: Any) -> list[list[torch.nn.Parameter]] | None:
    """The module's trainable parameters in each param group of the torch optimizer DeepSpeed wraps.
    """
    for attribute in ("bit16_groups", "bf16_groups"):  # ZeRO-1/2; bf16 without ZeRO
        if hasattr(optimizer, attribute):
            return [list(group) for group in getattr(optimizer, attribute)]
    if hasattr(optimizer, "sub_group_to_group_id"):  # ZeRO-3 steps sub groups of the param groups
        groups: list[list[torch.nn.Parameter]] = [[] for _ in optimizer.optimizer.param_groups]
        for sub, params in enumerate(optimizer.fp16_groups):
            groups[optimizer.sub_group_to_group_id[sub]].extend(params)
        return groups
    return None


def module_groups(optimizer: Any) -> list[list[torch.nn.Parameter]]:
    """The module's trainable parameters in each param group of a partitioned engine's optimizer."""
    unfused = _unfused(optimizer)
    return [[lp for lp, _ in pairs] for pairs in unfused] if unfused is not None else _lp_groups(optimizer) or []


def _flats(optimizer: Any) -> list[list[torch.Tensor]]:
    """The fp32 partitions (the tensors the torch optimizer's state is keyed by) of each param group.
    ZeRO-3 puts each sub group's into its param group only while it steps that sub group."""
    inner = optimizer.optimizer
    if hasattr(optimizer, "sub_group_to_group_id"):
        flats: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
        for sub, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
            flats[optimizer.sub_group_to_group_id[sub]].append(flat)
        return flats
    return [list(group["params"]) for group in inner.param_groups]


def _numel(param: torch.nn.Parameter) -> int:
    # ZeRO-3 leaves an empty tensor in the module
    return int(getattr(param, "ds_numel", param.numel()))


# -- weights ---------------------------------------------------------------------------------------
def full_weights(engine: Any, stage: int, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The module's state dict with every trainable parameter's fp32 master weight in place of its
    (16-bit) module copy; `trainable_only`: the trainable parameters alone (a frozen base is not
    gathered). Collective; under ZeRO-3 only the main process gets a non-empty dict."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    unfused = _unfused(engine.optimizer)
    masters = {id(lp): hp.detach().cpu().clone() for group in unfused or [] for lp, hp in group}
    for param in module.parameters():  # one call per parameter, in the same order on every process
        if param.requires_grad and not unfused:
            value = safe_get_full_fp32_param(param)
            if value is not None:
                masters[id(param)] = value.detach().cpu()
    if stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=trainable_only) or {}
    else:
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad} if trainable_only else set()
        state = {name: value for name, value in module.state_dict().items() if name not in frozen}
    if not state:
        return {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in masters and name in state:
            state[name] = masters[id(param)]
    return state


def load_full_weights(engine: Any, stage: int, state_dict: dict[str, torch.Tensor]) -> LoadResult:
    """Full weights into the module (cast to its dtype; under ZeRO-3 gathered, loaded and partitioned
    again) and into the fp32 master partitions the optimizer steps."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    module = engine.module
    gathered = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0) if stage == 3 \
        else contextlib.nullcontext()
    with gathered:
        result = module.load_state_dict(state_dict, strict=False)
    for name, param in module.named_parameters():
        if param.requires_grad and name in state_dict:
            _set_full(safe_set_full_fp32_param, param, state_dict[name].to(torch.float32))
    names = _names(module)
    for group in _unfused(engine.optimizer) or []:
        for lp, hp in group:
            hp.data.copy_(state_dict.get(names[id(lp)], lp.data))
    return LoadResult(list(result.missing_keys), list(result.unexpected_keys))


def weights_template(engine: Any) -> dict[str, torch.Tensor]:
    """Full-size tensors for every key of the module's state dict (fp32 for parameters), on every
    process: what a sharded (DCP) checkpoint of another strategy is read into before
    `load_full_weights`. Not collective."""
    template = {}
    for name, value in engine.module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            template[name] = torch.empty(tuple(getattr(value, "ds_shape", value.shape)), dtype=torch.float32)
        else:
            template[name] = torch.empty_like(value, device="cpu")
    return template


def optimizer_template(engine: Any) -> dict[str, Any]:
    """`full_optimizer_state`'s structure with full-size tensors, for reading a sharded checkpoint
    into. The state keys are the optimizer class's own, found by stepping a copy of it on a
    one-element parameter."""
    optimizer, names = engine.optimizer, _names(engine.module)
    inner = optimizer.optimizer
    probe = torch.zeros(1, requires_grad=True)
    probe.grad = torch.zeros(1)
    accepted = inspect.signature(type(inner).__init__).parameters
    copy = type(inner)([probe], **{k: v for k, v in inner.defaults.items() if k in accepted and k != "params"})
    copy.step()
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for params, group in zip(module_groups(optimizer), inner.param_groups):
        for param in params:
            shape = tuple(getattr(param, "ds_shape", param.shape))
            state[names[id(param)]] = {k: torch.empty(shape, dtype=torch.float32) if v.dim() else v.clone()
                                       for k, v in copy.state[probe].items() if isinstance(v, torch.Tensor)}
        param_groups.append({**{k: v for k, v in group.items() if k != "params"},
                             "params": [names[id(p)] for p in params]})
    return {"state": state, "param_groups": param_groups}


# -- optimizer -------------------------------------------------------------------------------------
def full_optimizer_state(engine: Any) -> dict[str, Any]:
    """`{"state": {name: {key: tensor}}, "param_groups": [{..., "params": [names]}]}` from the
    partitions: each moment gathered whole per parameter, the step (one per partition in ZeRO)
    repeated for each parameter. Collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    optimizer, names = engine.optimizer, _names(engine.module)
    inner = optimizer.optimizer
    unfused = _unfused(optimizer)
    if unfused is not None:
        return {"state": {names[id(lp)]: {k: _copy(v) for k, v in inner.state[hp].items()}
                          for group in unfused for lp, hp in group if inner.state.get(hp)},
                "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                                  "params": [names[id(lp)] for lp, _ in pairs]}
                                 for pairs, group in zip(unfused, inner.param_groups)]}
    _link_fragments(optimizer)
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    lp_groups = _lp_groups(optimizer)
    assert lp_groups is not None  # partitioned(engine), and not unfused: ZeRO's groups
    for params, flats, group in zip(lp_groups, _flats(optimizer), inner.param_groups):
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


def _link_fragments(optimizer: Any) -> None:
    """ZeRO-1/2 and bf16: point each parameter's fragment at its partition's optimizer state again.
    DeepSpeed links them once, right after the first param group's first step, when the other
    groups' states do not exist yet: with several groups (the Trainer's decay / no-decay) their
    fragments would stay empty."""
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def load_full_optimizer_state(engine: Any, state_dict: dict[str, Any], source: str) -> None:
    """A state keyed by parameter name (from any strategy) into the engine's partitions: each group's
    hyperparameters, each parameter's moments into its fragments, the step into each partition's
    state."""
    from deepspeed.utils import safe_set_full_optimizer_state

    optimizer, names = engine.optimizer, _names(engine.module)
    inner = optimizer.optimizer
    saved_state = state_dict.get("state", {})
    unfused = _unfused(optimizer)
    if unfused is not None:
        for pairs, group in zip(unfused, inner.param_groups):
            _take_hyperparameters(group, [names[id(lp)] for lp, _ in pairs], state_dict, source)
            for lp, hp in pairs:
                inner.state[hp] = {k: v.to(hp.device, hp.dtype if v.dim() else v.dtype).clone().view_as(hp)
                                   if _shaped_like(v, hp.numel()) else _copy(v)
                                   for k, v in saved_state.get(names[id(lp)], {}).items()}
        return
    plan = []
    lp_groups = _lp_groups(optimizer)
    assert lp_groups is not None  # partitioned(engine), and not unfused: ZeRO's groups
    for params, flats, group in zip(lp_groups, _flats(optimizer), inner.param_groups):
        keys = [names[id(p)] for p in params]
        _take_hyperparameters(group, keys, state_dict, source)
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
    _link_fragments(optimizer)  # to the states just made
    for entries, moments in plan:
        for param, entry in entries:
            for key in moments:
                value = entry.get(key)
                _set_full(safe_set_full_optimizer_state, param, torch.zeros(_numel(param)) if value is None
                          else value.to(torch.float32), key)


def _set_full(setter: Any, param: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
    """DeepSpeed's `safe_set_full_*` (not collective), except for a ZeRO-3 parameter whose partitions
    are padded (its size does not divide by the processes): DeepSpeed 0.19.8 reads the last
    partition past the end of the value there, so that partition is written here, zero-padded,
    through the same internals."""
    optimizer = getattr(param, "_z3_optimizer", None)
    zero3 = cast(_Zero3Parameter, param)  # a ZeRO-3 parameter where it has an optimizer
    if optimizer is None or zero3.partition_numel() * optimizer._get_param_partition_world_size(param) == \
            zero3.ds_numel:
        setter(param, value) if key is None else setter(param, value, key)
        return
    partition, _ = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    start = partition.numel() * optimizer._get_param_partition_rank(param)
    piece = value.flatten()[start:start + partition.numel()]
    partition.data.zero_()
    partition.data[:piece.numel()].copy_(piece)


def _take_hyperparameters(group: dict[str, Any], keys: list[str], state_dict: dict[str, Any], source: str) -> None:
    """The saved param group holding exactly these parameters gives its learning rate, betas, ... to
    `group`."""
    group_of = {name: i for i, saved in enumerate(state_dict.get("param_groups", [])) for name in saved["params"]}
    indices = {group_of.get(k) for k in keys}
    if len(indices) != 1 or None in indices:
        raise HfBackendError(f"load_state: {source} groups the parameters differently from this "
                             "optimizer (or lacks some); resume with the optimizer's param groups "
                             "set up as when it was saved")
    group.update({k: v for k, v in state_dict["param_groups"][indices.pop()].items() if k != "params"})


def _names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _shaped_like(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _copy(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _scalars(entries: list[tuple[torch.nn.Parameter, dict[str, Any]]], moments: list[str],
             source: str) -> dict[str, Any]:
    """The per-parameter scalars (Adam's `step`) of one group, which ZeRO keeps once per partition:
    they must agree."""
    found: dict[str, Any] = {}
    for _, entry in entries:
        for key, value in entry.items():
            if key in moments:
                continue
            if key in found and not _equal(found[key], value):
                note(f"load_state: {source}: the parameters of one group have different '{key}' "
                     "values; ZeRO keeps one per group, the first is used")
                continue
            found.setdefault(key, value)
    return found


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return a == b
