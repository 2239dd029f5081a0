"""Sharding and resuming of prepared dataloaders, checked rank by rank without starting processes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from hf_backend import HfBackendError
from hf_backend.config.options import GradientAccumulationPlugin
from hf_backend.data import PreparedDataLoader, prepare_dataloader
from hf_backend.data.sources import ShardedBatchSampler
from hf_backend.training.gradient_state import GradientState


def _shards(n: int, batch: int, world: int, split: bool = False, even: bool = True, drop_last: bool = False):
    base = BatchSampler(SequentialSampler(range(n)), batch, drop_last)
    return [list(ShardedBatchSampler(base, world, rank, split, even)) for rank in range(world)], base


def test_step_i_covers_the_same_samples_as_one_process_with_n_times_the_batch():
    per_rank, _ = _shards(40, 4, 2)
    one, _ = _shards(40, 8, 1)
    assert [a + b for a, b in zip(*per_rank)] == one[0]


def test_short_last_global_batch_is_padded_from_the_epoch_start():
    per_rank, sampler = _shards(21, 4, 2)  # 2 full steps of 8, then 5 real samples
    assert [len(r) for r in per_rank] == [3, 3]
    assert per_rank[0][-1] == [16, 17, 18, 19] and per_rank[1][-1] == [20, 0, 1, 2]
    assert sampler.batch_size == 4


def test_split_batches_slices_each_batch():
    per_rank, _ = _shards(16, 8, 2, split=True)
    assert per_rank[0][0] == [0, 1, 2, 3] and per_rank[1][0] == [4, 5, 6, 7]
    with pytest.raises(HfBackendError, match="divides by the 2 processes"):
        _shards(16, 5, 2, split=True)


def test_uneven_batches_do_not_pad():
    per_rank, _ = _shards(20, 4, 3, even=False)
    assert sorted(i for r in per_rank for b in r for i in b) == list(range(20))
    assert [len(r) for r in per_rank] == [2, 2, 1]


def test_drop_last_drops_the_short_global_batch():
    per_rank, _ = _shards(30, 4, 2, drop_last=True)  # 7 full batches of 4: 3 full global steps
    assert [len(r) for r in per_rank] == [3, 3]


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 60), batch=st.integers(1, 9), world=st.integers(1, 4), split=st.booleans(),
       even=st.booleans(), drop_last=st.booleans())
def test_every_sample_is_seen_once_and_lengths_are_right(n, batch, world, split, even, drop_last):
    if split:
        batch *= world
    per_rank, base = _shards(n, batch, world, split, even, drop_last)
    for rank, batches in enumerate(per_rank):
        assert len(batches) == len(ShardedBatchSampler(base, world, rank, split, even))
    if even:
        assert len({len(b) for b in per_rank}) == 1, "even_batches: every rank takes the same number of steps"
    # Interleave the ranks step by step, cut each step to its real samples: that is the one-process order.
    seen = []
    for step in range(max(len(b) for b in per_rank)):
        row = [i for b in per_rank if step < len(b) for i in b[step]]
        seen.extend(row)
    dataset_order = [i for b in base for i in b]
    expected_len = len(dataset_order)
    if not split and drop_last:
        expected_len = (len(base) // world) * world * batch
    assert seen[:expected_len] == dataset_order[:expected_len]
    assert set(seen) <= set(range(n))


def _loader(n: int = 40, batch: int = 4, world: int = 1, rank: int = 0, seed: int = 0) -> PreparedDataLoader:
    torch.manual_seed(seed)
    data = torch.arange(n)
    return prepare_dataloader(DataLoader(data, batch_size=batch, shuffle=True), num_processes=world,
                              process_index=rank, device=None, split_batches=False, even_batches=True,
                              gradient_state=GradientState(GradientAccumulationPlugin()))


def test_a_resumed_loader_continues_mid_epoch_with_the_same_order():
    reference = _loader()
    epochs = [[b.tolist() for b in reference] for _ in range(3)]
    live = _loader()
    list(live)  # epoch 0
    it = iter(live)
    seen = [next(it).tolist() for _ in range(3)]  # 3 steps into epoch 1
    state = live.state_dict()
    assert state["epoch"] == 1 and state["steps"] == 3

    resumed = _loader(seed=123)  # another seed: the order must come from the state, not the global RNG
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    rest = [b.tolist() for b in resumed]
    assert seen + rest == epochs[1]
    assert [b.tolist() for b in resumed] == epochs[2]


def test_state_at_an_epoch_boundary_starts_the_next_epoch():
    live = _loader()
    for _ in live:
        pass
    state = live.state_dict()
    assert (state["epoch"], state["steps"]) == (1, 0)
    resumed = _loader(seed=5)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in live]


def test_skip_first_batches_is_absolute_after_load_state():
    live = _loader()
    it = iter(live)
    first = [next(it).tolist() for _ in range(4)]
    state = live.state_dict()
    resumed = _loader()
    resumed.load_state_dict(state)
    # An Accelerate script skips by hand after load_state: that must not skip twice.
    skipped = resumed.skip_first_batches(4)
    assert skipped is resumed
    assert first + [b.tolist() for b in resumed] == [b.tolist() for b in _loader()]


def test_position_maps_to_another_world_size_only_at_whole_steps():
    two = _loader(world=2)
    it = iter(two)
    next(it)
    state = two.state_dict()  # 1 step of global batch 8
    one = _loader(batch=8)
    one.load_state_dict(state)
    assert one.epoch == 0
    one_big = _loader(batch=16)
    with pytest.raises(HfBackendError, match="not a whole step"):
        one_big.load_state_dict(state)


def test_end_of_dataloader_and_remainder_are_known_on_the_last_batch():
    loader = prepare_dataloader(DataLoader(torch.arange(10), batch_size=4), num_processes=1, process_index=0,
                                device=None, split_batches=False, even_batches=True,
                                gradient_state=GradientState(GradientAccumulationPlugin()))
    flags = [(loader.end_of_dataloader, loader.remainder) for _ in loader]
    # one process: nothing was padded, but the short last batch says it holds 2 real rows (callers that repeat a
    # per-batch value to the nominal batch size, as transformers' evaluation loop does, get it cut back to 2)
    assert flags == [(False, -1), (False, -1), (True, 2)]
    two = ShardedBatchSampler(BatchSampler(SequentialSampler(range(10)), 4, False), 2, 1)
    assert list(two)[-1] == [2, 3, 4, 5] and two.remainder == 2  # rank 1's last batch is all padding


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_told_to_read_other_parts_reads_them_in_the_step_it_is_told(workers):
    """fault_tolerance.py's live replica groups training a missing group's part: process 0 of 4 reads parts 0 and 2
    of steps 1 and 3 (asked as each step's batch is handed out; workers read ahead), its own part otherwise, and
    after catching up with a peer's position mid-pass it reads the parts of the steps it lands on."""

    def loader(rank: int) -> PreparedDataLoader:
        return prepare_dataloader(DataLoader(torch.arange(96) * 10, batch_size=3, shuffle=True, num_workers=workers),
                                  num_processes=4, process_index=rank, device=None, split_batches=False,
                                  even_batches=True, gradient_state=GradientState(GradientAccumulationPlugin()),
                                  data_seed=7)

    passes = [loader(rank) for rank in range(4)]
    reference = [[b.tolist() for b in rank] for rank in passes]
    following = [[b.tolist() for b in rank] for rank in passes]  # the next epoch
    live = loader(0)
    assert live.can_read_parts
    steps, later = [], []
    live.read_parts(lambda: later or ([0, 2] if len(steps) in (1, 3) else None))
    for batch in live:
        steps.append(batch.tolist())
    assert steps[1] == reference[0][1] + reference[2][1] and steps[3] == reference[0][3] + reference[2][3]
    assert [b for i, b in enumerate(steps) if i not in (1, 3)] == [b for i, b in enumerate(reference[0])
                                                                   if i not in (1, 3)]
    it = iter(live)
    next(it)
    peer = live.state_dict() | {"steps": 5}
    live.catch_up(peer)
    later.extend([1, 3])
    assert next(it).tolist() == following[1][5] + following[3][5]


def test_a_loader_split_again_reads_its_new_part_from_its_next_pass():
    """fault_tolerance.py's evaluation loader: prepared as part 3 of 4 (2 replica groups of 2 processes), split over
    its group's 2 processes only (part 1 of 2); asked mid-pass, from the next pass."""

    def loader(world: int, rank: int) -> PreparedDataLoader:
        return prepare_dataloader(DataLoader(torch.arange(21), batch_size=4), num_processes=world,
                                  process_index=rank, device=None, split_batches=False, even_batches=True,
                                  gradient_state=GradientState(GradientAccumulationPlugin()))

    across, within = [b.tolist() for b in loader(4, 3)], [b.tolist() for b in loader(2, 1)]
    evaluation = loader(4, 3)
    evaluation.read_parts(lambda: None)  # as replica groups prepare every loader: its own part until told otherwise
    it = iter(evaluation)
    first = next(it).tolist()
    evaluation.split(2, 1)
    assert [first, *(b.tolist() for b in it)] == across
    assert len(evaluation) == len(within) and [b.tolist() for b in evaluation] == within
    assert evaluation.total_batch_size == 8
    assert evaluation.source.step_parts is None  # split: it no longer records the other processes' parts


def test_distributed_sampler_is_not_sharded_twice():
    data = torch.arange(8)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    loader = prepare_dataloader(DataLoader(data, batch_size=2, sampler=sampler), num_processes=2, process_index=1,
                                device=None, split_batches=False, even_batches=True,
                                gradient_state=GradientState(GradientAccumulationPlugin()))
    assert [b.tolist() for b in loader] == [[1, 3], [5, 7]]


def test_random_sampler_gets_its_own_generator():
    loader = _loader()
    sampler = loader.batch_sampler.sampler
    assert isinstance(sampler, RandomSampler) and isinstance(sampler.generator, torch.Generator)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_an_iterable_dataset_works_and_resumes_in_one_process():
    def make():
        return prepare_dataloader(DataLoader(_Stream(), batch_size=3), num_processes=1, process_index=0, device=None,
                                  split_batches=False, even_batches=True,
                                  gradient_state=GradientState(GradientAccumulationPlugin()))

    live = make()
    it = iter(live)
    first = next(it).tolist()
    resumed = make()
    resumed.load_state_dict(live.state_dict())
    assert [first] + [b.tolist() for b in resumed] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def _stream_loader(rank: int, world: int = 2, batch: int = 3, split: bool = False, drop_last: bool = False,
                   workers: int = 0) -> PreparedDataLoader:
    return prepare_dataloader(DataLoader(_Stream(), batch_size=batch, drop_last=drop_last, num_workers=workers),
                              num_processes=world, process_index=rank, device=None, split_batches=split,
                              even_batches=True, gradient_state=GradientState(GradientAccumulationPlugin()))


def test_a_plain_stream_in_two_processes_gives_each_its_slice_of_every_global_batch():
    loaders = [_stream_loader(rank) for rank in range(2)]
    per_rank = []
    for loader in loaders:
        per_rank.append([(b.tolist(), loader.end_of_dataloader, loader.remainder) for b in loader])
    # global batches of 6 over 10 items: [0..5], then 4 real items completed by cycling the first global batch
    assert [b for b, _, _ in per_rank[0]] == [[0, 1, 2], [6, 7, 8]]
    assert [b for b, _, _ in per_rank[1]] == [[3, 4, 5], [9, 0, 1]]
    assert [(end, rest) for _, end, rest in per_rank[0]] == [(False, -1), (True, 4)]  # gather_for_metrics keeps 4
    assert loaders[0].total_batch_size == 6 and loaders[0].batch_size == 3
    split = [[b.tolist() for b in _stream_loader(rank, batch=4, split=True)] for rank in range(2)]
    assert split == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    assert [[b.tolist() for b in _stream_loader(rank, drop_last=True)] for rank in range(2)] == [[[0, 1, 2]],
                                                                                                 [[3, 4, 5]]]


def test_a_plain_stream_in_two_processes_resumes_mid_epoch():
    live = _stream_loader(1, batch=2)
    it = iter(live)
    first = [next(it).tolist() for _ in range(2)]
    state = live.state_dict()
    assert (state["epoch"], state["steps"], state["global_batch_size"]) == (0, 2, 4)
    resumed = _stream_loader(1, batch=2)
    resumed.load_state_dict(state)
    assert first + [b.tolist() for b in resumed] == [b.tolist() for b in _stream_loader(1, batch=2)]
    assert resumed.epoch == 1


def test_a_stream_in_two_processes_is_read_in_the_main_process():
    with pytest.raises(HfBackendError, match="set num_workers=0"):
        _stream_loader(0, workers=1)


def test_data_ray_already_split_per_worker_is_not_split_again():
    """Ray's wrapper of a Ray Data shard (what `prepare_trainer` builds) is recognized by its module: in 2 processes
    it is wrapped whole, where any other IterableDataset is split."""
    stream = type("RayTorchIterableDataset", (_Stream,), {"__module__": "ray.train.huggingface.transformers"})
    prepared = prepare_dataloader(DataLoader(stream(), batch_size=5), num_processes=2, process_index=1, device=None,
                                  split_batches=False, even_batches=True,
                                  gradient_state=GradientState(GradientAccumulationPlugin()))
    assert [b.tolist() for b in prepared] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
