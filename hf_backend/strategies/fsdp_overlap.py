"""When FSDP2's collectives run relative to compute, as the FSDP strategy sets it up (docs/fsdp.md,
"Step cost").

On GPUs FSDP2 overlaps communication through CUDA streams. On the CPU there are no streams: FSDP2's
all-gathers and reduce-scatters are blocking gloo calls unless they are issued with `async_op`, in
which case gloo runs them in its own threads. So on the CPU the engine
- issues the all-gathers FSDP2 prefetches (the previous block's in backward, the next block's in
  forward when `fsdp_forward_prefetch` is on) asynchronously, so they run while the current block
  computes;
- lets each block's reduce-scatter run while the previous block's backward computes (at most one in
  flight, waited for before the next one starts and when backward ends), where FSDP2 does not read
  its result at once.
On every device, when parameters are resharded after forward (FULL_SHARD), the root and the last
block keep theirs gathered after a forward that a backward follows: backward would gather them again
at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:  # a private module's interface, named for the checker only (torch calls it by its methods)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

# What the gradients are reduce-scattered with (a module attribute so a test can defer its
# completion).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def schedule(model: FSDPModule, blocks: list[FSDPModule], *, reshard_after_forward: bool, forward_prefetch: bool,
             on_cpu: bool, replicated: bool) -> None:
    """Set up prefetching, resharding and overlap for a model sharded block by block, then at the root
    (its weights final). `replicated`: a 2-D mesh, whose reduce-scatter FSDP2 follows with an
    all-reduce of its output."""
    if reshard_after_forward:
        _keep_gathered_for_backward(model, [model, *blocks[-1:]])
    if forward_prefetch:
        for block, following in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([following])
    if not on_cpu:
        return
    # private in FSDP2 (torch >= 2.5); without it gathers block
    if hasattr(model, "_set_unshard_async_op"):
        model._set_unshard_async_op(True)
    if not replicated and hasattr(model, "set_custom_reduce_scatter"):
        in_flight = _InFlight()
        for unit in [model, *blocks]:
            hook = _OverlappedReduceScatter(_own_parameters(unit), in_flight)
            unit.set_custom_reduce_scatter(cast("ReduceScatter", hook))


def _keep_gathered_for_backward(root: FSDPModule, units: list[FSDPModule]) -> None:
    """No reshard after a forward with grad enabled (as FSDP2's own default does for the root); after
    one without (evaluation), reshard as asked, so gathered parameters are not kept around until
    some later backward."""
    kept: bool | None = None

    def before_forward(module: torch.nn.Module, args: Any) -> None:
        nonlocal kept
        if kept is not torch.is_grad_enabled():
            kept = torch.is_grad_enabled()
            for unit in units:
                unit.set_reshard_after_forward(not kept, recurse=False)

    cast(torch.nn.Module, root).register_forward_pre_hook(before_forward, prepend=True)  # an FSDPModule is one


def _own_parameters(unit: FSDPModule) -> list[torch.nn.Parameter]:
    """The parameters this unit shards (not those of FSDP units nested in it)."""
    module = cast(torch.nn.Module, unit)  # fully_shard's class: FSDPModule and the module's own
    nested = {id(p) for m in module.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


class _InFlight:
    """The one reduce-scatter of a model still running."""

    def __init__(self) -> None:
        self.work: Any = None

    def wait(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            work.wait()


class _OverlappedReduceScatter:
    """FSDP2's reduce-scatter hook (`set_custom_reduce_scatter`) for one unit, issuing it
    asynchronously.

    After the reduce-scatter FSDP2 reads its output straight away when it divides after reducing
    (fp16), casts to the parameters' dtype, adds to a gradient the parameter already has, or runs a
    post-accumulate-grad hook. Then this waits at once; otherwise the output is only viewed as the
    new sharded gradients, and it is complete before the next unit's reduce-scatter starts and when
    backward ends (an autograd callback), before anything reads them.
    """

    def __init__(self, parameters: list[torch.nn.Parameter], in_flight: _InFlight) -> None:
        self.parameters, self.in_flight = parameters, in_flight
        self.dtypes = {p.dtype for p in parameters}

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        self.in_flight.wait()
        work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=True)
        if self._read_at_once(output_tensor, op) or not _wait_when_backward_ends(self.in_flight):
            work.wait()
        else:
            self.in_flight.work = work

    def _read_at_once(self, output: torch.Tensor, op: Any) -> bool:
        return op != dist.ReduceOp.AVG or self.dtypes != {output.dtype} or any(
            p.grad is not None or getattr(p, "_post_accumulate_grad_hooks", None) for p in self.parameters)


def _wait_when_backward_ends(in_flight: _InFlight) -> bool:
    try:
        torch.autograd.Variable._execution_engine.queue_callback(in_flight.wait)
    except RuntimeError:  # not inside a backward: nothing would wait later
        return False
    return True
