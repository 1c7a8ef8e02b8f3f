"""Layout math against torch.distributed.tensor's own functions."""

import math
import random

import pytest
import torch
from torch.distributed.tensor import Replicate as TR
from torch.distributed.tensor import Shard as TS
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard as TSS

import shardops as so
from shardops.placements import chunk_size_and_offset, local_shape_and_offset, normalize_placements


def _torch(p):
    if isinstance(p, so.StridedShard):
        return TSS(p.dim, split_factor=p.split_factor)
    if isinstance(p, so.Shard):
        return TS(p.dim)
    return TR()


def _random_case(rng: random.Random):
    mesh_shape = rng.choice([(1,), (2,), (3,), (4,), (8,), (2, 2), (2, 3), (3, 2), (2, 2, 2)])
    ndim = rng.randint(1, 3)
    shape = tuple(rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 9, 16]) for _ in range(ndim))
    opts = (
        [so.Replicate()]
        + [so.Shard(d) for d in range(ndim)]
        + [so.StridedShard(d, rng.choice([2, 3])) for d in range(ndim)]
    )
    placements = tuple(rng.choice(opts) for _ in mesh_shape)
    coord = tuple(rng.randrange(n) for n in mesh_shape)
    return shape, mesh_shape, placements, coord


@pytest.mark.parametrize("seed", range(10))
def test_local_shape_and_offset_match_torch(seed):
    rng = random.Random(seed)
    for _ in range(100):
        shape, mesh_shape, placements, coord = _random_case(rng)
        ours = local_shape_and_offset(shape, mesh_shape, coord, placements)
        theirs = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), [_torch(p) for p in placements])
        assert ours[0] == tuple(theirs[0]), (shape, mesh_shape, placements, coord)
        # torch reports the first offset of strided shards too; for non-empty shards the offsets agree
        if math.prod(ours[0]) > 0:
            assert ours[1] == tuple(theirs[1]), (shape, mesh_shape, placements, coord)


@pytest.mark.parametrize(
    "length,n,expected",
    [
        (10, 4, [3, 3, 3, 1]),
        (5, 4, [2, 2, 1, 0]),
        (2, 4, [1, 1, 0, 0]),
        (0, 3, [0, 0, 0]),
        (8, 4, [2, 2, 2, 2]),
        (6, 4, [2, 2, 2, 0]),
    ],
    ids=lambda v: str(v),
)
def test_chunk_sizes_like_torch_chunk(length, n, expected):
    sizes = [chunk_size_and_offset(length, n, i)[0] for i in range(n)]
    assert sizes == expected
    torch_sizes = [c.shape[0] for c in torch.arange(length).chunk(n)] + [0] * n
    assert sizes == torch_sizes[:n]


def test_placements_are_frozen_hashable_with_short_reprs():
    assert {so.Shard(1), so.Shard(1), so.Replicate()} == {so.Shard(1), so.Replicate()}
    assert [
        repr(p) for p in (so.Shard(1), so.Replicate(), so.Partial("max"), so.NormPartial(2), so.StridedShard(0, 2))
    ] == ["S(1)", "R", "P(max)", "NormP(2)", "_S(0,2)"]
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError is one
        so.Shard(1).dim = 2  # type: ignore[misc, unused-ignore]  # frozen; checked only where untyped bodies are
    assert so.Partial().is_partial("sum") and so.Shard(0).is_shard(0) and not so.Shard(0).is_shard(1)


@pytest.mark.parametrize("sf", [0, -1])
def test_bad_split_factor(sf):
    with pytest.raises(so.ShardingError, match="split_factor"):
        so.StridedShard(0, sf)


def test_bad_reduce_op():
    with pytest.raises(so.ShardingError, match="reduce op"):
        so.Partial("median")


def test_placements_length_must_match_mesh():
    with pytest.raises(so.ShardingError, match="one placement per mesh dim"):
        normalize_placements([so.Shard(0)], ndim=2, mesh_ndim=2)
    with pytest.raises(so.ShardingError, match="one placement per mesh dim"):
        normalize_placements([so.Shard(0)] * 3, ndim=2, mesh_ndim=2)


def test_shard_dim_out_of_range():
    with pytest.raises(so.ShardingError, match="shards dim 2"):
        normalize_placements([so.Shard(2)], ndim=2, mesh_ndim=1)
    assert normalize_placements([so.Shard(-1)], ndim=2, mesh_ndim=1) == (so.Shard(1),)
