"""Expert parallelism (`ep_size`) from a transformers MoE model's own `ep_plan`.

transformers keeps a layer's experts as fused 3-D tensors (`mlp.experts.gate_up_proj` (experts, 2 x
width, hidden), `down_proj` (experts, hidden, width)) and names them in the plan: `grouped_gemm` for
those tensors, `ep_dispatch_experts` for the module that runs them. Here each `grouped_gemm` tensor
becomes a DTensor split on its first (expert) dimension over the ep ranks, whole experts per rank,
and each `ep_dispatch_experts` module gets a forward that

1. sorts its (token, expert) pairs by expert, so that they are grouped by the rank that owns it,
2. trades the counts, then the token rows, with two all-to-alls over the ep ranks,
3. runs the model's own experts forward (whichever `experts_implementation` the config names) on the
   rows it received, over its local experts only, with unit weights,
4. sends the outputs back with a third all-to-all, and weighs and sums them per token with the
   router's weights on the rank that holds the token (so the router's gradient stays local).

The ep ranks are data-parallel ranks (they hold different tokens): the innermost `ep` of the
`dp_shard_cp` ranks, torchtitan's layout. The ranks that hold the same experts (`efsdp`, with the
replicas under HSDP) shard them with FSDP. An expert's gradient sums every ep rank's tokens, and FSDP
averages it over the efsdp ranks only: it is divided by ep on the way (no custom divide factor, which
gloo cannot reduce with), so that it ends divided by every data-parallel rank, as the dense ones.
Attention, the router and the dense layers are sharded as without ep.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..core.errors import HfBackendError
from .tensor_parallel import config_plan, refuse_unknown_styles

STYLES = ("grouped_gemm", "ep_dispatch_experts")


def ep_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's expert-parallel plan with full module paths: `model.ep_plan` where transformers
    has it, else the config's `base_model_ep_plan` under the base model's prefix."""
    plan = getattr(model, "ep_plan", None)
    return dict(plan) if isinstance(plan, dict) and plan else config_plan(model, "ep")


def _matching(pattern: str, names: Any) -> list[str]:
    """The names a plan path matches; `*` stands for one path component (a layer index). A path matches
    under a prefix too: a PEFT model holds the base model's modules under `base_model.model.`."""
    regex = re.compile(r"(^|\.)" + r"[^.]+".join(map(re.escape, pattern.split("*"))) + "$")
    return [name for name in names if regex.search(name)]


def expert_tensors(model: torch.nn.Module, plan: dict[str, str]) -> set[str]:
    """The parameters `plan` splits over the ep ranks (its `grouped_gemm` entries), by full name."""
    names = [name for name, _ in model.named_parameters()]
    return {found for path, style in plan.items() if style == "grouped_gemm" for found in _matching(path, names)}


def apply_expert_parallel(model: torch.nn.Module, ep_mesh: DeviceMesh) -> list[torch.nn.Module]:
    """Split each MoE layer's experts over `ep_mesh` by the model's plan; returns the experts modules
    (for FSDP to shard over the ranks holding the same experts). One line for a model that cannot be.
    """
    name, size = type(model).__name__, ep_mesh.size()
    plan = ep_plan(model)
    if not plan:
        raise HfBackendError(f"expert parallelism: {name} has no ep_plan (it is not a mixture-of-experts "
                             "model transformers can split); set ep_size=1")
    refuse_unknown_styles(plan, STYLES, "expert parallelism", name, "ep")
    modules = dict(model.named_modules())
    sharded = expert_tensors(model, plan)
    experts = {found: modules[found] for path, style in plan.items() if style == "ep_dispatch_experts"
               for found in _matching(path, modules)}
    if not experts:
        raise HfBackendError(f"expert parallelism: {name}'s ep_plan matched none of its modules; set ep_size=1")
    for prefix, module in experts.items():  # all checked before any is split
        _check(module, prefix, size, sharded, name)
    for module in experts.values():
        for param_name, param in list(module.named_parameters(recurse=False)):
            module._parameters[param_name] = torch.nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]),
                                                                requires_grad=param.requires_grad)
        module.forward = _ExpertDispatch(module, ep_mesh)
    return list(experts.values())


def _check(module: torch.nn.Module, prefix: str, size: int, sharded: set[str], name: str) -> None:
    """Whole experts per rank, every tensor of the module split with them; `prefix`: the module's path in the
    model, `sharded`: the parameter paths the plan splits."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or count % size:
        raise HfBackendError(f"expert parallelism: {name} has num_experts={count}, which does not split "
                             f"over ep_size={size}; use an ep_size that divides it")
    for param_name, _ in module.named_parameters(recurse=False):
        if f"{prefix}.{param_name}" not in sharded:
            raise HfBackendError(f"expert parallelism: {name}'s ep_plan does not split "
                                 f"{prefix}.{param_name}; set ep_size=1")


class _ExpertDispatch:
    """The experts module's forward under expert parallelism (the module docstring's four steps):
    called with the tokens this rank holds, their `top_k_index` (global expert ids) and
    `top_k_weights`; returns each token's weighted sum of its experts' outputs."""

    def __init__(self, experts: torch.nn.Module, ep_mesh: DeviceMesh) -> None:
        self.experts = experts
        self.own_forward = experts.forward  # the model's, on this rank's experts (local ids)
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        self.local = cast(int, experts.num_experts) // self.size  # an int: checked by _check

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # pairs grouped by expert, so by owner rank
        sent_counts = torch.bincount(experts, minlength=self.local * self.size).view(self.size, self.local)
        received_counts = torch.empty_like(sent_counts)
        dist.all_to_all_single(received_counts, sent_counts, group=self.group)
        sent, received = (counts.sum(dim=1).tolist() for counts in (sent_counts, received_counts))
        rows = all_to_all_single(hidden_states[order // top_k], received, sent, self.group)
        local_ids = torch.arange(self.local, device=rows.device).repeat(self.size)
        local_ids = local_ids.repeat_interleave(received_counts.reshape(-1)).unsqueeze(-1)
        with self._local_experts():
            if rows.shape[0]:
                outputs = self.own_forward(rows, local_ids, rows.new_ones(local_ids.shape))
            else:  # nothing to compute, but backward must still reach the experts and the all-to-all
                probe = rows.sum(dim=0, keepdim=True)
                outputs = self.own_forward(probe, local_ids.new_zeros(1, 1), probe.new_ones(1, 1))[:0]
        back = all_to_all_single(outputs, sent, received, self.group)
        per_pair = back[torch.argsort(order)].view(tokens, top_k, -1)
        return (per_pair * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)

    @contextlib.contextmanager
    def _local_experts(self) -> Iterator[None]:
        """The module's DTensor experts as this rank's local tensors (differentiable views), and its
        expert count this rank's, for the model's own forward."""
        module = self.experts
        saved, count = dict(module._parameters), module.num_experts
        for name, param in saved.items():
            if isinstance(param, DTensor):
                module._parameters[name] = _DividedGradient.apply(param.to_local(), self.size)
        module.num_experts = self.local  # type: ignore[assignment]  # Module.__setattr__ takes any value
        try:
            yield
        finally:
            module._parameters.update(saved)
            module.num_experts = count


class _DividedGradient(torch.autograd.Function):
    """The identity, with its gradient divided by `by`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, by: int) -> torch.Tensor:
        ctx.by = by
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.by, None
