"""Prepared dataloaders: sharded across processes in the user's sampler order, placed on the device, resumable.

Sharding keeps the user's order: step i of N processes covers the same samples as step i of one process whose batch
is N times larger (with `split_batches`, the loader's batch is that global batch and each process takes a slice).
When the last global batch is short and `even_batches` is set, it is padded with samples from the start of the epoch
so every process takes the same number of equal batches; `gather_for_metrics` drops the padding again.

Order: a RandomSampler without a generator of its own gets one, and epoch e is shuffled with seed `data_seed + e`
(`data_seed` defaults to the process's torch seed, rank 0's): the order Accelerate's seedable sampler, and so
transformers' Trainer, gives. A sampler with its own generator keeps it, with rank 0's state on every rank.

Resuming: the loader records, for the epoch in progress, the state its sampler's random generator had when the epoch
started and how many steps it has handed out. `load_state_dict` makes the next `iter()` replay that epoch's order and
skip those steps (only indices are skipped; no sample is loaded twice).

What gets split: a DataLoader over a map-style dataset, through its batch sampler (one whose sampler is a
DistributedSampler is already per process and is not split again). Data Ray has already split per worker is never
split again: `prepare()` returns Ray Data's `iter_torch_batches(...)` iterable unchanged (it is not a DataLoader), and
a DataLoader whose dataset is Ray's (what Ray's `prepare_trainer` builds) is only wrapped, not sharded. A DataLoader
over any other IterableDataset is split in several processes by streaming.py (`stream`): the loader then iterates
this process's part, which knows the global batch, the real rows of the last one, and where each step starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from .collectives import broadcast_object_list
from .errors import HfBackendError
from .gradient_state import GradientState
from .nested import leaves, send_to_device
from .streaming import check_stream_loader, is_datasets_stream, make_stream

# DataLoader arguments carried over from the user's loader to the prepared one.
_LOADER_ATTRS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                 "generator", "persistent_workers", "pin_memory_device", "in_order")


def sampler_generator(batch_sampler: Any) -> torch.Generator | None:
    """The random generator that decides the order of an epoch, if the sampler has one."""
    sampler = getattr(batch_sampler, "sampler", None)
    gen = getattr(sampler, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


class ShardedBatchSampler:
    """Yields this process's part of each global batch built from `batch_sampler`."""

    def __init__(self, batch_sampler: Any, num_processes: int, process_index: int,
                 split_batches: bool = False, even_batches: bool = True) -> None:
        batch_size = getattr(batch_sampler, "batch_size", None)
        if split_batches and batch_size is not None and batch_size % num_processes:
            raise HfBackendError(
                f"split_batches=True needs a batch size that divides by the {num_processes} processes, "
                f"got {batch_size}; change the batch size or use split_batches=False"
            )
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = batch_size
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.skip = 0  # steps to skip at the start of the next iteration (set by the loader on resume)
        self.remainder = 0  # real rows in the global batch last yielded, 0 when it was full

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def global_batch_size(self) -> int | None:
        if self.batch_size is None:
            return None
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    def __len__(self) -> int:
        n, world, rank = len(self.batch_sampler), self.num_processes, self.process_index
        if self.split_batches:
            if self.even_batches or self.batch_size is None or n == 0:
                return n
            last = self._last_batch_len()
            return n - 1 + (1 if last > rank * (self.batch_size // world) else 0)
        full_groups, rest = divmod(n, world)
        if self.drop_last or rest == 0:
            return full_groups
        return full_groups + (1 if self.even_batches or rank < rest else 0)

    def _last_batch_len(self) -> int:
        dataset_len = len(self.sampler) if self.sampler is not None else 0
        return dataset_len - (len(self.batch_sampler) - 1) * self.batch_size if self.batch_size else 0

    def __iter__(self) -> Iterator[list]:
        skip, self.skip = self.skip, 0
        if self.num_processes == 1:
            steps = self._single_steps()
        else:
            steps = self._split_steps() if self.split_batches else self._grouped_steps()
        for step, (batch, remainder) in enumerate(steps):
            if step < skip:
                continue
            self.remainder = remainder
            yield batch

    def _padded(self, real: list, size: int, first: list) -> list:
        """`real` followed by samples from the start of the epoch (cycled) up to `size` items."""
        pad = list(first) or list(real)
        out = list(real)
        while len(out) < size:
            out.extend(pad[: size - len(out)])
        return out

    def _single_steps(self) -> Iterator[tuple[list, int]]:
        """One process: the user's batches as they are; a short last batch still reports its real rows, for callers
        that pad or repeat per-batch values to the nominal batch size (transformers' evaluation loop does)."""
        for batch in self.batch_sampler:
            short = self.batch_size is not None and len(batch) < self.batch_size
            yield batch, len(batch) if short else 0

    def _split_steps(self) -> Iterator[tuple[list, int]]:
        world, rank = self.num_processes, self.process_index
        first: list = []
        for batch in self.batch_sampler:
            batch = list(batch)
            size = self.batch_size or len(batch)
            if not first:
                first = batch
            remainder = len(batch) if len(batch) < size else 0
            if remainder and self.even_batches:
                batch = self._padded(batch, size, first)
            per_rank = size // world
            mine = batch[rank * per_rank:(rank + 1) * per_rank]
            if mine:
                yield mine, remainder

    def _grouped_steps(self) -> Iterator[tuple[list, int]]:
        world, rank = self.num_processes, self.process_index
        group: list[list] = []
        first: list = []
        for batch in self.batch_sampler:
            group.append(list(batch))
            if len(group) < world:
                continue
            if not first:
                first = [i for b in group for i in b]
            full = self.batch_size is None or all(len(b) == self.batch_size for b in group)
            if full or not self.even_batches:
                yield group[rank], 0 if full else sum(len(b) for b in group)
            else:
                yield self._even_part(group, first)
            group = []
        if group and not self.drop_last:
            if not first:
                first = [i for b in group for i in b]
            if self.even_batches:
                yield self._even_part(group, first)
            elif rank < len(group):
                yield group[rank], sum(len(b) for b in group)

    def _even_part(self, group: list[list], first: list) -> tuple[list, int]:
        """This rank's equal share of a short last global batch, padded from the start of the epoch."""
        per_rank = self.batch_size or max(len(b) for b in group)
        real = [i for b in group for i in b]
        padded = self._padded(real, per_rank * self.num_processes, first)
        start = self.process_index * per_rank
        return padded[start:start + per_rank], len(real)


class PreparedDataLoader(DataLoader):
    """A DataLoader over this process's shard that puts batches on the device and can resume mid-epoch.

    `epoch` is the index of the pass the next `iter()` serves (or the one in progress); `end_of_dataloader` is True
    while the last batch of a pass is being processed.
    """

    def __init__(self, loader: DataLoader, batch_sampler: ShardedBatchSampler | None, device: torch.device | None,
                 gradient_state: GradientState, non_blocking: bool = False, order_seed: int | None = None,
                 count_short_batch: bool = False, stream: Any = None) -> None:
        kwargs = {attr: getattr(loader, attr) for attr in _LOADER_ATTRS if hasattr(loader, attr)}
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        self.index_sampler = batch_sampler  # the sharded sampler of index batches (None for an iterable dataset)
        self.stream = stream  # this process's part of a stream split across processes (streaming.py), or None
        if stream is not None:
            super().__init__(stream, batch_size=stream.per_rank, **kwargs)
        elif self._iterable:
            super().__init__(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
        elif loader.batch_sampler is None:  # the user's `sampler` yields index lists the dataset reads at once
            super().__init__(loader.dataset, sampler=batch_sampler, batch_size=None, **kwargs)
        else:
            super().__init__(loader.dataset, batch_sampler=batch_sampler, **kwargs)
        self.base_dataloader = loader
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.order_seed = order_seed  # epoch e is shuffled with seed order_seed + e (None: the generator's own stream)
        self.count_short_batch = count_short_batch  # an iterable loader in one process: its own batches are global
        self.end_of_dataloader = False
        self.remainder = -1
        self._next_epoch = 0
        self._current_epoch: int | None = None  # the pass in progress
        self._steps = 0  # steps handed out in the pass in progress
        self._epoch_rng: torch.Tensor | None = None
        self._resume: tuple[int, int, torch.Tensor | None] | None = None
        self._resume_position: Any = None  # where a stream resumes (streaming.py), with `_resume`

    @property
    def _iterable(self) -> bool:
        return self.index_sampler is None

    # -- sizes (Accelerate's names) ----------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int | None:  # type: ignore[override]
        """This process's batch size."""
        sampler = self.index_sampler
        if sampler is None or sampler.batch_size is None:
            return self._batch_size
        return sampler.batch_size // sampler.num_processes if sampler.split_batches else sampler.batch_size

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:  # DataLoader.__init__ sets it
        self._batch_size = value

    @property
    def total_batch_size(self) -> int | None:
        """The global batch: one step's samples over all processes."""
        sampler = self.index_sampler or self.stream
        return sampler.global_batch_size if sampler is not None else self._batch_size

    @property
    def total_dataset_length(self) -> int:
        dataset = self.dataset
        return dataset.total_length if hasattr(dataset, "total_length") else len(dataset)

    # -- position --------------------------------------------------------------------------------------------------
    @property
    def generator_of_order(self) -> torch.Generator | None:
        return None if self._iterable else sampler_generator(self.index_sampler.batch_sampler)

    @property
    def epoch(self) -> int:
        if self._resume is not None:
            return self._resume[0]
        return self._current_epoch if self._in_progress() else self._next_epoch

    def _in_progress(self) -> bool:
        return self._current_epoch is not None and (self._iterable or self._steps < len(self))

    @property
    def resuming(self) -> bool:
        """Whether the next `iter()` continues a position that `load_state_dict` restored."""
        return self._resume is not None

    def set_epoch(self, epoch: int) -> None:
        """Serve pass `epoch` on the next `iter()` (for scripts that call `set_epoch` themselves)."""
        if self._resume is None:
            self._next_epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        gen = self.generator_of_order
        position = None
        if self._resume is not None:
            epoch, steps, rng = self._resume
            position = self._resume_position
        elif self._in_progress():
            epoch, steps, rng = self._current_epoch, self._steps, self._epoch_rng
            position = self.stream.position(steps) if self.stream is not None else None
        else:
            epoch, steps, rng = self._next_epoch, 0, gen.get_state() if gen is not None else None
        sampler = self.index_sampler or self.stream
        state = {
            "epoch": epoch,
            "steps": steps,
            "rng_state": rng,
            "order_seed": self.order_seed,
            "num_processes": sampler.num_processes if sampler else 1,
            "global_batch_size": sampler.global_batch_size if sampler else None,
        }
        if position is not None:
            state["stream_position"] = position  # every process's dataset state (datasets' state_dict)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = int(state["steps"])
        sampler = self.index_sampler or self.stream
        position = state.get("stream_position")
        if position is not None and steps and state["num_processes"] != sampler.num_processes:
            raise HfBackendError(
                f"the checkpoint stopped {steps} steps into a stream split across {state['num_processes']} processes; "
                f"each process's position in its part does not map to {sampler.num_processes} processes: resume "
                f"with {state['num_processes']} processes or from an epoch boundary")
        if sampler is not None and steps and state["num_processes"] != sampler.num_processes:
            saved, now = state["global_batch_size"], sampler.global_batch_size
            if not saved or not now or (steps * saved) % now:
                raise HfBackendError(
                    f"the checkpoint stopped {steps} steps into an epoch with {state['num_processes']} processes "
                    f"(global batch {saved}); that point is not a whole step with {sampler.num_processes} processes "
                    f"(global batch {now}): resume with {state['num_processes']} processes or from an epoch boundary"
                )
            steps = steps * saved // now
        self._resume = (int(state["epoch"]), steps, state.get("rng_state"))
        self._resume_position = position
        self.order_seed = state.get("order_seed", self.order_seed)
        self._current_epoch = None

    def skip_first_batches(self, num_batches: int) -> PreparedDataLoader:
        """Start the next pass at step `num_batches` (an absolute position: it replaces a position from load_state)."""
        if self._resume is not None:
            epoch, steps, rng = self._resume
            if steps != num_batches:
                self._resume_position = None  # the stream is read again from the start of the epoch
        else:
            gen = self.generator_of_order
            epoch, rng = self._next_epoch, gen.get_state() if gen is not None else None
        self._resume = (epoch, int(num_batches), rng)
        return self

    # -- iteration -------------------------------------------------------------------------------------------------
    def _start_pass(self) -> int:
        gen = self.generator_of_order
        position = self._resume_position
        if self._resume is not None:
            (epoch, skip, rng), self._resume, self._resume_position = self._resume, None, None
        else:
            epoch, skip, rng = self._next_epoch, 0, None
        if gen is not None and self.order_seed is not None:
            gen.manual_seed((self.order_seed + epoch) % 2**64)  # the order follows from the seed and the epoch alone
        elif gen is not None and rng is not None:
            gen.set_state(rng)
        self._epoch_rng = gen.get_state() if gen is not None else None
        self._current_epoch, self._next_epoch, self._steps = epoch, epoch + 1, skip
        if self.stream is not None:
            self.stream.begin(epoch, skip, position)  # the stream starts at that step itself
        if not self._iterable:
            self.index_sampler.skip = skip
            for obj in (self.index_sampler.batch_sampler, self.index_sampler.sampler):
                if hasattr(obj, "set_epoch"):
                    obj.set_epoch(epoch)
        return skip

    def __iter__(self) -> Iterator[Any]:
        skip = self._start_pass()
        self.end_of_dataloader = False
        self.remainder = -1
        self.gradient_state.enter_dataloader(self)
        try:
            # Starting an iterator draws its workers' base seed from the global RNG. A pass resumed mid-way made that
            # draw before the checkpoint was taken, so it must not draw again from the restored state.
            rng = torch.get_rng_state() if skip else None
            it = super().__iter__()
            if rng is not None:
                torch.set_rng_state(rng)
            if self._iterable and self.stream is None:
                for _ in range(skip):
                    if next(it, None) is None:
                        break
            current = next(it, _END)
            while current is not _END:
                upcoming = next(it, _END)
                if upcoming is _END:
                    self.end_of_dataloader = True
                    self.remainder = self._remainder_of_last(current)
                batch = current if self.device is None else send_to_device(current, self.device, self.non_blocking)
                self._steps += 1
                yield batch
                current = upcoming
            self._current_epoch = None
        finally:
            self.gradient_state.exit_dataloader(self)

    def _remainder_of_last(self, batch: Any) -> int:
        """Real rows of the last global batch when it is short (what `gather_for_metrics` keeps), else 0 or -1.

        A sharded loader's sampler knows it. An iterable one in one process counts the rows of its last batch
        (no `__len__` needed: streaming datasets too); in several processes (Ray's shards) nothing is cut."""
        if not self._iterable:
            return self.index_sampler.remainder
        if self.stream is not None:
            return self.stream.remainder
        if not self.count_short_batch or not self._batch_size:
            return -1
        rows = next((t.shape[0] for t in leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        return rows if rows is not None and rows < self._batch_size else -1


_END = object()


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> PreparedDataLoader:
    """Accelerate's `skip_first_batches`: the next pass of a prepared loader starts at batch `num_batches`."""
    if not isinstance(dataloader, PreparedDataLoader):
        raise HfBackendError("skip_first_batches() needs a dataloader returned by accelerator.prepare()")
    return dataloader.skip_first_batches(num_batches)


def prepare_dataloader(loader: DataLoader, *, num_processes: int, process_index: int, device: torch.device | None,
                       split_batches: bool, even_batches: bool, gradient_state: GradientState,
                       non_blocking: bool = False, data_seed: int | None = None) -> PreparedDataLoader:
    if isinstance(loader, PreparedDataLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        # One process reads a datasets stream through NodeStream too when it can, to resume from its state_dict.
        own_state = is_datasets_stream(loader.dataset) and loader.num_workers == 0 and loader.batch_size
        if (num_processes > 1 or own_state) and not _split_by_ray(loader.dataset):
            check_stream_loader(loader, num_processes)
            stream = make_stream(loader, num_processes, process_index, split_batches)
            return PreparedDataLoader(loader, None, device, gradient_state, non_blocking, stream=stream)
        return PreparedDataLoader(loader, None, device, gradient_state, non_blocking,
                                  count_short_batch=num_processes == 1)
    batch_sampler = loader.batch_sampler
    if batch_sampler is None and isinstance(loader.sampler, torch.utils.data.BatchSampler):
        batch_sampler = loader.sampler  # batch_size=None with a BatchSampler as `sampler`: sharded the same way
    if batch_sampler is None:
        raise HfBackendError("prepare() needs a DataLoader that batches: give it batch_size=..., a batch_sampler, or "
                             "a BatchSampler as its sampler (batch_size=None alone gives it nothing to shard)")
    if isinstance(getattr(batch_sampler, "sampler", None), torch.utils.data.DistributedSampler):
        num_processes, process_index = 1, 0  # the user's sampler shards already: do not split twice
    order_seed = _share_order_generator(batch_sampler, data_seed)
    sharded = ShardedBatchSampler(batch_sampler, num_processes, process_index, split_batches, even_batches)
    return PreparedDataLoader(loader, sharded, device, gradient_state, non_blocking, order_seed)


def _split_by_ray(dataset: IterableDataset) -> bool:
    """Whether `dataset` is Ray's wrapper of a Ray Data shard (what Ray's `prepare_trainer` puts in a DataLoader):
    Ray has already given each worker its own part, so it must not be split again."""
    return type(dataset).__module__.split(".")[0] == "ray"


def _share_order_generator(batch_sampler: Any, data_seed: int | None) -> int | None:
    """One epoch order on every rank. A random sampler without a generator gets one, and the seed its epochs derive
    from (returned); one with its own generator gets rank 0's state of it (None is returned)."""
    sampler = getattr(batch_sampler, "sampler", None)
    if sampler is None or not hasattr(sampler, "generator"):
        return None
    if sampler.generator is None:
        sampler.generator = torch.Generator()
        seed = data_seed if data_seed is not None else torch.initial_seed()
        return int(broadcast_object_list([seed])[0])
    sampler.generator.set_state(broadcast_object_list([sampler.generator.get_state()])[0])
    return None
