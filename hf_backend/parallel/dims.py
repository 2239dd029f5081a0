"""The process grid and its DeviceMesh, in one place (torchtitan's ParallelDims): `MeshShape`, the one resolved
shape a strategy sees; the mesh built once per process and shape (`build_mesh`); every submesh a parallelism uses
(what FSDP shards over, the sequence split, the experts' two meshes); and which part of each global batch a process
reads (`DataShard`).

Every dimension is present in the mesh, size 1 or not (pp, dp_replicate, dp_shard, cp, sp, tp, outermost first), so each
plan names the dimensions it uses whatever the shape; Accelerate's flattened dimensions are there too (`dp`,
`dp_shard_cp`, `dp_cp`), made with the mesh on every rank, so that a script indexing one later
(`mesh["dp_cp"].get_group()`) starts no collective. A sequence is split by cp or by sp, never both, so the flattened
dimensions that name cp take sp in too: they are the ranks whose gradients are parts of one batch's. Accelerate's API
hands the same mesh out (`accelerator.torch_device_mesh`, `ParallelismConfig.build_device_mesh`), so a model sharded
before `prepare` and the engine use the same process groups.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, NamedTuple

from ..core.errors import ConfigError

# torch is imported where a mesh is built: the command line reads shapes without it
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Accelerate's flattened dimensions, and the dimensions each joins.
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp", "sp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp", "sp")}


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The process grid, outermost dimension first (torchtitan's order): pipeline stages,
    data-parallel replicas, data-parallel shards, context-parallel and sequence-parallel sequence
    slices (one of the two), tensor-parallel shards. Rank r sits at (r // (replicate*shard*cp*sp*tp),
    ..., r % tp): ranks that differ only in their cp, sp and tp coordinates are neighbours and share a
    batch, and so do the pp ranks (each runs other layers of it). `pp_schedule`, `pp_microbatches`:
    torch.distributed.pipelining's schedule by name and the microbatches it cuts each batch into
    (strategies/pipeline.py). `ep`: how many of the
    ranks in dp_shard x cp x sp (tp is 1) split each layer's experts, the innermost ones; not a
    dimension of its own. `sp_backend`: whose Ulysses splits the sequences, "hf_backend" (the mesh
    path, whatever the config named) or "deepspeed" (DeepSpeed's ALST, when DeepSpeed is the
    strategy): the config's value until the strategy is chosen (strategies/__init__.py)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1
    sp_backend: str = dataclasses.field(default="hf_backend", compare=False)
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None  # None: one per stage

    DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")

    @property
    def sizes(self) -> tuple[int, int, int, int, int, int]:
        return self.pp, self.dp_replicate, self.dp_shard, self.cp, self.sp, self.tp

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    @property
    def data_parallel(self) -> int:
        """How many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def sequence_slices(self) -> int:
        """How many slices each sequence is cut into (by cp or by sp: never both)."""
        return self.cp * self.sp

    @property
    def batch_replicas(self) -> int:
        """How many ranks share each batch (tp x cp x sp neighbours, in each pp stage)."""
        return self.sequence_slices * self.tp * self.pp

    @property
    def expert_shards(self) -> int:
        """How many ranks of a replica hold the same experts (FSDP shards them: `efsdp`)."""
        return self.dp_shard * self.sequence_slices // self.ep

    @property
    def needs_mesh(self) -> bool:
        """Whether anything is sharded: with replicas only, DDP trains the same way."""
        return self.dp_shard > 1 or self.sequence_slices > 1 or self.tp > 1 or self.pp > 1

    @classmethod
    def for_fsdp(cls, sharding_strategy: str, world: int, local: int) -> MeshShape:
        if sharding_strategy == "NO_SHARD":
            return cls(dp_replicate=world)
        if sharding_strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            return cls(dp_replicate=world // local, dp_shard=local)
        return cls(dp_shard=world)

    def describe(self) -> str:
        """"dp_shard 2 x tp 2": the dimensions of size > 1 ("one process" when none is)."""
        dims = [f"{name} {size}" for name, size in zip((*self.DIMS, "ep"), (*self.sizes, self.ep)) if size > 1]
        return " x ".join(dims) or "one process"

    @property
    def deepspeed_ulysses(self) -> bool:
        """Whether DeepSpeed's ALST splits the sequences (the only split DeepSpeed takes: no tp, cp or
        ep; its data parallelism is every sp group)."""
        return self.sp > 1 and self.tp == self.cp == self.ep == 1 and self.sp_backend == "deepspeed"


# the last mesh: (sizes, device type), its default group, it
_BUILT: tuple[tuple, Any, DeviceMesh] | None = None


def build_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """The mesh of `shape` (its `sizes` along its `DIMS`; collective the first time: every rank calls it), the same
    object on later calls while the process group lasts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    global _BUILT
    key = (shape.sizes, device_type)
    if _BUILT is not None and _BUILT[0] == key and _BUILT[1] is dist.group.WORLD:
        return _BUILT[2]
    mesh = init_device_mesh(device_type, shape.sizes, mesh_dim_names=shape.DIMS)
    for name, dims in FLATTENED.items():
        mesh[dims]._flatten(name)
    _BUILT = (key, dist.group.WORLD, mesh)
    return mesh


class ExpertMeshes(NamedTuple):
    """`ep`: the ranks one layer's experts are split over; `fsdp`: the ranks holding the same experts
    (`efsdp`, across replicas too under HSDP), which shard them."""

    ep: DeviceMesh
    fsdp: DeviceMesh


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
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate([mesh["dp_replicate"], shards]) if shape.dp_replicate > 1 else shards


def sequence_mesh(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh:
    """The ranks that split each sequence: `cp` or `sp` (size 1 when neither does)."""
    return mesh["sp"] if shape.sp > 1 else mesh["cp"]


class DataShard(NamedTuple):
    """Which part of each global batch this process reads: `index` of `count` parts; `replicas`
    neighbouring processes (tensor / context parallel) read the same part, and the first of them
    (`first`) reports it;
    `sequence_slices`: how many slices context or sequence parallelism cuts each sequence into."""

    count: int  # type: ignore[assignment]  # shadows tuple.count, which a NamedTuple field may do
    index: int  # type: ignore[assignment]  # shadows tuple.index, likewise
    replicas: int = 1
    first: bool = True
    sequence_slices: int = 1


def data_shard(mesh: DeviceMesh, shape: MeshShape) -> DataShard:
    index = mesh.get_local_rank("dp_replicate") * shape.dp_shard + mesh.get_local_rank("dp_shard")
    sequence = mesh.get_local_rank("cp") * shape.sp + mesh.get_local_rank("sp")
    within = (mesh.get_local_rank("pp") * shape.sequence_slices + sequence) * shape.tp + mesh.get_local_rank("tp")
    return DataShard(shape.data_parallel, index, shape.batch_replicas, within == 0, shape.sequence_slices)


def loaded_shape(model: Any) -> MeshShape | None:
    """The grid transformers sharded a model over while loading it
    (`from_pretrained(distributed_config=...)`, or
    `tp_plan=`: its own mesh over every process), as the engine's shape: the run's grid must be that
    one. None for a model loaded whole. transformers' own pipeline stages and expert split, from a
    DistributedConfig, are refused here, in one line that names the engine's own."""
    if getattr(model, "is_distributed_loading_by_transformers", False):
        config = model.config.distributed_config
        if (getattr(config, "pp_size", 1) or 1) > 1:
            raise ConfigError(f"the model was loaded with DistributedConfig(pp_size={config.pp_size}): "
                              "transformers' stages run forward only; load it without pp_size and set "
                              f"ParallelismConfig(pp_size={config.pp_size})")
        if (getattr(config, "ep_size", 1) or 1) > 1:
            raise ConfigError(f"the model was loaded with DistributedConfig(ep_size={config.ep_size}): "
                              "hf_backend splits the experts itself; load it without ep_size and set "
                              f"ParallelismConfig(ep_size={config.ep_size})")
        return MeshShape(dp_replicate=config.dp_replicate_size or 1, dp_shard=config.fsdp_size or 1,
                         tp=config.tp_size or 1)
    # transformers before DistributedConfig: tp_plan alone
    tp = getattr(model, "tp_size", None) or 1
    return MeshShape(tp=tp) if tp > 1 else None
