"""Helpers for sharded algorithms that move per-shard statistics (scans, moments, norms, logsumexp).

- `ShardLine`: the ranks that hold the pieces of one sharded tensor dim, in position order,
  with `gather` (every member's small statistics, several tensors packed into ONE all_gather)
  and the members before/after this rank (exclusive prefixes and suffixes).
- Autograd glue for ops that carry their own sharded backward: the layout the backward
  works in, bringing a gradient into it, and handing the input's gradient back in the
  input's own layout.

NOTE: candidates for common.py (shared by softmax/layer-norm style families too):
`ShardLine`, `reduction_layouts`, `grad_local`, `input_grad`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..dispatch.schema import normalize_dim
from ..placements import Placement, Replicate, Shard, StridedShard, dim_positions, without_partials
from ..redistribute import redistribute_local
from ..spec import TensorMeta, TensorSpec
from ..tensor import DTensor
from ..wrapping import shard_in, spec_of, wrap
from .common import all_gather_stacked, member_coordinates, mesh_dims_sharding, shift_after_reduce

R = Replicate()


# ------------------------------------------------------------------ the line of shards along a dim


@dataclass(frozen=True)
class ShardLine:
    """The members holding the pieces of tensor dim `dim`, in group order, with their global ranges."""

    spec: TensorSpec
    dim: int
    mesh_dims: tuple[int, ...]
    me: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.starts[self.me]

    def _ordered(self, keep) -> list[int]:
        members = [m for m in range(len(self.starts)) if self.sizes[m] > 0 and keep(m)]
        return sorted(members, key=lambda m: self.starts[m])

    def before(self) -> list[int]:
        """Non-empty members holding positions before this rank's, in position order."""
        return self._ordered(lambda m: m != self.me and self.starts[m] < self.start)

    def after(self) -> list[int]:
        """Non-empty members holding positions after this rank's, in position order."""
        return self._ordered(lambda m: m != self.me and self.starts[m] > self.start)

    def gather(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One all_gather of this rank's statistics (stacked per member on dim 0); local if unsharded."""
        return all_gather_stacked(list(tensors), self.spec, self.mesh_dims)


def shard_line(spec: TensorSpec, dim: int) -> ShardLine:
    """The line of `dim` (a single member, no collective, when no mesh dim shards it)."""
    mesh_dims = mesh_dims_sharding(spec, dim)
    coords = member_coordinates(spec, mesh_dims)
    pos = [dim_positions(spec.shape[dim], dim, spec.mesh.shape, c, spec.placements) for c in coords]
    starts = tuple(p[0] if len(p) else spec.shape[dim] for p in pos)
    me = coords.index(list(spec.mesh.own_coordinate()))
    return ShardLine(spec, dim, mesh_dims, me, starts, tuple(len(p) for p in pos))


def local_count(spec: TensorSpec, dims: Sequence[int], coordinate: Sequence[int]) -> int:
    shape = spec.local_shape(coordinate)
    return math.prod(shape[d] for d in dims)


def last_along(t: torch.Tensor, dim: int, neutral: Any) -> torch.Tensor:
    """The last entry along `dim` (kept as size 1); `neutral` where the shard is empty."""
    if t.shape[dim] == 0:
        shape = list(t.shape)
        shape[dim] = 1
        return torch.full(shape, neutral, dtype=t.dtype, device=t.device)
    return t.narrow(dim, t.shape[dim] - 1, 1)


def first_along(t: torch.Tensor, dim: int, neutral: Any) -> torch.Tensor:
    if t.shape[dim] == 0:
        return last_along(t, dim, neutral)
    return t.narrow(dim, 0, 1)


# ------------------------------------------------------------------ reduced dims


def reduced_dims(dim: Any, ndim: int, name: str) -> tuple[int, ...] | None:
    """A python-level `dim` argument as sorted dims; None and [] mean every dim (torch's convention).

    None where it is not plain ints (e.g. named dims): the caller leaves the call to torch.
    """
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int) and not isinstance(dim, bool):
        return (normalize_dim(dim, ndim, name),)
    if isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        return tuple(sorted({normalize_dim(d, ndim, name) for d in dim})) or tuple(range(ndim))
    return None


def unsqueeze_reduced(t: torch.Tensor, ndim: int, dims: Sequence[int], keepdim: bool) -> torch.Tensor:
    """A reduction's output (or its gradient) with the reduced dims back as size 1."""
    if keepdim or t.ndim == ndim:
        return t
    for d in sorted(dims):
        t = t.unsqueeze(d)
    return t


def reduction_stats_bytes(spec: TensorSpec, dims: Sequence[int], per_row_bytes: float) -> float:
    """Bytes one rank puts into a statistics all_gather: per output element, over this layout's shards."""
    rows = math.prod(s for d, s in enumerate(spec.shape) if d not in dims)
    others = math.prod(
        n
        for n, p in zip(spec.mesh.shape, spec.placements)
        if isinstance(p, (Shard, StridedShard)) and p.dim not in dims
    )
    return rows / max(others, 1) * per_row_bytes


# ------------------------------------------------------------------ autograd glue


def needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def resolve_partials(x):
    """`x` with pending reductions resolved (no autograd): ops without partial rows need the values."""
    target = without_partials(spec_of(x).placements)
    if target == spec_of(x).placements:
        return x
    return wrap(shard_in(x, target), spec_of(x).with_placements(target))


def reduction_layouts(
    in_spec: TensorSpec, dims: Sequence[int], keepdim: bool
) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(input layout, output layout) a reduction's local backward works in.

    The input stays where it is (it is the big tensor; pending reductions are resolved
    before); the reduced output and its gradient, which are small, come to the matching
    layout: Replicate over mesh dims that shard a reduced dim (the local formulas need only
    the statistic there, whichever positions a shard holds), the shifted shard otherwise.
    """
    layout = tuple(p if p.is_shard() else R for p in in_spec.placements)
    out = tuple(
        shift_after_reduce(p, dims, keepdim) if isinstance(p, (Shard, StridedShard)) and p.dim not in dims else R
        for p in layout
    )
    return layout, out


def to_layout(local: torch.Tensor, spec: TensorSpec, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's piece of (local, spec) in `placements` (no autograd)."""
    if tuple(placements) == tuple(spec.placements):
        return local
    return redistribute_local(local, spec, placements)


def grad_local(grad: torch.Tensor, like: TensorSpec, placements: Sequence[Placement] | None = None) -> torch.Tensor:
    """This rank's piece of `grad` in `placements` (default: `like`'s layout with pending reductions as Replicate)."""
    target = without_partials(like.placements) if placements is None else tuple(placements)
    if isinstance(grad, DTensor):
        return shard_in(grad, target)
    spec = TensorSpec(like.mesh, (R,) * like.mesh.ndim, TensorMeta(tuple(grad.shape), tuple(grad.stride()), grad.dtype))
    return redistribute_local(grad, spec, target)


def input_grad(local: torch.Tensor, placements: Sequence[Placement], x_spec: TensorSpec):
    """Wrap an input gradient computed in `placements`; hand it back in the input's layout.

    As for redistribute's backward: a Partial input gets a Replicate gradient.
    """
    local = local.to(x_spec.dtype)
    meta = TensorMeta(x_spec.shape, x_spec.meta.stride, x_spec.dtype)
    spec = TensorSpec(x_spec.mesh, tuple(placements), meta)
    target = without_partials(x_spec.placements)
    if target != spec.placements:
        local = redistribute_local(local, spec, target)
    return wrap(local, spec.with_placements(target))
