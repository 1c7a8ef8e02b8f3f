"""Placement types and the layout math of one tensor over a device mesh.

A placement says, for one mesh dim, how the ranks along it hold the tensor:

    Shard(d)              dim d is chunked like torch.chunk (ceil-sized chunks,
                          trailing ranks may hold short or empty chunks)
    StridedShard(d, sf)   dim d is first chunked into sf pieces, each piece is
                          chunked over the ranks, and a rank holds its chunk of
                          every piece (FSDP+TP after a view)
    Replicate()           every rank holds the whole tensor
    Partial(op)           every rank holds a value; the tensor is the op-reduction
    NormPartial(p)        every rank holds a p-norm; the tensor is the p-norm of them

The math matches torch.distributed.tensor exactly (tests check it against torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .errors import ShardingError

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


class Placement:
    """Base class; predicates spare callers most isinstance checks."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard(Placement):
    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        if not isinstance(self.split_factor, int) or self.split_factor < 1:
            raise ShardingError(
                f"StridedShard(dim={self.dim}, split_factor={self.split_factor}): "
                "split_factor must be a positive integer (1 is the same as Shard)."
            )

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"_S({self.dim},{self.split_factor})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Pending reduction: every rank holds a value; the tensor is their `reduce_op`-reduction.

    The meaning of each reduce op lives here, once:
      reduce(values)      the tensor from every rank's value (rank order: deterministic)
      combine(stacked)    the same over dim 0 of one stacked tensor
      split(x, c)         the value coordinate `c` holds so that reducing over the ranks gives x
      to_wire/from_wire   what a rank puts into a plain `wire_op` collective, and how the result
                          is read back (identity here; NormPartial raises to the p-th power)
    """

    reduce_op: str = "sum"
    # torch's public class attributes, for code written against torch's Partial
    LINEAR_REDUCE_OPS: ClassVar[tuple[str, ...]] = ("sum", "avg")  # distribute over addition (mm of a partial)
    ALL_REDUCE_OPS: ClassVar[tuple[str, ...]] = ("sum", "avg", "min", "max", "product")

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ShardingError(f"Partial(reduce_op={self.reduce_op!r}): unknown reduce op; use one of {REDUCE_OPS}.")

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    @property
    def reachable(self) -> bool:
        """A redistribution may end here (a Replicate tensor splits into it locally)."""
        return True

    @property
    def wire_op(self) -> str:
        return self.reduce_op

    def to_wire(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def from_wire(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.from_wire(reduce_values([self.to_wire(v) for v in values], self.wire_op))

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return self.from_wire(combine_stacked(self.to_wire(stacked), self.wire_op))

    def split(self, x: torch.Tensor, coordinate: int) -> torch.Tensor:
        if self.reduce_op in ("avg", "max", "min") or coordinate == 0:
            return x
        return torch.ones_like(x) if self.reduce_op == "product" else torch.zeros_like(x)

    def __repr__(self) -> str:
        return f"P({self.reduce_op})"


@dataclass(frozen=True, slots=True, repr=False)
class NormPartial(Partial):
    """Pending p-norm: the tensor is the p-norm over ranks of the ranks' p-norms.

    A Partial whose `reduce_op` is the plain reduction over ranks after raising to the p-th
    power (max for inf, min for -inf, sum otherwise), as torch's norm placement. A source
    only: no redistribution ends in it (the ops that make it are its only producers).
    """

    reduce_op: str = field(init=False, default="sum")
    norm_type: float = 2.0

    def __post_init__(self) -> None:
        p = float(self.norm_type)
        object.__setattr__(self, "norm_type", p)
        object.__setattr__(self, "reduce_op", "max" if p == math.inf else "min" if p == -math.inf else "sum")

    @property
    def combine_op(self) -> str:
        return self.reduce_op

    @property
    def reachable(self) -> bool:
        return False

    @property
    def _powered(self) -> bool:
        """Values travel as |x|^p (p-norms with p not in 0, 1, +-inf)."""
        q = self.norm_type
        return not (q in (0.0, 1.0) or math.isinf(q))

    def to_wire(self, x: torch.Tensor) -> torch.Tensor:
        if not self._powered:
            return x
        return x * x if self.norm_type == 2.0 else x.pow(self.norm_type)

    def from_wire(self, x: torch.Tensor) -> torch.Tensor:
        if not self._powered:
            return x
        return x.sqrt() if self.norm_type == 2.0 else x.pow(1.0 / self.norm_type)

    @property
    def neutral(self) -> float:
        """A value that changes no p-norm of p-norms: 0, or +inf where small values win (p < 0)."""
        return math.inf if self.norm_type < 0 else 0.0

    def split(self, x: torch.Tensor, coordinate: int) -> torch.Tensor:
        return x if coordinate == 0 else torch.full_like(x, self.neutral)

    def __repr__(self) -> str:
        p = self.norm_type
        return f"NormP({int(p) if p.is_integer() else p})"


def as_shard(p: Placement) -> Shard | StridedShard:
    """`p`, which the caller knows shards a dim (a plan's step, a checked layout), typed as such."""
    if not isinstance(p, (Shard, StridedShard)):
        raise TypeError(f"{p!r} is not a shard placement")
    return p


def as_partial(p: Placement) -> Partial:
    """`p`, which the caller knows is a pending reduction, typed as such."""
    if not isinstance(p, Partial):
        raise TypeError(f"{p!r} is not a Partial placement")
    return p


def reduce_values(values: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce equal-shaped tensors with a plain reduce op, in the given order (deterministic)."""
    out = values[0].clone()
    if op in ("sum", "avg"):
        for t in values[1:]:
            out = out + t
        if op == "avg":
            out = out / len(values) if out.is_floating_point() or out.is_complex() else out // len(values)
    elif op == "product":
        for t in values[1:]:
            out = out * t
    elif op == "max":
        for t in values[1:]:
            out = torch.maximum(out, t)
    elif op == "min":
        for t in values[1:]:
            out = torch.minimum(out, t)
    return out


def combine_stacked(stacked: torch.Tensor, op: str) -> torch.Tensor:
    """`reduce_values` over dim 0 of one stacked tensor (the ranks' values, in rank order)."""
    if op == "sum":
        return stacked.sum(0)
    if op == "product":
        return stacked.prod(0)
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    if op == "avg":
        return (
            stacked.mean(0)
            if stacked.is_floating_point() or stacked.is_complex()
            else stacked.sum(0) // stacked.shape[0]
        )
    raise ShardingError(f"unknown reduce op {op!r}; use one of {REDUCE_OPS}")


def without_partials(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """`placements` with every pending reduction read as Replicate: where a gradient, or a resolved value, lives."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


# ---------------------------------------------------------------- layout math


def chunk_size_and_offset(length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Size and start of chunk `index` when `length` is split like torch.chunk.

    torch.chunk makes ceil(length/num_chunks)-sized chunks and may make fewer than
    num_chunks of them; the missing trailing chunks are empty and sit at the end.
    """
    full = -(-length // num_chunks) if num_chunks else 0
    start = min(full * index, length)
    end = min(full * (index + 1), length)
    return end - start, start


def shard_positions(placement: Placement, length: int, num_chunks: int, index: int) -> range | list[int]:
    """Positions (within a dim of `length`) that chunk `index` of `placement` holds."""
    if isinstance(placement, StridedShard):
        positions: list[int] = []
        for piece in range(placement.split_factor):
            psize, pstart = chunk_size_and_offset(length, placement.split_factor, piece)
            csize, cstart = chunk_size_and_offset(psize, num_chunks, index)
            positions.extend(range(pstart + cstart, pstart + cstart + csize))
        return positions
    size, start = chunk_size_and_offset(length, num_chunks, index)
    return range(start, start + size)


def dim_positions(
    global_size: int,
    tensor_dim: int,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    upto: int | None = None,
) -> range | list[int]:
    """Global indices of `tensor_dim` held at `coordinate`, nesting mesh dims left to right.

    `upto` stops after that many mesh dims (the layout seen by mesh dims < upto).
    """
    positions: range | list[int] = range(global_size)
    for mesh_dim, p in enumerate(placements[:upto]):
        if p.is_shard(tensor_dim):
            local = shard_positions(p, len(positions), mesh_shape[mesh_dim], coordinate[mesh_dim])
            positions = (
                positions[local.start : local.stop] if isinstance(local, range) else [positions[i] for i in local]
            )
    return positions


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape at `coordinate` and the global offset of its first element.

    Empty shards report the dim's global size as offset, as torch does.
    """
    shape = list(global_shape)
    offset = [0] * len(global_shape)
    for d in {p.dim for p in placements if isinstance(p, (Shard, StridedShard))}:
        pos = dim_positions(global_shape[d], d, mesh_shape, coordinate, placements)
        shape[d] = len(pos)
        offset[d] = pos[0] if len(pos) else global_shape[d]
    return tuple(shape), tuple(offset)


def normalize_placements(
    placements: Sequence[Placement], ndim: int, mesh_ndim: int, what: str = "placements"
) -> tuple[Placement, ...]:
    """Check placements against a tensor of `ndim` dims on a mesh of `mesh_ndim` dims.

    Negative shard dims are wrapped. Raises ShardingError naming the problem.
    """
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ShardingError(
            f"{what}: got {len(placements)} placements {list(placements)} for a mesh of "
            f"{mesh_ndim} dim(s); give exactly one placement per mesh dim."
        )
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise ShardingError(f"{what}: {p!r} is not a placement; use Shard(d), Replicate() or Partial().")
        if isinstance(p, (Shard, StridedShard)):
            d = p.dim
            if not -ndim <= d < ndim or ndim == 0:
                raise ShardingError(
                    f"{what}: {p!r} shards dim {d}, but the tensor has {ndim} dim(s); "
                    f"shard a dim in [-{ndim}, {ndim}) or use Replicate()."
                )
            if d < 0:
                p = StridedShard(d + ndim, p.split_factor) if isinstance(p, StridedShard) else Shard(d + ndim)
        out.append(p)
    kinds = {p for p in out if p.is_partial()}
    if len(kinds) > 1:
        raise ShardingError(
            f"{what}: mixed pending reductions {sorted(map(repr, kinds))} in {list(out)}; their order would be "
            "ambiguous. Resolve one first (redistribute it to Replicate or Shard)."
        )
    return tuple(out)
