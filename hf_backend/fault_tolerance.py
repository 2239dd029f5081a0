"""Training through failures without a restart of everyone: replica groups on torchft (docs/fault_tolerance.md).

Each replica group is its own torch elastic job: its own processes, mesh (FSDP, TP, CP inside) and launcher agent,
which restarts the group when one of its processes dies. torchft joins the groups: a lighthouse forms a quorum of the
live groups at every optimizer step, the gradients are averaged across the quorum through torchft's reconfigurable
process group (rank i of a group with rank i of every other: the groups have one layout, so a process's shards are
the same slices in every group), and a step the quorum did not finish is discarded in every group (torchft's
`should_commit`). A restarted group is healed from a live peer: model, optimizer, schedulers, RNG and data position
arrive through torchft's checkpoint transport (no disk) and are applied before its first step.

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

from .checkpoint.files import capture_rng, restore_rng
from .config import environment as env
from .config.schema import FaultToleranceSection, default_of, fields_of
from .enums import DistributedType
from .errors import HfBackendError
from .notes import note
from .prepared import PreparedObjects
from .strategies.mesh import DataShard

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
    healing; `quorum_timeout`: seconds to wait for a quorum (a group being restarted rejoins within it)."""

    replica_id: int
    num_replica_groups: int
    lighthouse: str
    min_replicas: int = _DEFAULTS["min_replicas"]
    collective_timeout: float = _DEFAULTS["collective_timeout"]
    quorum_timeout: float = _DEFAULTS["quorum_timeout"]

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
    (`average_gradients` on each synchronising backward, `commit` before each optimizer step)."""

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
            min_replica_size=config.min_replicas, replica_id=f"replica_{config.replica_id}", timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=config.quorum_timeout), rank=process.process_index,
            world_size=process.num_processes, lighthouse_addr=config.lighthouse)
        self._phase = "idle"  # idle -> gathering (quorum asked, gradients averaged) -> decided (committed or not)
        self._decision = False
        self.discarded = 0  # steps the quorum did not commit, since this process started
        self._short_since: int | None = None  # the step since which groups are missing
        self._wait_for_everyone = first_start

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

    def average_gradients(self, models: list[torch.nn.Module]) -> None:
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
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            self.manager.allreduce(flat).wait()
            offset = 0
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def commit(self) -> bool:
        """Whether this step's update is applied (the same answer in every process of the group; once per step,
        whatever the number of optimizers)."""
        if self._phase == "idle":
            self._begin()
        if self._phase == "gathering":
            self._decision = self.manager.should_commit()
            self._phase = "decided"
            if not self._decision:
                self.discarded += 1
                note(f"fault tolerance: step {self.manager.current_step()} discarded (a replica group failed "
                     "during it); its batches are not trained")
            else:
                self._note_missing_groups()
        return self._decision

    def _note_missing_groups(self) -> None:
        """One note when steps start committing without some groups (their parts of the batches go untrained), one
        when every group is back."""
        step, present, groups = self.manager.current_step(), self.manager.num_participants(), \
            self.config.num_replica_groups
        if present < groups and self._short_since is None:
            self._short_since = step
            note(f"fault tolerance: step {step} committed by {present} of {groups} replica groups; the missing "
                 "groups' parts of the batches are not trained until they are back")
        elif present == groups and self._short_since is not None:
            note(f"fault tolerance: all {groups} replica groups back at step {step}; {step - self._short_since} "
                 "steps trained without some groups' parts of their batches")
            self._short_since = None

    @property
    def committed_steps(self) -> int:
        return self.manager.current_step()

    def data_shard(self, shard: DataShard) -> DataShard:
        """Each group reads its own part of every global batch: the group's shards, times the groups."""
        return shard._replace(count=shard.count * self.config.num_replica_groups,
                              index=self.config.replica_id * shard.count + shard.index)

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
                "loaders": [loader.state_dict() for loader in objects.dataloaders],
                "rng": capture_rng(), "accumulation_step": self.accelerator.step}

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
            loader.catch_up(saved)
        restore_rng(state["rng"])
        self.accelerator.step = state["accumulation_step"]
        note(f"fault tolerance: replica group {self.config.replica_id} healed from a live group at step "
             f"{self.manager.current_step()}")


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
