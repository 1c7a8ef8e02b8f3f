"""Helpers shared by op families: which mesh dims shard a tensor dim, groups, offsets, stats gathering."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..placements import Placement, Replicate, Shard, dim_positions
from ..spec import TensorSpec

R = Replicate()


def mesh_dims_sharding(spec: TensorSpec, tensor_dims: int | Sequence[int]) -> list[int]:
    """Mesh dims whose placement shards any of `tensor_dims`."""
    dims = (tensor_dims,) if isinstance(tensor_dims, int) else tuple(tensor_dims)
    return [i for i, p in enumerate(spec.placements) if p.is_shard() and p.dim in dims]


def global_positions(spec: TensorSpec, tensor_dim: int, coordinate: Sequence[int] | None = None) -> range | list[int]:
    """Global indices along `tensor_dim` held by this rank (a range for plain shards)."""
    coord = spec.mesh.get_coordinate() if coordinate is None else coordinate
    return dim_positions(spec.shape[tensor_dim], tensor_dim, spec.mesh.shape, coord, spec.placements)


def global_index_tensor(spec: TensorSpec, tensor_dim: int, device=None) -> torch.Tensor:
    """int64 tensor of this rank's global indices along `tensor_dim`."""
    pos = global_positions(spec, tensor_dim)
    if isinstance(pos, range):
        return torch.arange(pos.start, pos.stop, dtype=torch.int64, device=device)
    return torch.tensor(pos, dtype=torch.int64, device=device)


def member_shapes(spec: TensorSpec, mesh_dims: Sequence[int], local_shape_fn=None) -> list[tuple[int, ...]]:
    """Local shapes of every member of the group over `mesh_dims` (row-major), for uneven all_gathers."""
    mesh = spec.mesh
    coord = list(mesh.get_coordinate())
    shapes = []
    for idx in range(math.prod(mesh.shape[d] for d in mesh_dims)):
        c = list(coord)
        rem = idx
        for d in reversed(mesh_dims):
            c[d] = rem % mesh.shape[d]
            rem //= mesh.shape[d]
        shapes.append(spec.local_shape(c) if local_shape_fn is None else local_shape_fn(c))
    return shapes


def all_gather_stacked(t: torch.Tensor, spec: TensorSpec, mesh_dims: Sequence[int]) -> torch.Tensor:
    """Equal-shaped per-rank values (e.g. per-shard statistics) gathered over `mesh_dims`, stacked on dim 0.

    One collective, however many mesh dims: the group spans them all.
    """
    mesh = spec.mesh
    group = mesh.group(tuple(mesh_dims))
    parts = mesh.comm.all_gather(t, group)
    return torch.stack(parts, dim=0)


def all_reduce(t: torch.Tensor, spec: TensorSpec, mesh_dims: Sequence[int], op: str = "sum") -> torch.Tensor:
    """All-reduce over the group spanning `mesh_dims` (one collective)."""
    if not mesh_dims:
        return t
    mesh = spec.mesh
    return mesh.comm.all_reduce(t, op, mesh.group(tuple(mesh_dims)))


def replace_dims(placements: Sequence[Placement], dims: Sequence[int], new: Placement = R) -> tuple[Placement, ...]:
    """Placements with every shard of `dims` replaced (e.g. by Replicate or Partial)."""
    return tuple(new if p.is_shard() and p.dim in dims else p for p in placements)


def shift_after_reduce(p: Placement, reduced: Sequence[int], keepdim: bool) -> Placement:
    """A shard placement's dim after `reduced` dims are removed (keepdim=False)."""
    if not p.is_shard() or keepdim:
        return p
    shift = sum(1 for d in reduced if d < p.dim)
    return type(p)(p.dim - shift) if isinstance(p, Shard) else type(p)(p.dim - shift, p.split_factor)
