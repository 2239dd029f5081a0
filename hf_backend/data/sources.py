"""The batches of a map-style DataLoader split across processes, in the user's sampler order
(`ShardedBatchSampler`), or one process's batches as they come (`PlainBatches`): the two sources a
PreparedDataLoader (data.py) iterates besides a stream (streaming.py).

Step i of N processes covers the same samples as step i of one process whose batch is N times larger
(with `split_batches`, the loader's batch is that global batch and each process takes a slice). When
the last global batch is short and `even_batches` is set, it is padded with samples from the start of
the epoch so every process takes the same number of equal batches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from ..core.errors import HfBackendError
from ..core.nested import leaves


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
                f"split_batches=True needs a batch size that divides by the {num_processes} "
                f"processes, got {batch_size}; change the batch size or use split_batches=False"
            )
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = batch_size
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.skip = 0  # steps to skip at the start of the next iteration (`begin`)
        self.remainder = 0  # real rows in the global batch last yielded, 0 when it was full
        # epoch e is shuffled with seed order_seed + e (None: the generator's own)
        self.order_seed: int | None = None
        # the order generator's state when the pass in progress began
        self._epoch_rng: torch.Tensor | None = None
        # every process's part of each step handed out and not yet trained, when a PreparedDataLoader reads parts
        # other than its own (`PreparedDataLoader.read_parts`)
        self.step_parts: deque[list[list]] | None = None

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    # -- the loader's source interface (PreparedDataLoader) ----------------------------------------
    restores_its_own_position = False

    @property
    def per_process_batch_size(self) -> int | None:
        if self.batch_size is None:
            return None
        return self.batch_size // self.num_processes if self.split_batches else self.batch_size

    def begin(self, epoch: int, skip: int, mark: dict[str, Any] | None) -> None:
        """The next pass is epoch `epoch` from step `skip`; `mark` (from `mark`) restores the order of
        a pass that began in another run: its generator state, and the seed epochs derive from."""
        gen = sampler_generator(self.batch_sampler)
        if mark is not None:
            self.order_seed = mark.get("order_seed", self.order_seed)
        if gen is not None and self.order_seed is not None:
            # the order follows from the seed and the epoch alone
            gen.manual_seed((self.order_seed + epoch) % 2**64)
        elif gen is not None and mark is not None and mark.get("rng_state") is not None:
            gen.set_state(mark["rng_state"])
        self._epoch_rng = gen.get_state() if gen is not None else None
        self.skip = skip
        if self.step_parts is not None:
            self.step_parts.clear()
        for obj in (self.batch_sampler, self.sampler):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)

    def mark(self, steps: int, started: bool) -> dict[str, Any]:
        """What `begin` needs to replay a pass: the order generator's state when it began (or, for a
        pass not begun, now) and the order seed."""
        gen = sampler_generator(self.batch_sampler)
        rng = self._epoch_rng if started else gen.get_state() if gen is not None else None
        return {"rng_state": rng, "order_seed": self.order_seed}

    def ended(self, steps: int) -> bool:
        return steps >= len(self)

    def resumed(self, batches: Iterator[Any]) -> Iterator[Any]:
        # the skipped steps' indices are passed over in __iter__, no sample is loaded
        return batches

    def remainder_of(self, batch: Any) -> int:
        return self.remainder

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
        for step, (batch, remainder, parts) in enumerate(steps):
            if step < skip:
                continue
            self.remainder = remainder
            if self.step_parts is not None:
                self.step_parts.append(parts)
            yield batch

    def _padded(self, real: list, size: int, first: list) -> list:
        """`real` followed by samples from the start of the epoch (cycled) up to `size` items."""
        pad = list(first) or list(real)
        out = list(real)
        while len(out) < size:
            out.extend(pad[: size - len(out)])
        return out

    def _single_steps(self) -> Iterator[tuple[list, int, list[list]]]:
        """One process: the user's batches as they are; a short last batch still reports its real rows,
        for callers that pad or repeat per-batch values to the nominal batch size (transformers'
        evaluation loop does)."""
        for batch in self.batch_sampler:
            short = self.batch_size is not None and len(batch) < self.batch_size
            yield batch, len(batch) if short else 0, [batch]

    def _split_steps(self) -> Iterator[tuple[list, int, list[list]]]:
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
            parts = [batch[r * per_rank:(r + 1) * per_rank] for r in range(world)]
            if parts[rank]:
                yield parts[rank], remainder, parts

    def _grouped_steps(self) -> Iterator[tuple[list, int, list[list]]]:
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
                yield group[rank], 0 if full else sum(len(b) for b in group), group
            else:
                yield self._even_part(group, first)
            group = []
        if group and not self.drop_last:
            if not first:
                first = [i for b in group for i in b]
            if self.even_batches:
                yield self._even_part(group, first)
            elif rank < len(group):
                yield group[rank], sum(len(b) for b in group), group

    def _even_part(self, group: list[list], first: list) -> tuple[list, int, list[list]]:
        """This rank's equal share of a short last global batch, padded from the start of the epoch.
        """
        per_rank = self.batch_size or max(len(b) for b in group)
        real = [i for b in group for i in b]
        padded = self._padded(real, per_rank * self.num_processes, first)
        parts = [padded[r * per_rank:(r + 1) * per_rank] for r in range(self.num_processes)]
        return parts[self.process_index], len(real), parts


class PlainBatches:
    """The source of an iterable loader that is not split here (one process, or Ray's shards, one per
    worker already): a resumed pass reads past its first steps; where this process's batches are the
    global ones (`count_short_batch`), a short last batch reports its rows."""

    restores_its_own_position = False
    num_processes = 1

    def __init__(self, batch_size: int | None, count_short_batch: bool) -> None:
        self.per_process_batch_size = self.global_batch_size = batch_size
        self.count_short_batch = count_short_batch
        self._skip = 0

    def begin(self, epoch: int, skip: int, mark: Any) -> None:
        self._skip = skip

    def mark(self, steps: int, started: bool) -> None:
        return None

    def ended(self, steps: int) -> bool:
        return False

    def resumed(self, batches: Iterator[Any]) -> Iterator[Any]:
        for _ in range(self._skip):
            if next(batches, None) is None:
                break
        return batches

    def remainder_of(self, batch: Any) -> int:
        """The rows of a short last batch (no `__len__` needed: streaming datasets too); -1 when
        nothing is cut."""
        size = self.global_batch_size
        if not self.count_short_batch or not size:
            return -1
        rows = next((t.shape[0] for t in leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        return rows if rows is not None and rows < size else -1
