"""Where each strategy puts a model's weights, gradients and AdamW state on one process: the rules
`hf-backend plan` (plan/memory.py) counts with, written beside the strategies that apply them. Each
strategy class names its placement (`Strategy.placement`); the plan asks it, and knows no strategy.

A placement answers three questions: how a parameter's local shape (after tensor parallelism) is
cut (`local_numel`), over how many processes (`shards`), and what the strategy allocates on top of
the parameters' own tensors once the sums are known (`held`: DDP's buckets, ZeRO's fp32 masters).
"""

from __future__ import annotations

import dataclasses
import math

from ..parallel.dims import MeshShape

MAX_LIVE_PARAMETERS = 10**9  # DeepSpeed's default stage3_max_live_parameters


@dataclasses.dataclass(frozen=True)
class Sums:
    """A model's parameters summed as one process holds them."""

    weights: int  # bytes of the weights
    grads: int  # bytes of the trainable weights' gradients
    full_trainable: int  # bytes of the trainable weights whole (after tensor parallelism only)
    trainable: int  # how many trainable parameters the model has
    element_size: int  # bytes per trainable element


@dataclasses.dataclass(frozen=True)
class Held:
    """Bytes per process by what holds them, and what the reader should know of them."""

    parameters: int
    gradients: int
    optimizer: int
    notes: tuple[str, ...] = ()


class Placement:
    """One process holds every parameter whole (one process; DDP adds its buckets)."""

    takes_mesh = False  # whether dp_shard, cp and tp sizes (the engine's mesh) run under it

    def default_shape(self, num_processes: int) -> MeshShape:
        return MeshShape(dp_replicate=num_processes)

    def shards(self, shape: MeshShape, num_processes: int) -> int:
        return 1

    def local_numel(self, local: list[int], shards: int) -> int:
        return math.prod(local)

    def held(self, sums: Sums, num_processes: int) -> Held:
        return Held(sums.weights, sums.grads, 2 * sums.grads)


class Buckets(Placement):
    """DDP: every parameter whole, and its reducer copies every gradient into its buckets
    (gradient_as_bucket_view=False)."""

    def held(self, sums: Sums, num_processes: int) -> Held:
        return Held(sums.weights, 2 * sums.grads, 2 * sums.grads,
                    ("DDP: gradients twice, the parameters' own and the reducer's buckets",))


class FirstDimShards(Placement):
    """FSDP2's `fully_shard`: each parameter cut along its first dimension (padded) over dp_shard x cp."""

    takes_mesh = True

    def default_shape(self, num_processes: int) -> MeshShape:
        return MeshShape(dp_shard=num_processes)

    def shards(self, shape: MeshShape, num_processes: int) -> int:
        return shape.dp_shard * shape.sequence_slices

    def local_numel(self, local: list[int], shards: int) -> int:
        if shards > 1 and local:
            return math.ceil(local[0] / shards) * math.prod(local[1:])
        return math.prod(local)


@dataclasses.dataclass(frozen=True)
class Partitioned(Placement):
    """DeepSpeed ZeRO: the trainable weights flattened and cut in N for the fp32 masters and AdamW
    (every stage), the gradients (2, 3) and the weights themselves (3)."""

    stage: int

    def shards(self, shape: MeshShape, num_processes: int) -> int:
        return num_processes if self.stage == 3 else 1

    def local_numel(self, local: list[int], shards: int) -> int:
        return math.ceil(math.prod(local) / shards)

    def held(self, sums: Sums, num_processes: int) -> Held:
        partition = math.ceil(sums.trainable / num_processes)
        master = 4 * partition  # DeepSpeed's fp32 copy of its partition
        weights = sums.weights
        if self.stage == 3:
            grads = master  # a flat fp32 gradient partition, allocated at setup
            # the gathered trainable weights it keeps between uses, up to stage3_max_live_parameters elements
            weights += min(sums.full_trainable, MAX_LIVE_PARAMETERS * sums.element_size)
            notes = ["ZeRO-3: with DeepSpeed's default stage3_max_live_parameters and stage3_max_reuse_distance "
                     "(1e9) the gathered trainable weights stay after the first step, up to 1e9 of them (counted "
                     "with the parameters)"]
        else:
            grads = sums.full_trainable if self.stage == 1 else partition * sums.element_size
            notes = [f"ZeRO-{self.stage}: gradients exist during backward only (freed by the step)"]
        notes.append(f"ZeRO-{self.stage}: an fp32 copy of this process's 1/{num_processes} of the trainable "
                     "weights (counted with the parameters)")
        return Held(weights + master, grads, 2 * master, tuple(notes))


# by the names `hf-backend plan --strategy` takes (plan/memory.py's STRATEGIES)
PLACEMENTS: dict[str, Placement] = {"no": Placement(), "ddp": Buckets(), "fsdp": FirstDimShards(),
                                    "zero1": Partitioned(1), "zero2": Partitioned(2), "zero3": Partitioned(3)}
