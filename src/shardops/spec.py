"""TensorMeta and TensorSpec: what dispatch knows about a DTensor without its data."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .placements import Placement, local_shape_and_offset

if TYPE_CHECKING:
    from .mesh import DeviceMesh


@dataclass(frozen=True, slots=True)
class TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A global tensor's metadata and its layout on a mesh."""

    mesh: "DeviceMesh"
    placements: tuple[Placement, ...]
    meta: TensorMeta

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def ndim(self) -> int:
        return len(self.meta.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.meta.shape)

    @property
    def itemsize(self) -> int:
        return self.meta.dtype.itemsize

    def local_shape(self, coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
        if coordinate is None:
            coordinate = self.mesh.get_coordinate()
        return local_shape_and_offset(self.shape, self.mesh.shape, coordinate, self.placements)[0]

    def shard_count(self, tensor_dim: int) -> int:
        """How many pieces `tensor_dim` is cut into across the mesh."""
        return math.prod(n for n, p in zip(self.mesh.shape, self.placements) if p.is_shard(tensor_dim))

    def with_placements(self, placements: Sequence[Placement]) -> "TensorSpec":
        return TensorSpec(self.mesh, tuple(placements), self.meta)

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{dt}{list(self.shape)}:{','.join(map(repr, self.placements))}"


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))
