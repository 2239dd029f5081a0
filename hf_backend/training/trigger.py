"""Coordination between processes that a training loop asks for: a stop flag any process can raise
(`set_trigger` / `check_trigger`), and training on loaders that run out at different steps
(`join_uneven_inputs`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.process import ProcessState


class Trigger:
    """A flag that any process can set and every process reads at the same point: `check()` all-reduces
    it, so all processes take the same branch (early stopping on one rank's condition, say) instead
    of deadlocking."""

    def __init__(self, process: ProcessState) -> None:
        self.process = process
        self.flag = torch.zeros(1, device=process.device)

    def set(self) -> None:
        self.flag.fill_(1)

    def check(self) -> bool:
        """Collective: call it on every process. True everywhere when any process set the flag; then it
        is cleared."""
        flag = self.flag.clone()
        if self.process.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        if flag.item() >= 1:
            self.flag.zero_()
            return True
        return False


@contextlib.contextmanager
def uneven_inputs(strategy: Any, joinables: list, loaders: list, even_batches: bool | None) -> Iterator[None]:
    """Run the block under the join context of `strategy` (a Joinable: torch's `Join` for DDP),
    with `even_batches` of the prepared map-style loaders set as asked and restored afterwards."""
    # map-style
    samplers = [loader.source for loader in loaders if hasattr(loader.source, "even_batches")]
    saved = [sampler.even_batches for sampler in samplers]
    if even_batches is not None:
        for sampler in samplers:
            sampler.even_batches = even_batches
    try:
        with strategy.join(joinables):
            yield
    finally:
        for sampler, value in zip(samplers, saved):
            sampler.even_batches = value
