"""CheckpointIO's choices that need no processes: who writes on a job of several nodes, and options it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_backend import FullyShardedDataParallelPlugin, HfBackendError
from hf_backend.checkpoint import CheckpointIO
from hf_backend.config.options import Handlers
from hf_backend.core.errors import ConfigError
from hf_backend.state import ProcessState
from hf_backend.strategies import SingleDeviceStrategy
from hf_backend.training.precision import Precision
from hf_backend.training.prepared import PreparedObjects


class Position:
    def state_dict(self) -> dict:
        return {"step": 3}


def second_node_io(objects: PreparedObjects) -> CheckpointIO:
    """Global rank 1, the only (so the local main) process of the second of two one-process nodes."""
    process = ProcessState(device=torch.device("cpu"), num_processes=2, process_index=1, local_process_index=0,
                           local_num_processes=1, backend="gloo")
    precision = Precision("no", process.device, None, None)
    return CheckpointIO(process, SingleDeviceStrategy(process, precision, Handlers()), precision, objects, dict)


def test_save_on_each_node_writes_the_main_process_files_on_every_node(tmp_path):
    objects = PreparedObjects(dataloaders=[Position()])
    io = second_node_io(objects)
    (tmp_path / "node").mkdir()
    io.write(tmp_path / "node", rng=False, on_each_node=True)
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == ["dataloader.bin", "hf_backend_checkpoint.json"]
    (tmp_path / "shared").mkdir()
    io.write(tmp_path / "shared", rng=False)  # a shared filesystem: global rank 0 writes them
    assert list((tmp_path / "shared").iterdir()) == []


def test_save_on_each_node_is_refused_where_states_are_gathered_to_rank_0(tmp_path):
    io = second_node_io(PreparedObjects(models=[torch.nn.Linear(2, 2)]))
    fix = ("checkpoints need a filesystem every node shares; put the output directory there and set "
           "save_on_each_node=False")
    with pytest.raises(HfBackendError, match=rf"^save_state across 2 nodes: {fix}$"):
        io.save(tmp_path / "ckpt", on_each_node=True)
    with pytest.raises(HfBackendError, match=rf"^save_on_each_node with models or optimizers across 2 nodes: {fix}$"):
        io.write(tmp_path, on_each_node=True)
    assert list(tmp_path.iterdir()) == []


def test_local_state_dict_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"^FullyShardedDataParallelPlugin.state_dict_type='LOCAL_STATE_DICT' is not "
                                          r"one of FULL_STATE_DICT, SHARDED_STATE_DICT$"):
        FullyShardedDataParallelPlugin(state_dict_type="LOCAL_STATE_DICT").resolved()


@pytest.mark.parametrize("direction", ["to_one_group", "to_two_groups"])
def test_param_groups_fit_where_deepspeed_dropped_an_empty_one(tmp_path, direction):
    """The Trainer's no-decay group is empty for a LoRA model: torch keeps it, DeepSpeed drops it. A state saved with
    one layout loads into the other (optimizer moments, hyperparameters and the scheduler's per-group entries), and
    the saved layout is written again by what loads it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    process = ProcessState(device=torch.device("cpu"), num_processes=1, process_index=0, local_process_index=0,
                           local_num_processes=1, backend="gloo")
    precision = Precision("no", process.device, None, None)

    def built(groups: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        param_groups = [{"params": list(model.parameters()), "weight_decay": 0.1}]
        param_groups += [{"params": [], "weight_decay": 0.0}] * (groups - 1)
        optimizer = torch.optim.AdamW(param_groups, lr=0.1)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))

    saved_groups, loaded_groups = (2, 1) if direction == "to_one_group" else (1, 2)
    model, optimizer, scheduler = built(saved_groups)
    for _ in range(3):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    objects = PreparedObjects(models=[model], optimizers=[optimizer], schedulers=[scheduler])
    io = CheckpointIO(process, SingleDeviceStrategy(process, precision, Handlers()), precision, objects, dict)
    io.save(tmp_path / "ckpt")
    expected = get_optimizer_state_dict(model, optimizer)["state"]

    model, optimizer, scheduler = built(loaded_groups)
    objects = PreparedObjects(models=[model], optimizers=[optimizer], schedulers=[scheduler])
    io = CheckpointIO(process, SingleDeviceStrategy(process, precision, Handlers()), precision, objects, dict)
    io.read(tmp_path / "ckpt")
    loaded = get_optimizer_state_dict(model, optimizer)["state"]
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[n][k], expected[n][k]) for n in expected for k in ("exp_avg", "exp_avg_sq", "step"))
    assert len(optimizer.param_groups) == loaded_groups and optimizer.param_groups[0]["weight_decay"] == 0.1
    assert scheduler.last_epoch == 3 and scheduler.get_last_lr()[0] == pytest.approx(0.1 / 4)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 5)


def test_param_groups_that_do_not_correspond_are_one_line(tmp_path):
    from hf_backend.checkpoint.param_groups import group_map

    assert group_map([4, 0], [4, 0], tmp_path) is None and group_map([4, 0], [1], tmp_path) == [0]
    assert group_map([4], [4, 0], tmp_path) == [0, None]
    with pytest.raises(HfBackendError, match=r"param groups of \[2, 2\] parameters, this one \[4\]; resume with the"):
        group_map([2, 2], [4], tmp_path)


def _trained(accelerator, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.randn(4, 8)).square().mean())
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _state(optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.optimizer.state.values() for t in s.values()]


def test_optimizer_state_is_copied_from_the_mapped_file_into_the_live_tensors(tmp_path):
    """optimizer.bin is read mapped (no fresh copy of it in memory) and copied into the tensors the optimizer holds;
    an optimizer without state yet gets its own memory: no state stays backed by the file."""
    from hf_backend import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = _trained(accelerator, 0)
    saved = [t.clone() for t in _state(optimizer)]
    accelerator.save_state(tmp_path / "ckpt")
    accelerator.backward(model(torch.randn(4, 8)).square().mean())
    optimizer.step()  # the live state moves on
    live = _state(optimizer)
    accelerator.load_state(tmp_path / "ckpt")
    after = _state(optimizer)
    assert all(a is b for a, b in zip(after, live)), "the optimizer keeps its own tensors"
    assert all(torch.equal(a, b) for a, b in zip(after, saved))

    fresh = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    net, opt = fresh.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    fresh.load_state(tmp_path / "ckpt")
    loaded = _state(opt)
    assert len(loaded) == len(saved) and all(torch.equal(a, b) for a, b in zip(loaded, saved))
    mapped = _mapped_ranges(tmp_path / "ckpt" / "optimizer.bin")
    assert not any(lo <= t.data_ptr() < hi for t in loaded for lo, hi in mapped), "optimizer state maps the file"


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """The address ranges this process maps `path` at (Linux's /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(path)):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges
