"""CheckpointIO's choices that need no processes: who writes on a job of several nodes, and options it refuses."""

from __future__ import annotations

import pytest
import torch

from hf_backend import FullyShardedDataParallelPlugin, HfBackendError
from hf_backend.checkpoint import CheckpointIO
from hf_backend.config.loader import ConfigError
from hf_backend.options import Handlers
from hf_backend.precision import Precision
from hf_backend.prepared import PreparedObjects
from hf_backend.state import ProcessState
from hf_backend.strategies import SingleDeviceStrategy


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
