"""What each parallelism uses of the run's DeviceMesh (hf_backend/device_mesh.py builds it, once per
shape): tensor parallelism `mesh["tp"]`, context parallelism `mesh["cp"]`, FSDP the data-parallel
dimensions (with the cp ranks, which hold slices of the same sequences, flattened in); and which
part of each batch a process reads.
"""

from __future__ import annotations

from typing import NamedTuple

from torch.distributed.device_mesh import DeviceMesh

from ..config.parallelism import MeshShape


def fsdp_mesh(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh:
    """What `fully_shard` shards over: the data-parallel shards, across replicas too when there are
    some (HSDP: a 2-D mesh, reduce-scatter within a replica, all-reduce across); with context
    parallelism, the shards and the cp ranks flattened into one dimension (their gradients are parts
    of one batch's). Called once per mesh."""
    if shape.cp > 1:  # select_strategy refuses replicas with cp
        # (made with the mesh: this returns it)
        return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard"] if shape.dp_replicate > 1 else mesh["dp_shard"]


class DataShard(NamedTuple):
    """Which part of each global batch this process reads: `index` of `count` parts; `replicas`
    neighbouring processes (tensor / context parallel) read the same part, and the first of them
    (`first`) reports it;
    `sequence_slices`: how many slices context parallelism cuts each sequence into."""

    count: int
    index: int
    replicas: int = 1
    first: bool = True
    sequence_slices: int = 1


def data_shard(mesh: DeviceMesh, shape: MeshShape) -> DataShard:
    index = mesh.get_local_rank("dp_replicate") * shape.dp_shard + mesh.get_local_rank("dp_shard")
    within = mesh.get_local_rank("cp") * shape.tp + mesh.get_local_rank("tp")
    return DataShard(shape.data_parallel, index, shape.batch_replicas, within == 0, shape.cp)
