"""TensorMeta and TensorSpec: what dispatch knows about a DTensor without its data."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from . import caches
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

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    meta: TensorMeta
    # A small int naming (mesh, placements, shape, stride, dtype): the dispatch cache keys on it, so a
    # cache hit hashes ints, not meshes and placements. Equal specs share it (while the table holds them).
    key: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "key", _spec_id((self.mesh, self.placements, self.meta.shape, self.meta.stride, self.meta.dtype))
        )

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
            coordinate = self.mesh.get_coordinate() or ()  # () off the mesh: an unsharded layout needs none
        return local_shape_and_offset(self.shape, self.mesh.shape, coordinate, self.placements)[0]

    def shard_count(self, tensor_dim: int) -> int:
        """How many pieces `tensor_dim` is cut into across the mesh."""
        return math.prod(n for n, p in zip(self.mesh.shape, self.placements) if p.is_shard(tensor_dim))

    def with_placements(self, placements: Sequence[Placement]) -> TensorSpec:
        return TensorSpec(self.mesh, tuple(placements), self.meta)

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{dt}{list(self.shape)}:{','.join(map(repr, self.placements))}"


_SPEC_IDS: dict[tuple, int] = {}
_NEXT_ID = itertools.count()
MAX_SPEC_IDS = 1 << 16  # bounds the table; when full it starts again (ids are never reused, so no key collides)
caches.register("spec ids", _SPEC_IDS.clear)  # a spec seen again gets a fresh id: later keys simply miss


def _spec_id(k: tuple) -> int:
    i = _SPEC_IDS.get(k)
    if i is None:
        if len(_SPEC_IDS) >= MAX_SPEC_IDS:
            _SPEC_IDS.clear()
        i = _SPEC_IDS.setdefault(k, next(_NEXT_ID))
    return i


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))
