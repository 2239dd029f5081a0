"""Fault tolerance's settings: which replica group this process belongs to, of how many, where the lighthouse is
(`FaultTolerance`, one value from the launcher's variable, the script or a config file), and the lighthouse a
launcher serves. The groups themselves: groups.py (docs/fault_tolerance.md).

Off unless asked for (`hf-backend launch --fault_tolerance`, `Accelerator(fault_tolerance=...)`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..config import environment as env
from ..config.schema import FaultToleranceSection, default_of, fields_of
from ..core.errors import HfBackendError
from ..core.notes import note

NO_TORCHFT = ("fault_tolerance needs torchft: pip install 'hf-backend[fault-tolerance]' (torchft 0.2.0 and the "
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
        raise HfBackendError(NO_TORCHFT) from error
    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, **_LIGHTHOUSE)
