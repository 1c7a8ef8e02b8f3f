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
from dataclasses import dataclass
from typing import Sequence

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
    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ShardingError(
                f"Partial(reduce_op={self.reduce_op!r}): unknown reduce op; use one of {REDUCE_OPS}."
            )

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def __repr__(self) -> str:
        return f"P({self.reduce_op})"


@dataclass(frozen=True, slots=True)
class NormPartial(Placement):
    """Pending p-norm: the tensor is the p-norm over ranks of the ranks' p-norms."""

    norm_type: float = 2.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "norm_type", float(self.norm_type))

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.combine_op

    @property
    def combine_op(self) -> str:
        """The plain reduction over ranks after raising to the p-th power."""
        p = self.norm_type
        if p == math.inf:
            return "max"
        if p == -math.inf:
            return "min"
        return "sum"

    def __repr__(self) -> str:
        p = self.norm_type
        return f"NormP({int(p) if p.is_integer() else p})"


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
            positions = positions[local.start : local.stop] if isinstance(local, range) else [positions[i] for i in local]
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
    for d in {p.dim for p in placements if p.is_shard()}:
        pos = dim_positions(global_shape[d], d, mesh_shape, coordinate, placements)
        shape[d] = len(pos)
        offset[d] = pos[0] if len(pos) else global_shape[d]
    return tuple(shape), tuple(offset)


def normalize_placements(placements: Sequence[Placement], ndim: int, mesh_ndim: int, what: str = "placements") -> tuple[Placement, ...]:
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
        if p.is_shard():
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
