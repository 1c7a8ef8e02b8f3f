"""Where a module boundary puts its tensors, and the conversions the styles share: a mesh or
placement given the torch way (torch's DeviceMesh and placements are taken as they are), a
parameter laid out from one rank's data, a boundary's tensor wrapped or moved to the layout the
style asks for on its mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Placement, Shard
from ..tensor import DTensor, distribute_tensor, from_local


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


def to_dtensor(module: nn.Module, x: Any, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """A plain tensor is this rank's shard in `placements`; a DTensor stays as it is."""
    if isinstance(x, DTensor):
        return x
    if not isinstance(x, torch.Tensor):
        raise ShardingError(
            f"{type(module).__name__}: expected a tensor input at a parallel boundary, got {type(x).__name__}"
        )
    return from_local(x, mesh, placements)


def move(module: nn.Module, dt: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """`dt` in `placements` (given on `mesh`); no-op when it already is."""
    if dt.device_mesh != mesh:
        raise ShardingError(
            f"{type(module).__name__}: an input lives on {dt.device_mesh} but this boundary uses {mesh}; "
            "build inputs on the same mesh the module was parallelized on"
        )
    pl = tuple(Shard(p.dim % dt.ndim) if p.is_shard() and type(p) is Shard else p for p in placements)
    return dt if dt.placements == pl else dt.redistribute(placements=pl)
