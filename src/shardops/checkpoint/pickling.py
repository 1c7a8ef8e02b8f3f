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

from typing import Any, Sequence

import torch

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import NormPartial, Partial, Placement, Replicate, Shard, StridedShard
from ..spec import TensorMeta, TensorSpec


def rebuild_mesh(device_type: str, ranks: list, mesh_dim_names: tuple[str, ...] | None) -> DeviceMesh:
    if not isinstance(device_type, str) or not isinstance(ranks, (list, int)):
        raise ShardingError(f"torch.load: not a shardops DeviceMesh record ({device_type!r}, {ranks!r})")
    return DeviceMesh(device_type, ranks, mesh_dim_names)


def reduce_mesh(mesh: DeviceMesh) -> tuple:
    return (rebuild_mesh, (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names))


def rebuild_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: Sequence[int], stride: Sequence[int], requires_grad: bool
) -> Any:
    from ..tensor import DTensor

    if not isinstance(mesh, DeviceMesh) or not all(isinstance(p, Placement) for p in placements):
        raise ShardingError("torch.load: a shardops DTensor record without a mesh and placements")
    if len(placements) != mesh.ndim:
        raise ShardingError(f"torch.load: {len(placements)} placements {list(placements)} for a {mesh.ndim}-d mesh")
    meta = TensorMeta(tuple(int(s) for s in shape), tuple(int(s) for s in stride), local.dtype)
    dt = DTensor._make(local, TensorSpec(mesh, tuple(placements), meta))
    if requires_grad:
        dt.requires_grad_()  # through DTensor.requires_grad_: the leaf keeps its gradient layout
    return dt


def reduce_dtensor(dt: Any) -> tuple:
    """DTensor.__reduce_ex__: this rank's shard and the layout (a pending leaf gradient moved first)."""
    if dt._pending_layout is not None:
        dt._resolve_pending()
    spec = dt._spec
    local = dt._local_tensor.detach()
    return (rebuild_dtensor, (local, spec.mesh, spec.placements, spec.shape, spec.meta.stride, dt.requires_grad))


def register_safe_globals() -> None:
    """What `torch.load(weights_only=True)` must accept to rebuild shardops DTensors."""
    torch.serialization.add_safe_globals(
        [rebuild_dtensor, rebuild_mesh, Shard, StridedShard, Replicate, Partial, NormPartial]
    )
