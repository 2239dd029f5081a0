"""Replica groups that meet every step: the gradients averaged across the quorum's groups on each synchronising
backward, the step committed or discarded in every group before the optimizers step, and the quorum asked as the
training loader hands out the step's batch, so that while groups are missing the live ones train their parts too."""

from __future__ import annotations

from typing import Any

import torch

from ..core.notes import note
from ..parallel.dims import DataShard
from .groups import ReplicaGroups, _local


class EveryStep(ReplicaGroups):
    meets_every_step = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._decision = False

    @property
    def committed_steps(self) -> int:
        return self.manager.current_step()

    def after_backward(self, models: list[torch.nn.Module]) -> None:
        """Average every gradient across the quorum's groups, in one flat buffer per dtype (a group that is
        healing contributes zeros and receives the average). A trainable parameter without a gradient gets
        zeros: every group sends the same buffer."""
        if self._phase != "gathering":
            self._begin()
        grads = []
        for model in models:
            for param in model.parameters():
                if param.requires_grad:
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    grads.append(_local(param.grad))
        self._average(grads, self._weight)

    average_gradients = after_backward

    def commit(self) -> bool:
        """Whether this step's update is applied (the same answer in every process of the group; once per step,
        whatever the number of optimizers)."""
        if self._phase == "idle":
            self._begin()
        if self._phase == "gathering":
            self._decision = self.manager.should_commit()
            self._phase = "decided"
            loader = self.gradient_state.active_dataloader or self._training_loader
            handed_out = {id(each): each.handed_out for each in self.objects.dataloaders}
            if not self._decision:
                self.discarded += 1
                self._note_discarded(loader, handed_out)
            else:
                self._note_missing_groups()
            self._training_loader, self._handed_out = loader, handed_out
        return self._decision

    def _note_discarded(self, loader: Any, handed_out: dict[int, int]) -> None:
        batches = handed_out.get(id(loader), 0) - self._handed_out.get(id(loader), 0)
        size = loader.total_batch_size if loader is not None else None
        lost = f"its {batches * size} samples are" if batches and size else "its batches are"
        note(f"fault tolerance: step {self.manager.current_step() + 1} discarded (a replica group failed during it) "
             f"and taken again on the next batches; {lost} not trained")

    def loader_prepared(self, loader: Any) -> None:
        """While groups are missing, the live ones train their parts of every global batch: `loader` (prepared
        over `data_shard` of the strategy's shard) asks the step's quorum before handing out its batch. Not for a
        loader that cannot read other processes' parts (a stream, a DistributedSampler's): the missing parts are
        then not trained, and a note says so."""
        if loader.can_read_parts:
            loader.read_parts(lambda: self._parts_of_step(loader, self.shard))

    def _parts_of_step(self, loader: Any, shard: DataShard) -> list[int] | None:
        """The parts of the global batch this process trains in the step about to begin, as process indices of
        `data_shard(shard)`; None: its own. The quorum's participants, ranked 0 to k - 1 by replica id, share the
        groups' parts round-robin: with every group live each trains its own; a healing group (not participating)
        trains its own, and its gradients count for nothing. Only the loader that training steps read from (known
        from the first step committed) asks: an evaluation loader reads its own part."""
        if loader is not self._training_loader:
            return None
        self._asking = True  # a group healing from this one now receives the position before the step's batches
        try:
            if self._phase != "gathering":
                self._begin()
            rank, live = self.manager.participating_rank(), self.manager.num_participants()
        finally:
            self._asking = False
        groups = self.config.num_replica_groups
        if rank is None or (live == groups and rank == self.config.replica_id):
            return None
        parts = range(rank, groups, live)
        # the live groups' gradients are averaged with equal weights: weighted by the parts each trains (2 of 3
        # groups live: one trains 2 parts, the other 1), the average is the whole global batch's
        self._covering, self._weight = live < groups, len(parts) * live / groups
        return [group * shard.count + shard.index for group in parts]
