"""Prepared dataloaders: sharded across processes in the user's sampler order, placed on the device,
resumable.

Sharding keeps the user's order: step i of N processes covers the same samples as step i of one
process whose batch is N times larger (with `split_batches`, the loader's batch is that global batch
and each process takes a slice). When the last global batch is short and `even_batches` is set, it
is padded with samples from the start of the epoch so every process takes the same number of equal
batches; `gather_for_metrics` drops the padding again.

Order: a RandomSampler without a generator of its own gets one, and epoch e is shuffled with seed
`data_seed + e` (`data_seed` defaults to the process's torch seed, rank 0's): the order Accelerate's
seedable sampler, and so transformers' Trainer, gives. A sampler with its own generator keeps it,
with rank 0's state on every rank.

Resuming: the loader records, for the epoch in progress, the state its sampler's random generator
had when the epoch started and how many steps it has handed out. `load_state_dict` makes the next
`iter()` replay that epoch's order and skip those steps (only indices are skipped; no sample is
loaded twice).

What gets split: a DataLoader over a map-style dataset, through its batch sampler (one whose sampler
is a DistributedSampler is already per process and is not split again). Data Ray has already split
per worker is never split again: `prepare()` returns Ray Data's `iter_torch_batches(...)` iterable
unchanged (it is not a DataLoader), and a DataLoader whose dataset is Ray's (what Ray's
`prepare_trainer` builds) is only wrapped, not sharded. A DataLoader over any other IterableDataset
is split in several processes by streaming.py (`stream`): the loader then iterates this process's
part, which knows the global batch, the real rows of the last one, and where each step starts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sized
from typing import Any, NamedTuple, cast

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..core.errors import HfBackendError
from ..core.nested import send_to_device
from ..runtime.collectives import broadcast_object_list
from ..training.gradient_state import GradientState
from .sources import PlainBatches, ShardedBatchSampler
from .streaming import check_stream_loader, is_datasets_stream, make_stream

# DataLoader arguments carried over from the user's loader to the prepared one.
_LOADER_ATTRS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                 "generator", "persistent_workers", "pin_memory_device", "in_order")


class Position(NamedTuple):
    """Where a prepared loader stands: pass `epoch`, `steps` handed out of it, and the source's `mark`
    of where the pass began (ShardedBatchSampler: its order; a stream: each process's place in it).
    `running`: the pass is being iterated (`following`: the epoch of the pass after it, when
    `set_epoch` named one meanwhile); `restored`: `load_state_dict` / `skip_first_batches` set it,
    and the next `iter()` continues it."""

    epoch: int = 0
    steps: int = 0
    mark: Any = None
    running: bool = False
    restored: bool = False
    following: int | None = None

    def after(self) -> Position:
        """The position once this pass is over: the start of the next."""
        return Position(self.following if self.following is not None else self.epoch + 1)


class PreparedDataLoader(DataLoader):
    """A DataLoader over this process's shard that puts batches on the device and can resume mid-epoch.

    Its `source` is what it iterates: a ShardedBatchSampler (map-style datasets), a split stream
    (streaming.py), or PlainBatches (an iterable not split here); each begins a pass at a step,
    marks where a pass began, and says the real rows of the last batch. Its `position` is one value
    (`Position`). `epoch` is the index of the pass the next `iter()` serves (or the one in
    progress); `end_of_dataloader` is True while the last batch of a pass is being processed.
    """

    def __init__(self, loader: DataLoader, source: Any, device: torch.device | None, gradient_state: GradientState,
                 non_blocking: bool = False) -> None:
        kwargs = {attr: getattr(loader, attr) for attr in _LOADER_ATTRS if hasattr(loader, attr)}
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        self.source = source
        if isinstance(source, ShardedBatchSampler):
            # the user's `sampler` yields index lists the dataset reads at once
            if loader.batch_sampler is None:
                super().__init__(loader.dataset, sampler=source, batch_size=None, **kwargs)
            else:
                super().__init__(loader.dataset, batch_sampler=source, **kwargs)
        elif isinstance(source, PlainBatches):
            super().__init__(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
        else:  # this process's part of a split stream
            super().__init__(source, batch_size=source.per_rank, **kwargs)
        self.base_dataloader = loader
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.end_of_dataloader = False
        self._peer: dict[str, Any] | None = None  # a live peer's position to catch up with (`catch_up`)
        self._parts_of_step: Callable[[], list[int] | None] | None = None  # `read_parts`
        self.handed_out = 0  # batches handed out since this loader was built (not restored by a state)
        self._next_split: tuple[int, int] | None = None  # `split` while a pass is under way: for the next
        self.remainder = -1
        self.position = Position()

    # -- sizes (Accelerate's names) ----------------------------------------------------------------
    @property
    def batch_size(self) -> int | None:
        """This process's batch size."""
        source = getattr(self, "source", None)  # DataLoader.__init__ asks before the source is set
        size = source.per_process_batch_size if source is not None else None
        return size if size is not None else self._batch_size

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:  # DataLoader.__init__ sets it
        self._batch_size = value

    @property
    def total_batch_size(self) -> int | None:
        """The global batch: one step's samples over all processes."""
        return self.source.global_batch_size

    @property
    def total_dataset_length(self) -> int:
        dataset = self.dataset
        return dataset.total_length if hasattr(dataset, "total_length") else len(cast(Sized, dataset))

    # -- position ----------------------------------------------------------------------------------
    def _now(self) -> Position:
        """The position as a checkpoint records it: a pass whose last step was handed out counts as
        over."""
        position = self.position
        return position.after() if position.running and self.source.ended(position.steps) else position

    @property
    def epoch(self) -> int:
        return self._now().epoch

    @property
    def resuming(self) -> bool:
        """Whether the next `iter()` continues a position that `load_state_dict` restored."""
        return self.position.restored

    def set_epoch(self, epoch: int) -> None:
        """Serve pass `epoch` on the next `iter()` (for scripts that call `set_epoch` themselves,
        between passes)."""
        now = self._now()
        if now.running:
            self.position = now._replace(following=epoch)
        elif not now.restored:
            self.position = Position(epoch)

    def state_dict(self) -> dict[str, Any]:
        if self._peer is not None:  # where the next read goes (catch_up)
            return dict(self._peer)
        now = self._now()
        return {"epoch": now.epoch, "steps": now.steps,
                "mark": now.mark if now.restored else self.source.mark(now.steps, now.running),
                "num_processes": self.source.num_processes, "global_batch_size": self.source.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps, source = int(state["steps"]), self.source
        if steps and state["num_processes"] != source.num_processes:
            if source.restores_its_own_position:
                raise HfBackendError(
                    f"the checkpoint stopped {steps} steps into a stream split across "
                    f"{state['num_processes']} processes; each process's position in its part does "
                    f"not map to {source.num_processes} processes: resume with "
                    f"{state['num_processes']} processes or from an epoch boundary")
            saved, now = state["global_batch_size"], source.global_batch_size
            if not saved or not now or (steps * saved) % now:
                raise HfBackendError(
                    f"the checkpoint stopped {steps} steps into an epoch with "
                    f"{state['num_processes']} processes (global batch {saved}); that point is not "
                    f"a whole step with {source.num_processes} processes (global batch {now}): "
                    f"resume with {state['num_processes']} processes or from an epoch boundary"
                )
            steps = steps * saved // now
        self.position = Position(int(state["epoch"]), steps, state.get("mark"), restored=True)

    def catch_up(self, state: dict[str, Any], ahead: int = 0) -> None:
        """Take a live peer's position, `ahead` batches further (fault_tolerance/groups.py: a replica group healed
        mid-pass): in the pass under way, the batches up to it are skipped; a peer in another pass ends this one,
        and the next starts where the peer is."""
        state = {**state, "steps": int(state["steps"]) + ahead}
        if self.position.running:
            self._peer = state
        else:
            self.load_state_dict(state)

    def _catch_up(self, it: Iterator[Any], current: Any) -> Any:
        state, self._peer = self._peer, None
        assert state is not None  # called only while a peer's position is pending (__iter__)
        if state["epoch"] != self.position.epoch or state["steps"] < self.position.steps:
            self.load_state_dict(state)
            return _PEER_ELSEWHERE
        while self.position.steps < state["steps"] and current is not _END:
            if self._parts_of_step is not None:
                self.source.step_parts.popleft()  # `current`'s, passed over
            current = next(it, _END)
            self.position = self.position._replace(steps=self.position.steps + 1)
        return current

    def skip_first_batches(self, num_batches: int) -> PreparedDataLoader:
        """Start the next pass at step `num_batches` (an absolute position: it replaces a position from
        load_state; a stream then reads its epoch again from the start)."""
        now = self._now()
        now = now.after() if now.running else now
        if now.restored:
            mark = now.mark if num_batches == now.steps or not self.source.restores_its_own_position else None
        else:
            mark = self.source.mark(0, False)
        self.position = Position(now.epoch, int(num_batches), mark, restored=True)
        return self

    # -- reading other processes' parts --------------------------------------------------------------
    @property
    def split_here(self) -> bool:
        """Whether the engine splits this loader's global batches (a map-style dataset)."""
        return isinstance(self.source, ShardedBatchSampler) and self.source.num_processes > 1

    @property
    def can_read_parts(self) -> bool:
        """Whether this loader can read another process's part of a step: split here, its batches handed out in
        order."""
        return self.split_here and getattr(self, "in_order", True)

    def split(self, num_processes: int, process_index: int) -> None:
        """Read part `process_index` of `num_processes` of each global batch, and only it, from now on (from the
        next pass when a pass is under way). fault_tolerance/groups.py: an evaluation loader split over its replica
        group's processes only, so that every group evaluates all of it."""
        self._parts_of_step, self._next_split = None, (num_processes, process_index)
        if not self.position.running:
            self._take_split()

    def _take_split(self) -> None:
        if self._next_split is not None:
            self.source.num_processes, self.source.process_index = self._next_split
            self.source.step_parts = self._next_split = None

    def read_parts(self, parts_of_step: Callable[[], list[int] | None]) -> None:
        """From now on, each step's batch is the parts of its global batch `parts_of_step()` names (indices of
        processes; None: this process's own), asked as the step's batch is handed out
        (fault_tolerance/every_step.py: the live replica groups train a missing group's part)."""
        self.source.step_parts = deque()
        self._parts_of_step = parts_of_step

    def _step_batch(self, batch: Any) -> Any:
        assert self._parts_of_step is not None  # called only once `read_parts` set it (__iter__)
        parts = self.source.step_parts.popleft()
        wanted = self._parts_of_step()
        if wanted is None:
            return batch
        indices = [i for p in wanted for i in parts[p]]
        if not self._auto_collation:  # the sampler's index lists go to the dataset whole
            return self.collate_fn(self.dataset[indices])
        getitems = getattr(self.dataset, "__getitems__", None)
        return self.collate_fn(getitems(indices) if getitems else [self.dataset[i] for i in indices])

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch types it as its own iterator class
        now = self._now()
        now = now.after() if now.running else now  # a pass left before its end: the next one
        epoch, skip = now.epoch, now.steps if now.restored else 0
        self.source.begin(epoch, skip, now.mark if now.restored else None)
        self.position = Position(epoch, skip, running=True)
        self.end_of_dataloader = False
        self.remainder = -1
        self.gradient_state.enter_dataloader(self)
        try:
            # Starting an iterator draws its workers' base seed from the global RNG. A pass resumed
            # mid-way made that draw before the checkpoint was taken, so it must not draw again from
            # the restored state.
            rng = torch.get_rng_state() if skip else None
            it = super().__iter__()
            if rng is not None:
                torch.set_rng_state(rng)
            it = self.source.resumed(it)
            current = next(it, _END)
            while current is not _END and current is not _PEER_ELSEWHERE:
                upcoming = next(it, _END)
                if upcoming is _END:
                    self.end_of_dataloader = True
                    self.remainder = self.source.remainder_of(current)
                if self._parts_of_step is not None:
                    current = self._step_batch(current)
                batch = current if self.device is None else send_to_device(current, self.device, self.non_blocking)
                self.position = self.position._replace(steps=self.position.steps + 1)
                self.handed_out += 1
                yield batch
                current = upcoming if self._peer is None else self._catch_up(it, upcoming)
            if current is not _PEER_ELSEWHERE:
                self.position = self.position.after()
        finally:
            self.gradient_state.exit_dataloader(self)
            self._take_split()


_END = object()
_PEER_ELSEWHERE = object()  # `_catch_up`: the pass ends, the next begins at the peer's position


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> PreparedDataLoader:
    """Accelerate's `skip_first_batches`: the next pass of a prepared loader starts at batch
    `num_batches`."""
    if not isinstance(dataloader, PreparedDataLoader):
        raise HfBackendError("skip_first_batches() needs a dataloader returned by "
                             "accelerator.prepare()")
    return dataloader.skip_first_batches(num_batches)


def prepare_dataloader(loader: DataLoader, *, num_processes: int, process_index: int, device: torch.device | None,
                       split_batches: bool, even_batches: bool, gradient_state: GradientState,
                       non_blocking: bool = False, data_seed: int | None = None) -> PreparedDataLoader:
    if isinstance(loader, PreparedDataLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        # One process reads a datasets stream through NodeStream too when it can, to resume from its
        # state_dict.
        own_state = is_datasets_stream(loader.dataset) and loader.num_workers == 0 and loader.batch_size
        if (num_processes > 1 or own_state) and not _split_by_ray(loader.dataset):
            check_stream_loader(loader, num_processes)
            stream = make_stream(loader, num_processes, process_index, split_batches)
            return PreparedDataLoader(loader, stream, device, gradient_state, non_blocking)
        plain = PlainBatches(loader.batch_size, count_short_batch=num_processes == 1)
        return PreparedDataLoader(loader, plain, device, gradient_state, non_blocking)
    batch_sampler = loader.batch_sampler
    if batch_sampler is None and isinstance(loader.sampler, torch.utils.data.BatchSampler):
        # batch_size=None with a BatchSampler as `sampler`: sharded the same way
        batch_sampler = loader.sampler
    if batch_sampler is None:
        raise HfBackendError("prepare() needs a DataLoader that batches: give it batch_size=..., a "
                             "batch_sampler, or a BatchSampler as its sampler (batch_size=None "
                             "alone gives it nothing to shard)")
    if isinstance(getattr(batch_sampler, "sampler", None), torch.utils.data.DistributedSampler):
        num_processes, process_index = 1, 0  # the user's sampler shards already: do not split twice
    sharded = ShardedBatchSampler(batch_sampler, num_processes, process_index, split_batches, even_batches)
    sharded.order_seed = _share_order_generator(batch_sampler, data_seed)
    return PreparedDataLoader(loader, sharded, device, gradient_state, non_blocking)


def _split_by_ray(dataset: IterableDataset) -> bool:
    """Whether `dataset` is Ray's wrapper of a Ray Data shard (what Ray's `prepare_trainer` puts in a
    DataLoader): Ray has already given each worker its own part, so it must not be split again."""
    return type(dataset).__module__.split(".")[0] == "ray"


def _share_order_generator(batch_sampler: Any, data_seed: int | None) -> int | None:
    """One epoch order on every rank. A random sampler without a generator gets one, and the seed its
    epochs derive from (returned); one with its own generator gets rank 0's state of it (None is
    returned)."""
    sampler = getattr(batch_sampler, "sampler", None)
    if sampler is None or not hasattr(sampler, "generator"):
        return None
    if sampler.generator is None:
        sampler.generator = torch.Generator()
        seed = data_seed if data_seed is not None else torch.initial_seed()
        return int(broadcast_object_list([seed])[0])
    sampler.generator.set_state(broadcast_object_list([sampler.generator.get_state()])[0])
    return None
