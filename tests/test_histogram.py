"""histc on every layout against single-device torch (exact bin counts), and its byte counts."""

from __future__ import annotations

import pytest
import torch

import shardops as so
from reduction_harness import Grid, Op, check_case
from shardops import Partial, Shard

OPS = [
    Op("histc_auto", lambda x: torch.histc(x, bins=10), partial_ok=False),
    # integer-valued data: many elements sit exactly on bin edges and on the max
    Op("histc_auto_edges", lambda x: x.histc(bins=6), data="edges", partial_ok=False),
    Op("histc_auto_f32", lambda x: torch.histc(x, bins=7), dtype=torch.float32, partial_ok=False),
    Op("histc_bounds", lambda x: torch.histc(x, bins=5, min=-1, max=1)),
    Op("histc_bounds_edges", lambda x: x.histc(4, -2, 2), data="edges"),
    Op("histc_equal_bounds", lambda x: torch.histc(x, bins=3, min=2, max=2), data="edges", partial_ok=False),
    # every value equal: torch widens the empty range to [v - 1, v + 1]
    Op("histc_constant", lambda x: torch.histc(x, bins=4), data="const", partial_ok=False),
]
GRID = Grid(OPS)


test_histc_sample, test_histc_grid = GRID.tests("test_histc", per_op=8, seed=6)


def test_histc_of_empty_tensor():
    check_case(Op("histc_empty", lambda x: torch.histc(x, bins=4)), (4,), (Shard(0),), (0, 3))


def _bytes(fn, full, placements, mesh_shape=(4,)):
    """Bytes this rank puts into collectives for histc AND the full_tensor() of the histogram."""

    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(full, mesh, placements)
        with so.CommDebugMode() as comm:
            out = fn(x)
            hist = out.full_tensor()
        return comm.get_total_bytes(), comm.get_comm_counts(), tuple(out.placements), hist

    nbytes, counts, layout, hist = so.run(body, 4)[0]
    assert torch.equal(hist, fn(full))
    return nbytes, counts, layout


BINS = 10
RANGE_BYTES = 2 * 4  # each rank's (min, max) as f32
HIST_BYTES = BINS * 4  # the pending f32 histogram, all-reduced by full_tensor


def test_histc_without_bounds_moves_range_and_counts_only():
    # x = f32[8, 4096] on S(1), mesh (4,): one gather of each rank's (min, max), then the pending histogram's
    # all_reduce in full_tensor; gathering the 32 KiB shards instead would make every rank bin all 128 KiB
    full = torch.randn(8, 4096, generator=torch.Generator().manual_seed(9))
    fn = lambda x: torch.histc(x, bins=BINS)  # noqa: E731
    assert _bytes(fn, full, [Shard(1)]) == (
        RANGE_BYTES + HIST_BYTES,
        {"all_gather": 1, "all_reduce": 1},
        (Partial("sum"),),
    )


def test_histc_with_bounds_moves_counts_only():
    full = torch.randn(8, 4096, generator=torch.Generator().manual_seed(10))
    fn = lambda x: torch.histc(x, bins=BINS, min=-2, max=2)  # noqa: E731
    assert _bytes(fn, full, [Shard(1)]) == (HIST_BYTES, {"all_reduce": 1}, (Partial("sum"),))


def test_histc_nan_raises_like_torch():
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    full[7, 5] = float("nan")  # on the last rank only: every rank must still raise, none may hang

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        torch.histc(so.distribute_tensor(full, mesh, [Shard(0)]), bins=4)

    with pytest.raises(RuntimeError, match="not finite"):
        so.run(body, 4)
