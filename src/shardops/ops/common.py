"""Helpers shared by op families: which mesh dims shard a tensor dim, groups, offsets, stats gathering."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..placements import Placement, Replicate, Shard, StridedShard, dim_positions
from ..spec import TensorSpec

R = Replicate()


def mesh_dims_sharding(spec: TensorSpec, tensor_dims: int | Sequence[int]) -> tuple[int, ...]:
    """Mesh dims whose placement shards any of `tensor_dims` (a reduction's statistics travel over them)."""
    dims = (tensor_dims,) if isinstance(tensor_dims, int) else tuple(tensor_dims)
    return tuple(i for i, p in enumerate(spec.placements) if isinstance(p, (Shard, StridedShard)) and p.dim in dims)


def shard_placements(spec: TensorSpec) -> list[Shard | StridedShard]:
    """Shard(d) for every dim, plus the input's own StridedShard placements: the shards worth a row."""
    shards: list[Shard | StridedShard] = [Shard(d) for d in range(spec.ndim)]
    return shards + [p for p in dict.fromkeys(spec.placements) if isinstance(p, StridedShard)]


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed in: float32 for half types, as torch's CPU and CUDA kernels do."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def global_positions(spec: TensorSpec, tensor_dim: int, coordinate: Sequence[int] | None = None) -> range | list[int]:
    """Global indices along `tensor_dim` held by this rank (a range for plain shards)."""
    coord = (spec.mesh.get_coordinate() or ()) if coordinate is None else coordinate
    return dim_positions(spec.shape[tensor_dim], tensor_dim, spec.mesh.shape, coord, spec.placements)


def global_range(spec: TensorSpec, tensor_dim: int) -> range:
    """`global_positions` where the caller's rows split `tensor_dim` with plain shards only (nested or not)."""
    pos = global_positions(spec, tensor_dim)
    if not isinstance(pos, range):
        raise TypeError(f"{spec!r}: dim {tensor_dim} is split by a StridedShard; its positions are not a range")
    return pos


def global_index_tensor(spec: TensorSpec, tensor_dim: int, device=None) -> torch.Tensor:
    """int64 tensor of this rank's global indices along `tensor_dim`."""
    pos = global_positions(spec, tensor_dim)
    if isinstance(pos, range):
        return torch.arange(pos.start, pos.stop, dtype=torch.int64, device=device)
    return torch.tensor(pos, dtype=torch.int64, device=device)


def member_coordinates(spec: TensorSpec, mesh_dims: Sequence[int]) -> list[list[int]]:
    """Coordinates of the group members over `mesh_dims`, row-major (the group's order)."""
    mesh = spec.mesh
    coord = list(mesh.own_coordinate())
    out = []
    for idx in range(math.prod(mesh.shape[d] for d in mesh_dims)):
        c, rem = list(coord), idx
        for d in reversed(mesh_dims):
            c[d] = rem % mesh.shape[d]
            rem //= mesh.shape[d]
        out.append(c)
    return out


def member_shapes(spec: TensorSpec, mesh_dims: Sequence[int]) -> list[tuple[int, ...]]:
    """Local shapes of every member of the group over `mesh_dims` (row-major), for uneven all_gathers."""
    return [spec.local_shape(c) for c in member_coordinates(spec, mesh_dims)]


def all_gather_packed(
    tensors: Sequence[torch.Tensor],
    spec: TensorSpec,
    mesh_dims: Sequence[int],
    shapes: Sequence[Sequence[int]] | None = None,
) -> list[list[torch.Tensor]]:
    """Several tensors of any dtypes gathered in ONE collective over `mesh_dims`;
    per member in group order, its tensors.

    They travel as the bytes of one uint8 buffer (float statistics next to int64 indices, exactly).
    `shapes`: every member's shape, shared by its tensors (uneven shards); default: every member's
    tensors are shaped like this rank's.
    """
    if not mesh_dims:
        return [list(tensors)]
    mesh = spec.mesh
    group = mesh.group(tuple(mesh_dims))
    layouts = (
        [[tuple(s)] * len(tensors) for s in shapes]
        if shapes is not None
        else [[tuple(t.shape) for t in tensors]] * group.size
    )
    sizes = [[math.prod(s) * t.element_size() for s, t in zip(member, tensors)] for member in layouts]
    mine = torch.cat([_bytes_of(t) for t in tensors])
    pieces = mesh.comm.all_gather(mine, group, [(sum(n),) for n in sizes])
    out = []
    for piece, member, nbytes in zip(pieces, layouts, sizes):
        parts, offset = [], 0
        for t, shape, n in zip(tensors, member, nbytes):
            # clone: a view at an odd byte offset cannot be reinterpreted as a wider dtype
            parts.append(piece[offset : offset + n].clone().view(t.dtype).reshape(shape))
            offset += n
        out.append(parts)
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's data as a flat uint8 tensor. An empty tensor may keep a 0 stride through
    reshape (an expanded gradient), which torch refuses to reinterpret: it has no bytes anyway."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.contiguous().reshape(-1).view(torch.uint8)


def all_gather_stacked(tensors, spec: TensorSpec, mesh_dims: Sequence[int]):
    """Equal-shaped per-rank values (e.g. per-shard statistics) gathered over `mesh_dims`, stacked on dim 0.

    `tensors`: one tensor (gives one stacked tensor) or several of any dtypes (a list of stacked
    tensors, packed into one buffer). One collective, however many mesh dims: the group spans them all.
    """
    if isinstance(tensors, torch.Tensor):
        mesh = spec.mesh
        return torch.stack(mesh.comm.all_gather(tensors, mesh.group(tuple(mesh_dims))), dim=0)
    members = all_gather_packed(tensors, spec, mesh_dims)
    return [torch.stack([m[k] for m in members]) for k in range(len(tensors))]


def all_reduce(t: torch.Tensor, spec: TensorSpec, mesh_dims: Sequence[int], op: str = "sum") -> torch.Tensor:
    """All-reduce over the group spanning `mesh_dims` (one collective)."""
    if not mesh_dims:
        return t
    mesh = spec.mesh
    return mesh.comm.all_reduce(t, op, mesh.group(tuple(mesh_dims)))


def replace_dims(placements: Sequence[Placement], dims: Sequence[int], new: Placement = R) -> tuple[Placement, ...]:
    """Placements with every shard of `dims` replaced (e.g. by Replicate or Partial)."""
    return tuple(new if isinstance(p, (Shard, StridedShard)) and p.dim in dims else p for p in placements)


def shift_after_reduce(p: Placement, reduced: Sequence[int], keepdim: bool) -> Placement:
    """A shard placement's dim after `reduced` dims are removed (keepdim=False)."""
    if not isinstance(p, (Shard, StridedShard)) or keepdim:
        return p
    shift = sum(1 for d in reduced if d < p.dim)
    return Shard(p.dim - shift) if isinstance(p, Shard) else StridedShard(p.dim - shift, p.split_factor)
