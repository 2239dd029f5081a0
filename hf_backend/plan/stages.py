"""Pipeline stages for `hf-backend plan`: which parameters each pp rank holds (the engine's own layout,
strategies/pipeline.py: the embeddings on the first stage, the decoder layers split evenly, the final norm and the
head on the last) and how many microbatches' activations its schedule keeps at once.

The activations kept are an estimate from each schedule's depth: GPipe and looped BFS run every microbatch forward
before any backward (M in flight); 1F1B keeps pp - r on rank r; the interleaved and V-shaped schedules keep their
warm-up's chunks, 2 (pp - r - 1) + (v - 1) pp + 1 of them (a chunk: one microbatch through one of the rank's v
stages), at most v M. The logits sit on the last stage's rank: one microbatch's at a time, all M under GPipe and
looped BFS.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ..parallel.dims import MeshShape

if TYPE_CHECKING:
    import torch

_BLOCK = re.compile(r"\.layers\.(\d+)\.")
_HOLDS_EVERYTHING = ("GPipe", "LoopedBFS")  # every microbatch forward before the first backward


class Rank(NamedTuple):
    """One pp rank of a plan: its stages, which parameters (by name) are its, and what its schedule keeps."""

    number: int  # the pp rank
    stages: tuple[int, ...]
    holds: Callable[[str], bool] | None  # None: every parameter (no pipeline stages)
    layer_microbatches: int = 0  # decoder layers times the microbatches through them kept at once
    logits_held: int = 1  # microbatches whose logits the rank keeps at once


EVERYTHING = Rank(0, (), None)


def pp_ranks(model: torch.nn.Module, shape: MeshShape) -> list[Rank]:
    """Every pp rank of `shape` (its first data-parallel and tp coordinates: the others hold the same stages)."""
    from ..strategies.pipeline import V_SHAPED, check_splittable, is_looped, layout

    check_splittable(model)
    prefix: str = getattr(model, "base_model_prefix", "")  # check_splittable found the decoder there
    num_layers = len(getattr(model, prefix).layers)
    schedule, pp = shape.pp_schedule, shape.pp
    ranks = []
    for r in range(pp):
        placed = layout(schedule, pp, r, num_layers)
        v, m = len(placed.stages), shape.pp_microbatches or placed.num_stages
        layers_per_stage = max(len(placed.blocks[s]) for s in placed.stages)
        if schedule in _HOLDS_EVERYTHING:
            chunks = v * m
        elif is_looped(schedule) or schedule in V_SHAPED:
            chunks = min(v * m, 2 * (pp - r - 1) + (v - 1) * pp + 1)
        else:  # 1F1B
            chunks = min(m, pp - r)
        last = placed.num_stages - 1 in placed.stages
        ranks.append(Rank(r, placed.stages, _holder(placed, last), chunks * layers_per_stage,
                          (m if schedule in _HOLDS_EVERYTHING else 1) if last else 0))
    return ranks


def _holder(placed: object, last: bool) -> Callable[[str], bool]:
    stages, blocks = placed.stages, placed.blocks  # type: ignore[attr-defined]  # a pipeline Layout
    mine = {block for stage in stages for block in blocks[stage]}
    first = 0 in stages

    def holds(name: str) -> bool:
        block = _BLOCK.search(name)
        if block is not None:
            return int(block.group(1)) in mine
        return first if ".embed_tokens." in name else last  # the rest: the final norm and the head

    return holds


def microbatch_rows(batch: int, shape: MeshShape) -> int:
    """The rows of one microbatch of a process's batch (the schedule's default: one microbatch per stage)."""
    from ..strategies.pipeline import is_looped

    stages = shape.pp * (2 if is_looped(shape.pp_schedule) else 1)
    return max(1, batch // (shape.pp_microbatches or stages))


def describe(shape: MeshShape, priced: list[tuple[Rank, int, int]], chosen: Rank) -> str:
    """One line: each pp rank's stages, parameters and bytes, and which rank the plan's figures are."""
    parts = [f"rank {rank.number} stages {list(rank.stages)}: {count:,} parameters, {total / 2**20:,.1f} MiB"
             for rank, count, total in priced]
    return (f"pp {shape.pp} ({shape.pp_schedule}): " + "; ".join(parts) +
            f"; the figures are the most loaded, rank {chosen.number}'s")
