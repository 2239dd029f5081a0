"""Training through failures without a restart of everyone: replica groups on torchft (docs/fault_tolerance.md).

Each replica group is its own torch elastic job: its own processes, mesh (FSDP, TP, CP inside) and launcher agent,
which restarts the group when one of its processes dies. torchft joins the groups: a lighthouse forms a quorum of the
live groups, the groups exchange through torchft's reconfigurable process group (rank i of a group with rank i of
every other: the groups have one layout, so a process's shards are the same slices in every group), and what the
quorum did not finish is discarded in every group (torchft's `should_commit`). A restarted group is healed from a live
peer: model, optimizer, schedulers, RNG and data position arrive through torchft's checkpoint transport (no disk) and
are applied before its first step.

`ReplicaGroups` is what both modes share: the Manager, the quorum, the averaging, the healing. The groups meet every
step (every_step.py: gradients averaged) or every N steps (periodic.py: LocalSGD / DiLoCo). Each is the engine's
StepHooks (training/step_hooks.py): the Accelerator calls it at a step's points and never reaches into it.
"""

from __future__ import annotations

import abc
import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..checkpoint.files import capture_rng, restore_rng
from ..core.errors import HfBackendError
from ..core.notes import note
from ..parallel.dims import DataShard
from ..runtime.collectives import reduce_flat
from ..runtime.process import ProcessState
from ..training.gradient_state import GradientState
from ..training.prepared import PreparedObjects
from ..training.step_hooks import StepHooks
from .settings import NO_TORCHFT, FaultTolerance


class ReplicaGroups(StepHooks, abc.ABC):
    """This process's part in the replica groups: a torchft Manager, and what a step's hooks share. Built with the
    parts of the engine it reads: the prepared objects (what a healing group receives), the gradient state (the
    loader being iterated, the micro step) and the strategy's data shard."""

    meets_every_step = True

    def __init__(self, config: FaultTolerance, process: ProcessState, objects: PreparedObjects,
                 gradient_state: GradientState, shard: DataShard, first_start: bool) -> None:
        try:
            from torchft import Manager
            from torchft.process_group import ProcessGroupGloo
        except ImportError as error:
            raise HfBackendError(NO_TORCHFT) from error
        if process.device.type != "cpu":
            raise HfBackendError("fault_tolerance runs on CPU processes (gloo) only so far: torchft's NCCL "
                                 "process group has not run here; train without fault_tolerance on GPUs")
        self.config, self.objects, self.gradient_state, self.shard = config, objects, gradient_state, shard
        timeout = datetime.timedelta(seconds=config.collective_timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load, state_dict=self._state,
            # zero-padded: torchft ranks a quorum's groups by their ids as strings (every_step.py's parts)
            min_replica_size=config.min_replicas, replica_id=f"replica_{config.replica_id:06d}", timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=config.quorum_timeout), rank=process.process_index,
            world_size=process.num_processes, lighthouse_addr=config.lighthouse,
            # meeting every N steps: a group that is behind is healed as the quorum forms, before the groups'
            # moves are averaged (torchft's DiLoCo needs the same)
            use_async_quorum=self.meets_every_step)
        self.discarded = 0  # steps the quorum did not commit, since this process started
        self._short_since: int | None = None  # the step since which groups are missing
        self._wait_for_everyone = self._first_start = first_start
        self._phase = "idle"  # idle -> gathering (quorum asked) -> decided (committed or not)
        self._covering = False  # whether this step's batches include missing groups' parts (every_step.py)
        self._weight = 1.0  # this group's share of the step's samples, times the live groups (every_step.py)
        self._training_loader: Any = None  # the loader the last committed step's batches came from
        self._asking = False  # whether the training loader is waiting for the step's quorum
        self._handed_out: dict[int, int] = {}  # each loader's batches handed out when the last step was decided

    @property
    @abc.abstractmethod
    def committed_steps(self) -> int:
        """Optimizer steps the run has applied (each mode counts its own)."""

    # -- what both modes share ---------------------------------------------------------------------
    def _begin(self) -> None:
        self.manager.start_quorum()
        if self._wait_for_everyone:  # a first start: the groups begin together, not whoever is up first
            self._wait_for_everyone = False
            deadline = time.monotonic() + self.config.quorum_timeout
            while self.manager.num_participants() < self.config.num_replica_groups and time.monotonic() < deadline:
                time.sleep(0.2)
                self.manager.start_quorum()
            if self.manager.num_participants() < self.config.num_replica_groups:
                note(f"fault tolerance: {self.manager.num_participants()} of {self.config.num_replica_groups} "
                     f"replica groups joined within {self.config.quorum_timeout:g} s; training with them")
        self._phase = "gathering"
        self._covering, self._weight = False, 1.0

    def _average(self, tensors: list[torch.Tensor], weight: float = 1.0) -> None:
        """Each tensor replaced by its average over the quorum's groups, this group's times `weight`: one exchange
        per dtype (runtime/collectives.py's flat buffers, reduced by torchft)."""
        def exchange(flat: torch.Tensor) -> None:
            if weight != 1.0:
                flat.mul_(weight)
            self.manager.allreduce(flat).wait()

        reduce_flat(tensors, exchange)

    def _note_missing_groups(self) -> None:
        """One note when steps start committing without some groups (the live groups train their parts of the
        batches, or nobody does), one when every group is back; from the live groups (a healing one was missing)."""
        if self.manager.participating_rank() is None:
            return
        step, present, groups = self.committed_steps, self.manager.num_participants(), \
            self.config.num_replica_groups
        if present < groups and self._short_since is None:
            self._short_since = step
            note(f"fault tolerance: step {step} committed by {present} of {groups} replica groups; " + (
                "the live groups train the missing groups' parts of the batches" if self._covering else
                "the missing groups' parts of the batches are not trained until they are back"))
        elif present == groups and self._short_since is not None:
            short = step - self._short_since
            note(f"fault tolerance: all {groups} replica groups back at step {step}; {short} step"
                 f"{'s' if short != 1 else ''} trained by fewer groups")
            self._short_since = None

    def _trainable(self) -> list[torch.Tensor]:
        return [_local(p) for model in self.objects.models for p in model.parameters() if p.requires_grad]

    # -- the step hooks both modes answer the same -------------------------------------------------
    def data_shard(self, shard: DataShard) -> DataShard:
        """Each group reads its own part of every global batch: the group's shards, times the groups."""
        return shard._replace(count=shard.count * self.config.num_replica_groups,
                              index=self.config.replica_id * shard.count + shard.index)

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    shutdown = close

    def evaluation_loader(self, loader: Any) -> Any:
        """`loader` (prepared) made an evaluation loader: split over this group's processes only, so that every
        group evaluates all of it (and group 0's metrics, the ones reported, cover the whole set), not its part of
        each global batch as training does. The Trainer's evaluation and test loaders are; returns `loader`."""
        if loader.split_here:
            loader.split(self.shard.count, self.shard.index)
        else:
            note("fault tolerance: an evaluation loader over a stream or a DistributedSampler keeps its split across "
                 "the replica groups: each group evaluates its part of the set")
        return loader

    def register_state(self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """More state a healing group receives from a live one (the Trainer's step counters), applied after the
        engine's."""
        self.manager.register_state_dict_fn(name, load_state_dict, state_dict)

    # -- what a healing group receives -------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        objects = self.objects
        return {"models": [[_local(t).detach() for t in _tensors(m)] for m in objects.models],
                "optimizers": [_local_optimizer_state(opt.state_dict()) for opt in objects.optimizers],
                "schedulers": [s.state_dict() for s in objects.schedulers],
                "loaders": [{"position": loader.state_dict(), "before_step": self._asking and loader is
                             self._training_loader} for loader in objects.dataloaders],
                "rng": capture_rng(), "accumulation_step": self.gradient_state.micro_step, **self._mode_state()}

    def _load(self, state: dict[str, Any]) -> None:
        objects = self.objects
        with torch.no_grad():
            for model, tensors in zip(objects.models, state["models"], strict=True):
                for mine, theirs in zip(_tensors(model), tensors, strict=True):
                    _local(mine).copy_(theirs)
        for opt, saved in zip(objects.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(_distributed_optimizer_state(saved, opt))
        for scheduler, saved in zip(objects.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        for loader, saved in zip(objects.dataloaders, state["loaders"], strict=True):
            # a position from before the live group's batches of this step: past the ones this group just took
            ahead = loader.handed_out - self._handed_out.get(id(loader), 0) if saved["before_step"] else 0
            loader.catch_up(saved["position"], ahead)
        restore_rng(state["rng"])
        self.gradient_state.micro_step = state["accumulation_step"]
        self._load_mode_state(state)
        note(f"fault tolerance: replica group {self.config.replica_id} healed from a live group at step "
             f"{self.committed_steps}")

    def _mode_state(self) -> dict[str, Any]:
        """What a mode adds to the state a healing group receives."""
        return {}

    def _load_mode_state(self, state: dict[str, Any]) -> None:
        pass


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "state": {key: {name: _local(value) if isinstance(value, torch.Tensor) else value
                                     for name, value in entry.items()} for key, entry in state["state"].items()}}


def _distributed_optimizer_state(state: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """A peer's optimizer state (local shards) laid over this process's parameters: a shard of a DTensor parameter
    becomes a DTensor like it again."""
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def like(value: Any, param: torch.Tensor) -> Any:
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
            return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())
        return value

    return {**state, "state": {key: {name: like(value, params[int(key)]) for name, value in entry.items()}
                               for key, entry in state["state"].items()}}
