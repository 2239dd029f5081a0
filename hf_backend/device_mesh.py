"""The process grid's DeviceMesh: built once per process and shape, and handed out under Accelerate's
names.

The engine's strategies apply their parallelisms over it (strategies/mesh.py), and Accelerate's API
hands the same object out (`accelerator.torch_device_mesh`, `ParallelismConfig.build_device_mesh`),
so a model sharded before `prepare` and the engine use the same process groups. Every dimension is
present, size 1 or not (dp_replicate, dp_shard, cp, sp, tp, outermost first), so each plan names
the dimensions it uses whatever the shape; Accelerate's flattened dimensions are there too (`dp`,
`dp_shard_cp`, `dp_cp`), made with the mesh on every rank, so that a script indexing one later
(`mesh["dp_cp"].get_group()`) starts no collective. A sequence is split by cp or by sp, never both,
so the flattened dimensions that name cp take sp in too: they are the ranks whose gradients are
parts of one batch's, whichever splits the sequences.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Accelerate's flattened dimensions, and the dimensions each joins.
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp", "sp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp", "sp")}

# the last mesh: (sizes, device type), its default group, it
_BUILT: tuple[tuple, Any, DeviceMesh] | None = None


def build_mesh(shape: Any, device_type: str) -> DeviceMesh:
    """The mesh of `shape` (a config.parallelism.MeshShape: its `sizes` along its `DIMS`; collective
    the first time: every rank calls it), the same object on later calls while the process group
    lasts."""
    global _BUILT
    key = (shape.sizes, device_type)
    if _BUILT is not None and _BUILT[0] == key and _BUILT[1] is dist.group.WORLD:
        return _BUILT[2]
    mesh = init_device_mesh(device_type, shape.sizes, mesh_dim_names=shape.DIMS)
    for name, dims in FLATTENED.items():
        mesh[dims]._flatten(name)
    _BUILT = (key, dist.group.WORLD, mesh)
    return mesh

