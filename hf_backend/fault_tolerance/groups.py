"""Training through failures without a restart of everyone: replica groups on torchft (docs/fault_tolerance.md).

Each replica group is its own torch elastic job: its own processes, mesh (FSDP, TP, CP inside) and launcher agent,
which restarts the group when one of its processes dies. torchft joins the groups: a lighthouse forms a quorum of the
live groups at every optimizer step, the gradients are averaged across the quorum through torchft's reconfigurable
process group (rank i of a group with rank i of every other: the groups have one layout, so a process's shards are
the same slices in every group), and a step the quorum did not finish is discarded in every group (torchft's
`should_commit`). The quorum is asked as the training loader hands out a step's batch, so that while groups are
missing the live ones read and train their parts of it too. A restarted group is healed from a live peer: model,
optimizer, schedulers, RNG and data position arrive through torchft's checkpoint transport (no disk) and are applied
before its first step.

Off unless asked for (`hf-backend launch --fault_tolerance`, `Accelerator(fault_tolerance=...)`); torchft is imported
only then.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..checkpoint.files import capture_rng, restore_rng
from ..config import environment as env
from ..config.schema import FaultToleranceSection, default_of, fields_of
from ..core.enums import DistributedType
from ..core.errors import HfBackendError
from ..core.notes import note
from ..parallel.dims import DataShard
from ..training.prepared import PreparedObjects

_NO_TORCHFT = ("fault_tolerance needs torchft: pip install 'hf-backend[fault-tolerance]' (torchft 0.2.0 and the "
               "opentelemetry packages it imports)")
_NOT_LAUNCHED = ("fault_tolerance=True reads this replica group's settings from the launcher, which gave none; start "
                 "each group with `hf-backend launch --fault_tolerance --replica_id I --num_replica_groups N` "
                 "(docs/fault_tolerance.md) or pass FaultTolerance(replica_id=..., num_replica_groups=..., "
                 "lighthouse=...)")
# The lighthouse a launcher starts: a quorum forms 1 s after a member is missing, a member is dead after 2 s without a
# heartbeat (torchft's defaults, 60 s and 5 s, would stall the live groups that long at every failure).
_LIGHTHOUSE = {"join_timeout_ms": 1000, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 2000}
_DEFAULTS = {name: default_of(f) for name, f in fields_of(FaultToleranceSection).items()}  # the config file's


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """Which replica group this process belongs to, of how many, and where the lighthouse is. `min_replicas`: the
    fewest live groups a step commits with; `collective_timeout`: seconds for a gradient exchange, a commit or a
    healing; `quorum_timeout`: seconds to wait for a quorum (a group being restarted rejoins within it);
    `sync_every`, `outer_lr`, `outer_momentum`: the groups meet every step (gradients averaged) or every N steps
    (LocalSGD / DiLoCo: each group steps alone in between; docs/fault_tolerance.md)."""

    replica_id: int
    num_replica_groups: int
    lighthouse: str
    min_replicas: int = _DEFAULTS["min_replicas"]
    collective_timeout: float = _DEFAULTS["collective_timeout"]
    quorum_timeout: float = _DEFAULTS["quorum_timeout"]
    sync_every: int = _DEFAULTS["sync_every"]
    outer_lr: float = _DEFAULTS["outer_lr"]
    outer_momentum: float = _DEFAULTS["outer_momentum"]

    @classmethod
    def from_environment(cls) -> FaultTolerance | None:
        """The settings `hf-backend launch --fault_tolerance` handed this process, or None."""
        raw = env.launcher_setting(env.FAULT_TOLERANCE)
        if raw is None:
            return None
        try:
            section = json.loads(raw)
        except json.JSONDecodeError:
            raise HfBackendError(f"environment variable {env.FAULT_TOLERANCE} is not JSON; start the job with "
                                 "hf-backend launch --fault_tolerance, or unset it") from None
        return cls.of_section(section)

    @classmethod
    def of_section(cls, section: dict[str, Any]) -> FaultTolerance:
        """From a config file's `fault_tolerance_config` (its lighthouse resolved by the launcher)."""
        return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls) if f.name in section})

    def __post_init__(self) -> None:
        if not 0 <= self.replica_id < self.num_replica_groups:
            raise HfBackendError(f"FaultTolerance(replica_id={self.replica_id}, num_replica_groups="
                                 f"{self.num_replica_groups}): the id counts the groups from 0")
        if not 1 <= self.min_replicas <= self.num_replica_groups:
            raise HfBackendError(f"FaultTolerance(min_replicas={self.min_replicas}): give 1 to "
                                 f"num_replica_groups={self.num_replica_groups}")
        if not self.lighthouse:
            raise HfBackendError("FaultTolerance(lighthouse=...): give the lighthouse's address, http://HOST:PORT")
        if self.sync_every < 1 or not 0 <= self.outer_momentum < 1 or self.outer_lr <= 0:
            raise HfBackendError(f"FaultTolerance(sync_every={self.sync_every}, outer_lr={self.outer_lr}, "
                                 f"outer_momentum={self.outer_momentum}): give sync_every >= 1, outer_lr > 0 and "
                                 "0 <= outer_momentum < 1")


def resolve(value: Any) -> FaultTolerance | None:
    """The Accelerator's `fault_tolerance` argument as one value, None when off: None follows the launcher, True
    requires its settings, False is off, a dict holds the settings."""
    launched = FaultTolerance.from_environment()
    if value is None:
        return launched
    if value is False:
        if launched is not None:
            note("fault_tolerance=False given to Accelerator() overrides the launcher's --fault_tolerance: this "
                 "process trains without replica groups")
        return None
    if value is True:
        if launched is None:
            raise HfBackendError(_NOT_LAUNCHED)
        return launched
    if isinstance(value, FaultTolerance):
        return value
    if isinstance(value, dict):
        return FaultTolerance.of_section(value)
    raise HfBackendError(f"fault_tolerance={value!r}: pass True (the launcher's settings), a FaultTolerance or a "
                         "dict of its fields")


def serve_lighthouse(port: int, min_replicas: int) -> Any:
    """A torchft lighthouse in this process (the launcher of replica group 0), on `port` (0: a free one); its
    `address()` is what the groups join, `shutdown()` ends it."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as error:
        raise HfBackendError(_NO_TORCHFT) from error
    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, **_LIGHTHOUSE)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ReplicaGroups:
    """This process's part in the replica groups: a torchft Manager, and the step protocol the Accelerator runs
    (`average_gradients` on each synchronising backward, `commit` before and `stepped` after each optimizer step)."""

    def __init__(self, config: FaultTolerance, process: Any, objects: PreparedObjects, accelerator: Any,
                 first_start: bool) -> None:
        try:
            from torchft import Manager
            from torchft.process_group import ProcessGroupGloo
        except ImportError as error:
            raise HfBackendError(_NO_TORCHFT) from error
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise HfBackendError("fault_tolerance with DeepSpeed: its engine reduces the gradients itself; use "
                                 "FSDP (fsdp_plugin or parallelism_config) or DDP inside each replica group")
        if process.device.type != "cpu":
            raise HfBackendError("fault_tolerance runs on CPU processes (gloo) only so far: torchft's NCCL "
                                 "process group has not run here; train without fault_tolerance on GPUs")
        self.config, self.objects, self.accelerator = config, objects, accelerator
        timeout = datetime.timedelta(seconds=config.collective_timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load, state_dict=self._state,
            # zero-padded: torchft ranks a quorum's groups by their ids as strings (`_parts_of_step`)
            min_replica_size=config.min_replicas, replica_id=f"replica_{config.replica_id:06d}", timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=config.quorum_timeout), rank=process.process_index,
            world_size=process.num_processes, lighthouse_addr=config.lighthouse,
            # meeting every N steps: a group that is behind is healed as the quorum forms, before the groups'
            # moves are averaged (torchft's DiLoCo needs the same)
            use_async_quorum=config.sync_every == 1)
        self.meets_every_step = config.sync_every == 1
        self._phase = "idle"  # idle -> gathering (quorum asked, gradients averaged) -> decided (committed or not)
        self._decision = False
        self.discarded = 0  # steps the quorum did not commit, since this process started
        self.discarded_meetings = 0  # meeting every N steps: meetings the quorum did not finish
        self._short_since: int | None = None  # the step since which groups are missing
        self._wait_for_everyone = self._first_start = first_start
        self._local_steps = 0  # optimizer steps taken, when the groups meet every N steps
        self._stepped = 0  # optimizers stepped in this step
        self._outer: _OuterStep | None = None  # the weights of the last meeting and the outer optimizer
        self._healed = False  # whether the meeting under way healed this group
        self._covering = False  # whether this step's batches include missing groups' parts (`follow_quorum`)
        self._weight = 1.0  # this group's share of the step's samples, times the live groups (`_parts_of_step`)
        self._training_loader: Any = None  # the loader the last committed step's batches came from
        self._asking = False  # whether the training loader is waiting for the step's quorum (`_parts_of_step`)
        self._handed_out: dict[int, int] = {}  # each loader's batches handed out when the last step was decided

    # -- the step protocol -------------------------------------------------------------------------
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

    def average_gradients(self, models: list[torch.nn.Module]) -> None:
        """Average every gradient across the quorum's groups, in one flat buffer per dtype (a group that is
        healing contributes zeros and receives the average). A trainable parameter without a gradient gets
        zeros: every group sends the same buffer."""
        if not self.meets_every_step:
            return
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

    def _average(self, tensors: list[torch.Tensor], weight: float = 1.0) -> None:
        """Each tensor replaced by its average over the quorum's groups, this group's times `weight`: one exchange
        per dtype."""
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in same])
            if weight != 1.0:
                flat.mul_(weight)
            self.manager.allreduce(flat).wait()
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def commit(self) -> bool:
        """Whether this step's update is applied (the same answer in every process of the group; once per step,
        whatever the number of optimizers). Meeting every N steps, a local step is always applied, but for the
        first: the groups meet before it (their starting weights agree), and a restarted group healed there skips
        it."""
        if not self.meets_every_step:
            if self._outer is None:  # the first meeting
                self._outer, self._healed = _OuterStep(self._trainable(), self.config), False
                self._meet()
                return not self._healed_on_restart()
            return True
        if self._phase == "idle":
            self._begin()
        if self._phase == "gathering":
            self._decision = self.manager.should_commit()
            self._phase = "decided"
            loader = self.accelerator.gradient_state.active_dataloader or self._training_loader
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

    def _healed_on_restart(self) -> bool:
        """Whether a restarted group was healed at its first meeting: its first step's gradient was then taken on
        the weights the meeting replaced, and is not applied. (On a first start torchft's `init_sync` copies one
        group's starting weights into the others, which are the same weights when the script seeds them.) torchft
        heals each process from its own source, so the group decides together."""
        healed = torch.tensor(float(self._healed and not self._first_start))
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(healed, op=torch.distributed.ReduceOp.MAX)
        return bool(healed.item())

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

    def stepped(self) -> None:
        """An optimizer stepped; meeting every N steps, once all have and the count is a multiple of N, the groups
        meet: each group's move since the last meeting is averaged across the quorum and the outer optimizer steps
        on it from the last meeting's weights (LocalSGD: lr 1, no momentum, the average of the weights; DiLoCo).
        A meeting the quorum does not finish leaves every group at the last meeting's weights."""
        if self.meets_every_step:
            return
        self._stepped += 1
        if self._stepped < len(self.objects.optimizers):
            return
        self._stepped = 0
        self._local_steps += 1
        if self._local_steps % self.config.sync_every == 0:
            self._meet()

    def _meet(self) -> None:
        self._begin()  # a group that is behind receives a live one's state as the quorum forms
        params = self._trainable()
        moves = self._outer.moves(params)
        self._average(moves)
        if self.manager.should_commit():
            self._outer.step(moves)
            self._note_missing_groups()
        else:
            self.discarded_meetings += 1
            note(f"fault tolerance: the meeting after step {self._local_steps} failed (a replica group failed "
                 f"during it); every group goes back to the weights of the meeting before")
        self._outer.restore(params)

    def _trainable(self) -> list[torch.Tensor]:
        return [_local(p) for model in self.objects.models for p in model.parameters() if p.requires_grad]

    @property
    def committed_steps(self) -> int:
        """Optimizer steps the run has applied: committed steps, or meeting every N steps, the steps taken."""
        return self.manager.current_step() if self.meets_every_step else self._local_steps

    def data_shard(self, shard: DataShard) -> DataShard:
        """Each group reads its own part of every global batch: the group's shards, times the groups."""
        return shard._replace(count=shard.count * self.config.num_replica_groups,
                              index=self.config.replica_id * shard.count + shard.index)

    def follow_quorum(self, loader: Any) -> None:
        """While groups are missing, the live ones train their parts of every global batch: `loader` (prepared
        over `data_shard` of the strategy's shard) asks the step's quorum before handing out its batch. Not when the
        groups meet every N steps (no quorum between meetings) or for a loader that cannot read other processes'
        parts (a stream, a DistributedSampler's): the missing parts are then not trained, and a note says so."""
        if self.meets_every_step and loader.can_read_parts:
            loader.read_parts(lambda: self._parts_of_step(loader, self.accelerator.strategy.data_shard))

    def evaluation_loader(self, loader: Any) -> Any:
        """`loader` (prepared) made an evaluation loader: split over this group's processes only, so that every
        group evaluates all of it (and group 0's metrics, the ones reported, cover the whole set), not its part of
        each global batch as training does. The Trainer's evaluation and test loaders are; returns `loader`."""
        if loader.split_here:
            shard = self.accelerator.strategy.data_shard
            loader.split(shard.count, shard.index)
        else:
            note("fault tolerance: an evaluation loader over a stream or a DistributedSampler keeps its split across "
                 "the replica groups: each group evaluates its part of the set")
        return loader

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

    def register_state(self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """More state a healing group receives from a live one (the Trainer's step counters), applied after the
        engine's."""
        self.manager.register_state_dict_fn(name, load_state_dict, state_dict)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # -- what a healing group receives -------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        objects = self.objects
        return {"models": [[_local(t).detach() for t in _tensors(m)] for m in objects.models],
                "optimizers": [_local_optimizer_state(opt.state_dict()) for opt in objects.optimizers],
                "schedulers": [s.state_dict() for s in objects.schedulers],
                "loaders": [{"position": loader.state_dict(), "before_step": self._asking and loader is
                             self._training_loader} for loader in objects.dataloaders],
                "rng": capture_rng(), "accumulation_step": self.accelerator.step, "local_steps": self._local_steps,
                "outer": self._outer.state_dict() if self._outer is not None else None}

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
        self.accelerator.step = state["accumulation_step"]
        self._local_steps = state["local_steps"]
        self._healed = True
        if state["outer"] is not None:
            if self._outer is None:
                self._outer = _OuterStep(self._trainable(), self.config)
            self._outer.load_state_dict(state["outer"])
        note(f"fault tolerance: replica group {self.config.replica_id} healed from a live group at step "
             f"{self.committed_steps}")


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


class _OuterStep:
    """The groups' weights at the last meeting (this process's shards) and the outer optimizer that moves them: SGD
    with Nesterov momentum on the averaged move (DiLoCo's outer step; lr 1 and no momentum: the average)."""

    def __init__(self, params: list[torch.Tensor], config: FaultTolerance) -> None:
        self.anchor = [torch.nn.Parameter(p.detach().clone()) for p in params]
        self.optimizer = torch.optim.SGD(self.anchor, lr=config.outer_lr, momentum=config.outer_momentum,
                                         nesterov=config.outer_momentum > 0)

    def moves(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """How far each parameter moved since the last meeting, as a gradient: anchor - now."""
        return [anchor.detach() - p.detach() for anchor, p in zip(self.anchor, params, strict=True)]

    def step(self, moves: list[torch.Tensor]) -> None:
        for anchor, move in zip(self.anchor, moves, strict=True):
            anchor.grad = move
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def restore(self, params: list[torch.Tensor]) -> None:
        for p, anchor in zip(params, self.anchor, strict=True):
            p.copy_(anchor)

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": [a.detach() for a in self.anchor], "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for mine, theirs in zip(self.anchor, state["anchor"], strict=True):
            mine.copy_(theirs)
        self.optimizer.load_state_dict(state["optimizer"])
