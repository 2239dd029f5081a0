"""What each parallelism uses of the run's DeviceMesh (hf_backend/device_mesh.py builds it, once per
shape): tensor parallelism `mesh["tp"]`, the sequence split `mesh["cp"]` or `mesh["sp"]`, FSDP the
data-parallel dimensions (with the cp or sp ranks, which hold slices of the same sequences,
flattened in), expert parallelism the innermost of those flattened ranks; and which part of each
batch a process reads.
"""

from __future__ import annotations

from typing import NamedTuple

from torch.distributed.device_mesh import DeviceMesh

from ..config.parallelism import MeshShape
from ..device_mesh import FLATTENED
from .experts import ExpertMeshes


def fsdp_mesh(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh:
    """What `fully_shard` shards over: the data-parallel shards, across replicas too when there are
    some (HSDP: a 2-D mesh, reduce-scatter within a replica, all-reduce across); with the sequences
    split, the shards and the cp or sp ranks as one dimension (`dp_shard_cp`, made with the mesh:
    their gradients are parts of one batch's)."""
    if shape.sequence_slices == 1:
        return mesh["dp_replicate", "dp_shard"] if shape.dp_replicate > 1 else mesh["dp_shard"]
    return _with_replicas(mesh, shape, _shards(mesh))


def expert_meshes(mesh: DeviceMesh, shape: MeshShape) -> ExpertMeshes:
    """Expert parallelism's two meshes, cut from the run's (so that FSDP composes with the experts'
    split, as with tensor parallelism's): the `dp_shard_cp` ranks as (efsdp, ep), ep innermost
    (neighbouring ranks trade tokens), and what FSDP shards the experts over: efsdp, with the replicas
    under HSDP. Collective: every rank calls it, once per strategy."""
    split = _shards(mesh)._unflatten(0, (shape.expert_shards, shape.ep), ("efsdp", "ep"))
    return ExpertMeshes(split["ep"], _with_replicas(mesh, shape, split["efsdp"]))


def _shards(mesh: DeviceMesh) -> DeviceMesh:
    """`dp_shard_cp`: the data-parallel shards with the cp or sp ranks, the one made with the mesh."""
    return mesh[FLATTENED["dp_shard_cp"]]._flatten("dp_shard_cp")


def _with_replicas(mesh: DeviceMesh, shape: MeshShape, shards: DeviceMesh) -> DeviceMesh:
    # (a flattened dimension sliced together with the root's is deprecated: joined instead)
    return DeviceMesh._concatenate([mesh["dp_replicate"], shards]) if shape.dp_replicate > 1 else shards


def sequence_mesh(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh:
    """The ranks that split each sequence: `cp` or `sp` (size 1 when neither does)."""
    return mesh["sp"] if shape.sp > 1 else mesh["cp"]


class DataShard(NamedTuple):
    """Which part of each global batch this process reads: `index` of `count` parts; `replicas`
    neighbouring processes (tensor / context parallel) read the same part, and the first of them
    (`first`) reports it;
    `sequence_slices`: how many slices context or sequence parallelism cuts each sequence into."""

    count: int
    index: int
    replicas: int = 1
    first: bool = True
    sequence_slices: int = 1


def data_shard(mesh: DeviceMesh, shape: MeshShape) -> DataShard:
    index = mesh.get_local_rank("dp_replicate") * shape.dp_shard + mesh.get_local_rank("dp_shard")
    sequence = mesh.get_local_rank("cp") * shape.sp + mesh.get_local_rank("sp")
    within = sequence * shape.tp + mesh.get_local_rank("tp")
    return DataShard(shape.data_parallel, index, shape.batch_replicas, within == 0, shape.sequence_slices)
