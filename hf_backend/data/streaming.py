"""Streams (DataLoaders over an IterableDataset) in several processes: each process's part of every
global batch.

Two ways to split a stream, both yielding this process's examples `per_rank` at a time, the same
number of steps on every process, and recording what `gather_for_metrics` and resuming need:

* `GlobalBatchShard`, any torch IterableDataset (Accelerate's `IterableDatasetShard`): every process
  reads the whole stream, groups it into global batches (`per_rank * num_processes` examples) and
  keeps its slice. The last, short global batch is completed by cycling the first global batch;
  `remainder` holds its real rows. Resuming skips the steps already taken by reading them again (a
  plain IterableDataset has no position to restore).
* `NodeStream`, a `datasets.IterableDataset`: `split_dataset_by_node` gives each process its own
  part (whole files when their number divides by the number of processes, else every Nth example),
  so no process reads another's part. After reading each step's examples the processes exchange how
  many they got and their dataset's `state_dict()` (one small `all_gather_object` per step): every
  process then knows every position, so rank 0's loader state (the one checkpoints write) resumes
  every process without re-reading. When a process's part runs out first, the remaining examples of
  all parts are exchanged as they are read and dealt out as global batches in rank order, the last
  one completed by cycling the first of these: every process runs the same number of steps and the
  padding is at the end of the gathered global batch, where `gather_for_metrics` cuts it. In one
  process (where it is used to resume from the dataset's state) the last batch is left short, as a
  DataLoader leaves it.

Both run in the main process (the DataLoader's `num_workers` must be 0): the split, and the
collectives of `NodeStream`, are per process, not per worker.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from ..core.errors import HfBackendError
from ..runtime.collectives import gather_object

# NodeStream's resume point: every process's dataset state, and steps to skip after it
Position = dict[str, Any]


def is_datasets_stream(dataset: Any) -> bool:
    """Whether `dataset` is a `datasets.IterableDataset` (without importing datasets when the script
    has not)."""
    import sys

    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.IterableDataset)


def check_stream_loader(loader: Any, num_processes: int) -> None:
    if loader.num_workers > 0:
        raise HfBackendError(
            f"a DataLoader over an IterableDataset in {num_processes} processes reads its stream "
            f"in the main process: set num_workers=0 (got {loader.num_workers}); with a datasets "
            "IterableDataset, `.map()` runs lazily as it streams")


class _Stream(IterableDataset):
    """What both splits share: the step a pass starts at and the real rows of the step last produced.
    """

    def __init__(self, dataset: Any, num_processes: int, process_index: int, per_rank: int,
                 drop_last: bool) -> None:
        self.dataset = dataset
        self.num_processes = num_processes
        self.process_index = process_index
        self.per_rank = per_rank
        self.drop_last = drop_last
        self.remainder = 0  # real rows of the global batch last produced when it was short, else 0
        self._epoch = 0
        self._start: tuple[int, Position | None] = (0, None)

    # -- the loader's source interface (data.PreparedDataLoader) -----------------------------------
    # its mark holds each process's place in its part: it is kept on resume
    restores_its_own_position = True

    @property
    def global_batch_size(self) -> int:
        return self.per_rank * self.num_processes

    @property
    def per_process_batch_size(self) -> int:
        return self.per_rank

    def begin(self, epoch: int, skip: int, position: Position | None = None) -> None:
        """The next pass is epoch `epoch` starting at step `skip` (from `position` when there is one).
        """
        self._epoch = epoch
        self._start = (skip, position)
        if hasattr(self.dataset, "set_epoch"):
            # datasets: the shuffle buffer's and the shards' order of this epoch
            self.dataset.set_epoch(epoch)

    def position(self, step: int) -> Position | None:
        """Where step `step` of the pass in progress starts (None: the step count alone says it)."""
        return None

    def mark(self, steps: int, started: bool) -> Position | None:
        return self.position(steps) if started else None

    def ended(self, steps: int) -> bool:
        return False

    def resumed(self, batches: Iterator[Any]) -> Iterator[Any]:
        return batches  # the stream starts at the step itself

    def remainder_of(self, batch: Any) -> int:
        return self.remainder

    def _mine(self, batch: list) -> list:
        return batch[self.process_index * self.per_rank:(self.process_index + 1) * self.per_rank]

    def _padded(self, real: list, first: list) -> list:
        pad, out = list(first) or list(real), list(real)
        while len(out) < self.global_batch_size:
            out.extend(pad[: self.global_batch_size - len(out)])
        return out


class GlobalBatchShard(_Stream):
    """This process's slice of each global batch of a stream every process reads whole."""

    def __iter__(self) -> Iterator[Any]:
        skip, _ = self._start
        first: list[Any]
        size, first, current, step = self.global_batch_size, [], [], 0
        for example in self.dataset:
            current.append(example)
            if len(current) < size:
                continue
            first = first or current
            if step >= skip:
                self.remainder = 0
                yield from self._mine(current)
            step, current = step + 1, []
        if current and not self.drop_last and step >= skip:
            self.remainder = len(current)
            yield from self._mine(self._padded(current, first or current))


class NodeStream(_Stream):
    """This process's part of a `datasets.IterableDataset` split by node; positions restored through
    its state."""

    def __init__(self, dataset: Any, num_processes: int, process_index: int, per_rank: int,
                 drop_last: bool) -> None:
        if num_processes > 1:
            from datasets.distributed import split_dataset_by_node

            dataset = split_dataset_by_node(dataset, rank=process_index, world_size=num_processes)
        super().__init__(dataset, num_processes, process_index, per_rank, drop_last)
        self._positions: dict[int, Position] = {}

    def position(self, step: int) -> Position | None:
        return self._positions.get(step)

    def _record(self, step: int, position: Position) -> None:
        self._positions[step] = position
        # the loader looks one step ahead at most
        for old in [s for s in self._positions if s < step - 4]:
            del self._positions[old]

    def __iter__(self) -> Iterator[Any]:
        skip, start = self._start
        self._positions = {}
        states, step = None, 0
        if start is not None:
            states, step = start["states"], skip - start["steps"]
            if states is not None:
                self.dataset.load_state_dict(copy.deepcopy(states[self.process_index]))
        self._record(step, {"states": states, "steps": 0})
        examples = iter(self.dataset)
        while True:
            group = list(itertools.islice(examples, self.per_rank))
            counts_and_states = gather_object((len(group), copy.deepcopy(self.dataset.state_dict())))
            if any(n < self.per_rank for n, _ in counts_and_states):
                break
            states = [state for _, state in counts_and_states]
            self._record(step + 1, {"states": states, "steps": 0})
            if step >= skip:
                self.remainder = 0
                yield from group
            step += 1
        yield from self._tail(examples, group, [n < self.per_rank for n, _ in counts_and_states], states, step, skip)

    def _tail(self, examples: Iterator[Any], group: list, done: list[bool], states: list | None, step: int,
              skip: int) -> Iterator[Any]:
        """The end of the pass, once some part has run out: every part's remaining examples, exchanged
        as they are read, dealt out in rank order as global batches."""
        first: list[Any]
        size, tail_start, first = self.global_batch_size, step, []
        pool = [example for part in gather_object((group,)) for example in part[0]]
        while pool or not all(done):
            while len(pool) < size and not all(done):
                more = [] if done[self.process_index] else list(itertools.islice(examples, self.per_rank))
                parts = gather_object((more, done[self.process_index] or len(more) < self.per_rank))
                pool.extend(example for part, _ in parts for example in part)
                done = [finished for _, finished in parts]
            batch, pool = pool[:size], pool[size:]
            if not batch or (len(batch) < size and self.drop_last):
                return
            first = first or batch
            self._record(step + 1, {"states": states, "steps": step + 1 - tail_start})
            if step >= skip:
                self.remainder = len(batch) if len(batch) < size else 0
                yield from self._mine(self._padded(batch, first)) if self.num_processes > 1 else batch
            step += 1


def make_stream(loader: Any, num_processes: int, process_index: int, split_batches: bool) -> _Stream:
    """The split of `loader`'s IterableDataset for this process."""
    batch_size = loader.batch_size
    if not batch_size:
        raise HfBackendError("prepare() needs a DataLoader over an IterableDataset with a "
                             "batch_size to split it across processes; pass batch_size=...")
    if split_batches and batch_size % num_processes:
        raise HfBackendError("split_batches=True needs a batch size that divides by the "
                             f"{num_processes} processes, got {batch_size}; change the batch size "
                             "or use split_batches=False")
    per_rank = batch_size // num_processes if split_batches else batch_size
    kind = NodeStream if is_datasets_stream(loader.dataset) else GlobalBatchShard
    return kind(loader.dataset, num_processes, process_index, per_rank, loader.drop_last)
