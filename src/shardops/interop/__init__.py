"""Conversion to and from torch.distributed.tensor.DTensor, without moving data.

The layouts are the same, so a conversion only re-labels the local shard. This is
the one module of the library that uses torch's private placement classes (through shardops._torch.distributed).
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch.distributed import norm_partial_class, strided_shard_class
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import NormPartial, Partial, Placement, Replicate, Shard, StridedShard
from ..spec import TensorMeta, TensorSpec
from ..tensor import DTensor
from ..world import in_threads_world
from ..wrapping import local_of, spec_of, wrap


def _torch_placement(p: Placement) -> Any:
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    if isinstance(p, StridedShard):
        return strided_shard_class()(p.dim, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return TShard(p.dim)
    if isinstance(p, Replicate):
        return TReplicate()
    if isinstance(p, NormPartial):
        return norm_partial_class()(norm_type=p.norm_type)
    if isinstance(p, Partial):
        return TPartial(p.reduce_op)
    raise ShardingError(f"to_torch: no torch placement for {p!r}")


def _our_placement(p: Any) -> Placement:
    if isinstance(p, strided_shard_class()):
        return StridedShard(p.dim, int(p.split_factor))
    if p.is_shard():
        return Shard(p.dim)
    if p.is_replicate():
        return Replicate()
    norm_type = getattr(p, "norm_type", None)
    if norm_type is not None:
        return NormPartial(float(norm_type))
    if p.is_partial():
        return Partial(p.reduce_op)
    raise ShardingError(f"from_torch: unsupported torch placement {p!r}")


def to_torch(dt: DTensor) -> Any:
    """This DTensor as a torch.distributed.tensor.DTensor sharing the same local storage."""
    if in_threads_world():
        raise ShardingError(
            "to_torch: the threads world (shardops.run) has no torch process group, so there is no torch DTensor to "
            "make; run under torchrun or after torch.distributed.init_process_group."
        )
    from torch.distributed.tensor import DTensor as TorchDTensor

    spec = spec_of(dt)
    placements = [_torch_placement(p) for p in spec.placements]
    return TorchDTensor.from_local(
        local_of(dt),
        spec.mesh.torch_mesh,
        placements,
        run_check=False,
        shape=torch.Size(spec.shape),
        stride=spec.meta.stride,
    )


def from_torch(tdt: Any) -> DTensor:
    """A torch DTensor as a shardops DTensor sharing the same local storage."""
    mesh = DeviceMesh.from_torch(tdt.device_mesh)
    placements = tuple(_our_placement(p) for p in tdt.placements)
    meta = TensorMeta(tuple(tdt.shape), tuple(tdt.stride()), tdt.dtype)
    with torch.no_grad():  # torch's to_local hands back the shard itself when no graph is recorded
        local = tdt.to_local()
    return wrap(local, TensorSpec(mesh, placements, meta), requires_grad=tdt.requires_grad)
