"""median, nanmedian, kthvalue and mode on every layout against single-device torch."""

from __future__ import annotations

import pytest
import torch

import shardops as so
from reduction_harness import Grid, Op
from shardops import Shard

OPS = [
    Op("median", lambda x: x.median(), data="ties", grad=True),
    Op("median_nan", lambda x: torch.median(x), data="nan", grad=True, partial_ok=False),
    Op("median_dim0", lambda x: x.median(0), data="ties", grad=True),
    Op("median_dim1_keepdim", lambda x: torch.median(x, 1, keepdim=True), data="nan", grad=True, partial_ok=False),
    Op("median_int_dim-1", lambda x: x.median(-1), data="int", dtype=torch.int64),
    Op("nanmedian", lambda x: x.nanmedian(), data="nan", grad=True, partial_ok=False),
    Op("nanmedian_dim0", lambda x: torch.nanmedian(x, 0), data="nan", grad=True, partial_ok=False),
    Op("nanmedian_dim-1_keepdim", lambda x: x.nanmedian(-1, keepdim=True), data="ties", grad=True),
    Op(
        "kthvalue_k1_dim0", lambda x: torch.kthvalue(x, 1, 0), data="ties", grad=True, shapes=("even", "uneven", "tiny")
    ),
    Op("kthvalue_k2_last", lambda x: x.kthvalue(2), data="ties", grad=True),
    Op("kthvalue_k3_dim1_keepdim", lambda x: torch.kthvalue(x, 3, 1, keepdim=True), data="randn", grad=True),
    Op("kthvalue_int", lambda x: x.kthvalue(2, 0), data="int", dtype=torch.int64),
    Op("mode_last", lambda x: x.mode(), data="ties", grad=True),
    Op("mode_dim0_keepdim", lambda x: torch.mode(x, 0, keepdim=True), data="ties", grad=True),
    Op("mode_int_dim1", lambda x: x.mode(1), data="int", dtype=torch.int64),
]
GRID = Grid(OPS)


test_order_stat_sample, test_order_stat_grid = GRID.tests("test_order_stat", per_op=6, seed=5)


def _comm(fn, full, placements, mesh_shape=(4,)):
    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(full, mesh, placements)
        with so.CommDebugMode() as comm:
            out = fn(x)
        return comm.get_comm_counts(), comm.get_total_bytes(), [tuple(o.placements) for o in out]

    return so.run(body, 4)[0]


def test_median_over_sharded_dim_moves_a_quarter_of_a_gather():
    # S(1) -> S(0) by all_to_all sends 3/4 of the local shard; a gather would send all of it to 3 ranks
    full = torch.randn(8, 4096, generator=torch.Generator().manual_seed(1))
    counts, nbytes, layouts = _comm(lambda x: x.median(1), full, [Shard(1)])
    local = 8 * 1024 * 4
    assert counts == {"all_to_all": 1}
    assert nbytes == local * 3 // 4
    assert layouts == [(Shard(0),), (Shard(0),)]


def test_kthvalue_over_kept_sharded_dim_moves_nothing():
    full = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    counts, nbytes, layouts = _comm(lambda x: x.kthvalue(3, 1), full, [Shard(0)])
    assert (counts, nbytes) == ({}, 0)
    assert layouts == [(Shard(0),), (Shard(0),)]


@pytest.mark.parametrize(
    "call,pattern",
    [
        (lambda x: x.median(2), r"^median: dim 2 is out of range"),
        (lambda x: torch.nanmedian(x, -3), r"^nanmedian: dim -3 is out of range"),
        (lambda x: torch.kthvalue(x, 9, 0), r"^kthvalue: k=9 is out of range"),
        (lambda x: x.mode(4), r"^mode: dim 4 is out of range"),
    ],
    ids=["median", "nanmedian", "kthvalue-k", "mode"],
)
def test_bad_arguments_raise_sharding_error_naming_op(call, pattern):
    full = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        call(so.distribute_tensor(full, mesh, [Shard(1)]))

    with pytest.raises(so.ShardingError, match=pattern):
        so.run(body, 4)
