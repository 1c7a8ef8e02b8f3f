"""Where a module boundary puts its tensors: the mesh and placements a style asks for,
lifted onto the whole (dp, tp) mesh once `data_parallel` has joined the module.

A plan is written for the tensor-parallel mesh (`mesh["tp"]`), one placement per
boundary. After `data_parallel(module, mesh)`, every boundary lays its tensors out
on the whole mesh instead: the plan's placement on the tp dims, the batch dim
sharded on the data-parallel dims. Local tensors between boundaries are then the
rank's batch shard, exactly what a torch user feeds each data-parallel rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate, Shard
from ..tensor import DTensor, distribute_tensor, from_local

DATA_PARALLEL_ATTR = "_shardops_data_parallel"


def as_mesh(mesh: Any, what: str) -> DeviceMesh:
    """Our DeviceMesh; a torch DeviceMesh (from torch code being ported) is taken as is."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if mesh is None:
        from ..mesh import current_mesh

        mesh = current_mesh()
        if mesh is None:
            raise ShardingError(f"{what}: give a device_mesh (so.init_device_mesh(...)) or call it inside `with mesh:`")
        return mesh
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    if isinstance(mesh, TorchDeviceMesh):
        return DeviceMesh.from_torch(mesh)
    raise ShardingError(f"{what}: {mesh!r} is not a DeviceMesh")


def as_placement(p: Any) -> Any:
    """Our placement; torch's Shard/Replicate/Partial (a plan ported by changing only its import) are converted."""
    if p is None or isinstance(p, Placement):
        return p
    if hasattr(p, "is_shard") and hasattr(p, "is_replicate"):
        from ..interop import _our_placement

        return _our_placement(p)
    raise ShardingError(f"{p!r} is not a placement; use Shard(d), Replicate() or Partial()")


def as_layouts(layouts: Any) -> tuple | None:
    """One placement or a tuple of them (None entries kept) -> a tuple, as torch's styles take them."""
    if layouts is None:
        return None
    if isinstance(layouts, (tuple, list)):
        return tuple(as_placement(p) for p in layouts)
    return (as_placement(layouts),)


def distribute_param(
    tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], src_data_rank: int | None
) -> DTensor:
    """`tensor` laid out on `mesh`, the data of the rank at group rank `src_data_rank` on every mesh dim
    (torch's meaning, on a sub-mesh too; None: each rank keeps its own data)."""
    data = tensor.detach()
    if src_data_rank is not None and mesh.size() > 1:
        group = mesh.group(tuple(range(mesh.ndim)))  # row-major over the mesh dims
        src_index = sum(src_data_rank * math.prod(mesh.shape[d + 1 :]) for d in range(mesh.ndim))
        data = mesh.comm.broadcast(data.contiguous(), src_index, group)
    return distribute_tensor(data, mesh, placements, src_data_rank=None)


@dataclass(frozen=True)
class DataParallelLayout:
    """The whole mesh a data-parallel module runs on, and which of its dims split the batch."""

    mesh: DeviceMesh
    dp_dims: tuple[int, ...]
    batch_dim: int
    mode: str

    def lift(self, sub: DeviceMesh, placements: Sequence[Placement]) -> tuple[Placement, ...]:
        """`placements` given on the sub-mesh `sub` of self.mesh, as placements on the whole mesh."""
        if sub == self.mesh:
            return tuple(placements)
        names = sub.mesh_dim_names
        if not names or not self.mesh.mesh_dim_names or any(n not in self.mesh.mesh_dim_names for n in names):
            raise ShardingError(
                f"data_parallel: a boundary uses mesh {sub}, which is not a named sub-mesh of {self.mesh}; "
                'parallelize with mesh["tp"] of the mesh given to data_parallel'
            )
        out: list[Placement] = []
        for d, name in enumerate(self.mesh.mesh_dim_names):
            if name in names:
                out.append(placements[names.index(name)])
            elif d in self.dp_dims:
                out.append(Shard(self.batch_dim))
            else:
                out.append(Replicate())
        return tuple(out)

    def lift_param(self, sub: DeviceMesh, placements: Sequence[Placement]) -> tuple[Placement, ...]:
        """A parameter's placements on the whole mesh: replicated over the data-parallel dims."""
        lifted = self.lift(sub, placements)
        return tuple(Replicate() if d in self.dp_dims else p for d, p in enumerate(lifted))


def data_parallel_of(module: nn.Module) -> DataParallelLayout | None:
    return getattr(module, DATA_PARALLEL_ATTR, None)


def boundary(
    module: nn.Module, mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements a boundary of `module` really uses for `placements` given on `mesh`."""
    dp = data_parallel_of(module)
    if dp is None:
        return mesh, tuple(placements)
    return dp.mesh, dp.lift(mesh, placements)


def to_dtensor(module: nn.Module, x: Any, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """A plain tensor is this rank's shard in `placements`; a DTensor stays as it is."""
    if isinstance(x, DTensor):
        return x
    if not isinstance(x, torch.Tensor):
        raise ShardingError(
            f"{type(module).__name__}: expected a tensor input at a parallel boundary, got {type(x).__name__}"
        )
    m, pl = boundary(module, mesh, placements)
    return from_local(x, m, pl)


def move(module: nn.Module, dt: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """`dt` in `placements` (given on `mesh`); no-op when it already is."""
    m, pl = boundary(module, mesh, placements)
    if dt.device_mesh != m:
        raise ShardingError(
            f"{type(module).__name__}: an input lives on {dt.device_mesh} but this boundary uses {m}; "
            "build inputs on the same mesh the module was parallelized (or data-parallelized) on"
        )
    pl = tuple(Shard(p.dim % dt.ndim) if p.is_shard() and type(p) is Shard else p for p in pl)
    return dt if dt.placements == pl else dt.redistribute(placements=pl)
