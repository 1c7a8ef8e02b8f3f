"""torch.save / torch.load of shardops DTensors and meshes, as torch's DTensor pickles.

Each rank pickles its own local shard with the layout (mesh, placements, global shape
and stride); nothing is gathered. The mesh travels as its description (device type,
rank array, dim names), not as process groups: an unpickled DTensor attaches to the
world the loading code runs in (the current `so.run` threads world or torch process
group) when it is first used, so a file saved by rank r loads on rank r of a new
launch. Loading only needs the classes registered below with
`torch.serialization.add_safe_globals`, so `torch.load`'s default `weights_only=True`
accepts them, as it accepts torch's DTensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ShardingError
from ..mesh import DeviceMesh, rebuild_mesh
from ..placements import NormPartial, Partial, Placement, Replicate, Shard, StridedShard
from ..spec import TensorMeta, TensorSpec
from ..world import current_comm, in_threads_world
from ..wrapping import local_of, resolve_pending_gradient, spec_of, wrap


def rebuild_dtensor(
    cls: type,
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: Sequence[int],
    stride: Sequence[int],
    requires_grad: bool,
    is_param: bool = False,
) -> Any:
    if not (isinstance(cls, type) and cls.__module__ == "shardops.tensor" and cls.__name__ == "DTensor"):
        raise ShardingError(f"torch.load: a shardops DTensor record names {cls!r} as its class")
    if not isinstance(mesh, DeviceMesh) or not all(isinstance(p, Placement) for p in placements):
        raise ShardingError("torch.load: a shardops DTensor record without a mesh and placements")
    if len(placements) != mesh.ndim:
        raise ShardingError(f"torch.load: {len(placements)} placements {list(placements)} for a {mesh.ndim}-d mesh")
    _check_mesh_fits_world(mesh)
    meta = TensorMeta(tuple(int(s) for s in shape), tuple(int(s) for s in stride), local.dtype)
    dt = wrap(local, TensorSpec(mesh, tuple(placements), meta))
    if requires_grad:
        dt.requires_grad_()  # through DTensor.requires_grad_: the leaf keeps its gradient layout
    if is_param:
        dt._is_param = True  # what nn.Parameter(subclass) marks: isinstance(dt, nn.Parameter) again
    return dt


def _check_mesh_fits_world(mesh: DeviceMesh) -> None:
    """A shard saved on a mesh with ranks this world lacks would wait forever at its first collective."""
    if not (in_threads_world() or (torch.distributed.is_available() and torch.distributed.is_initialized())):
        return  # loaded outside any world: it attaches (and is checked by its collectives) where it is used
    world_size = current_comm().world_size
    missing = sorted(r for r in mesh.mesh.flatten().tolist() if not 0 <= r < world_size)
    if missing:
        raise ShardingError(
            f"torch.load: a DTensor saved on {mesh} ({mesh.size()} ranks) is loaded in a world of {world_size} ranks, "
            f"which lacks rank(s) {missing}; load each rank's file in a world of the size it was saved from, or save "
            "with shardops.checkpoint.save and load with shardops.checkpoint.load, which reshards onto any mesh"
        )


def reduce_dtensor(dt: Any) -> tuple:
    """DTensor.__reduce_ex__: this rank's shard and the layout (a pending leaf gradient moved first)."""
    resolve_pending_gradient(dt)
    spec = spec_of(dt)
    local = local_of(dt).detach()
    return (
        rebuild_dtensor,
        (
            type(dt),
            local,
            spec.mesh,
            spec.placements,
            spec.shape,
            spec.meta.stride,
            dt.requires_grad,
            bool(getattr(dt, "_is_param", False)),
        ),
    )


def register_safe_globals(dtensor_cls: type) -> None:
    """What `torch.load(weights_only=True)` must accept to rebuild shardops DTensors."""
    torch.serialization.add_safe_globals(
        [dtensor_cls, rebuild_dtensor, rebuild_mesh, Shard, StridedShard, Replicate, Partial, NormPartial]
    )
