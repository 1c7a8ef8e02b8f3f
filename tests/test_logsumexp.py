"""logsumexp on every layout against single-device torch; the one-round merge of (shift, sum) pairs
on uneven and empty shards with extreme values; bytes; the local backward."""

from __future__ import annotations

import math

import pytest
import torch

import shardops as so
from algo_harness import latency_only_links, run_case  # noqa: F401  (fixture)
from reduction_harness import Grid, Op, check_bad_dim_refused
from shardops import Replicate, Shard

f64, f32 = torch.float64, torch.float32
INF = math.inf

OPS = [
    Op("lse_dim1", lambda x: torch.logsumexp(x, 1), grad=True),
    Op("lse_dim0_keepdim", lambda x: x.logsumexp(0, keepdim=True), grad=True),
    Op("lse_dims01", lambda x: torch.logsumexp(x, (0, 1)), grad=True),
    Op("lse_dims_list_keepdim", lambda x: x.logsumexp([-1, -2], keepdim=True), grad=True),
    Op("lse_dim-1_f32", lambda x: torch.logsumexp(x, -1), dtype=f32, grad=True),
    Op("lse_nan", lambda x: torch.logsumexp(x, 0), data="nan", grad=True),
    Op("lse_int", lambda x: torch.logsumexp(x, 1), data="int", dtype=torch.int64),
    Op("aten_lse", lambda x: torch.ops.aten.logsumexp.default(x, [1], True), grad=True),
]
GRID = Grid(OPS)


test_logsumexp_sample, test_logsumexp_grid = GRID.tests("test_logsumexp", per_op=4, seed=8)


# ------------------------------------------------------------------ the merge: extreme rows, uneven and empty shards


def _extreme_rows(cols: int) -> torch.Tensor:
    """Rows torch handles specially: a max near 1e4, near -1e4, all -inf, some -inf, a +inf, a NaN."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, cols, generator=g, dtype=f64)
    x[0] += 1e4
    x[1] -= 1e4
    x[2] = -INF
    x[3, ::2] = -INF
    x[4, cols // 2] = INF
    x[5, 1] = math.nan
    return x


ALGO_CASES = [
    # (id, mesh, layout, cols, dims): 9 = 3+3+3+0 and (1+1)+(1+0) for 3 nested
    ("mesh4-empty", (4,), [Shard(1)], 9, 1),
    ("mesh4-uneven", (4,), [Shard(1)], 10, 1),
    ("nested-empty", (2, 2), [Shard(1), Shard(1)], 3, 1),
    ("both-dims", (2, 2), [Shard(0), Shard(1)], 9, (0, 1)),
    ("kept-shard", (2, 2), [Shard(1), Shard(0)], 9, 1),
]


@pytest.mark.parametrize("case,mesh_shape,placements,cols,dims", ALGO_CASES, ids=[c[0] for c in ALGO_CASES])
@pytest.mark.usefixtures("latency_only_links")
def test_merge_of_extreme_rows_one_round(case, mesh_shape, placements, cols, dims):
    full = _extreme_rows(cols)
    finite = full[[0, 1, 3, 6]]  # gradients where torch's are finite
    for x, grad in ((full, False), (finite, True)):
        got = run_case(lambda t: torch.logsumexp(t, dims), x, mesh_shape, placements, grad=grad)
        want = tuple(
            q if not (q.is_shard() and q.dim in ((dims,) if isinstance(dims, int) else dims)) else Replicate()
            for q in placements
        )
        want = tuple(Shard(0) if q == Shard(0) and dims == 1 else q for q in want)
        assert got.layouts == [want]
        assert (got.rounds, got.counts) == (1, {"all_gather": 1})
        if grad:
            assert got.grad_layout == tuple(placements)


# ------------------------------------------------------------------ bytes (mesh (4,), x = f32[8, 4096] on S(1))

ROWS, COLS, RANKS = 8, 4096, 4


def test_bytes_rounds_and_local_backward():
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5)) * 30

    def body():
        mesh = so.init_device_mesh("cpu", (RANKS,))
        x = so.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
        with so.CommDebugMode() as op_only:
            y = torch.logsumexp(x, 1)
        with so.CommDebugMode() as with_full:
            value = torch.logsumexp(x, 1).full_tensor()
        g = so.distribute_tensor(torch.linspace(-1, 1, ROWS), mesh, [Replicate()])
        with so.CommDebugMode() as backward:
            y.backward(g)
        return (
            (op_only.get_rounds(), tuple(y.placements), with_full.get_total_bytes(), with_full.get_comm_counts()),
            backward.get_total_counts(),
            tuple(x.grad.placements),
            value,
            x.grad.full_tensor(),
        )

    forward, backward_counts, grad_layout, value, grad = so.run(body, RANKS)[0]
    # one all_gather of a (shift, sum) pair of f32 per row; the Replicate result needs nothing more
    assert forward == (1, (Replicate(),), ROWS * 2 * 4, {"all_gather": 1})
    assert ROWS * 2 * 4 <= 1024
    x = full.clone().requires_grad_()
    want = torch.logsumexp(x, 1)
    want.backward(torch.linspace(-1, 1, ROWS))
    torch.testing.assert_close(value, want.detach())
    torch.testing.assert_close(grad, x.grad)
    assert (backward_counts, grad_layout) == (0, (Shard(1),))  # grad * exp(x - lse): local


@pytest.mark.parametrize("call", [lambda x: torch.logsumexp(x, 2), lambda x: x.logsumexp((0, -3))])
def test_bad_dim_is_a_sharding_error(call):
    check_bad_dim_refused(call, r"logsumexp: dim .* out of range")
