"""var / std / var_mean / std_mean on every layout against single-device torch, the one-round Chan
merge (bytes, rounds, accuracy for data with a large mean), and the local backward."""

from __future__ import annotations

import pytest
import torch

import shardops as so
from algo_harness import latency_only_links, run_case  # noqa: F401  (fixture)
from reduction_harness import Grid, Op, check_bad_dim_refused
from shardops import Replicate, Shard

f64, f32 = torch.float64, torch.float32

OPS = [
    # every python form: dim / dims / all, keepdim, negative dims, correction (int, float, 0), unbiased
    Op("var_dim1", lambda x: x.var(1), grad=True),
    Op("var_dim0_keepdim", lambda x: torch.var(x, 0, keepdim=True), grad=True),
    Op("var_all", lambda x: x.var(), grad=True),
    Op("var_dims01_correction0", lambda x: torch.var(x, (0, 1), correction=0), grad=True),
    Op("var_dim-1_unbiased_false", lambda x: x.var(-1, unbiased=False), grad=True),
    Op("var_positional_unbiased_keepdim", lambda x: torch.var(x, [-2], True, True), grad=True),
    Op("var_unbiased_only", lambda x: x.var(False), grad=True),
    Op("var_correction2.5", lambda x: x.var(0, correction=2.5), grad=True),
    Op("var_f32", lambda x: x.var(1), dtype=f32, grad=True),
    Op("var_nan", lambda x: x.var(0), data="nan"),
    Op("std_dim1", lambda x: torch.std(x, 1), grad=True),
    Op("std_dim0_keepdim", lambda x: x.std(0, keepdim=True), grad=True),
    Op("std_all_correction0", lambda x: x.std(correction=0), grad=True),
    Op("std_const_is_zero", lambda x: x.std(1), data="const", grad=True),  # torch's gradient is 0 where std is 0
    Op("std_f32_dims", lambda x: torch.std(x, (0, 1)), dtype=f32, grad=True),
    Op("var_mean_dim1", lambda x: torch.var_mean(x, 1), grad=True),
    Op("var_mean_dims_keepdim", lambda x: torch.var_mean(x, (-1, 0), keepdim=True, correction=0), grad=True),
    Op("std_mean_dim0", lambda x: torch.std_mean(x, 0), grad=True),
    Op("std_mean_all_unbiased_false", lambda x: torch.std_mean(x, unbiased=False), grad=True),
    # aten overloads called directly take the same local backward
    Op("aten_var_default", lambda x: torch.ops.aten.var.default(x, False), grad=True),
    Op(
        "aten_var_correction_keepdim",
        lambda x: torch.ops.aten.var.correction(x, [1], correction=0, keepdim=True),
        grad=True,
    ),
    Op("aten_std_dim", lambda x: torch.ops.aten.std.dim(x, [0]), grad=True),
    Op("aten_std_mean_dim", lambda x: torch.ops.aten.std_mean.dim(x, [-1], True, True), grad=True),
    Op("aten_var_mean_correction", lambda x: torch.ops.aten.var_mean.correction(x, None, correction=2), grad=True),
]
GRID = Grid(OPS)


test_moments_sample, test_moments_grid = GRID.tests("test_moments", per_op=3, seed=6)


# ------------------------------------------------------------------ the Chan merge itself: uneven, empty, nested

ALGO_CASES = [
    # (id, mesh, layout, shape, fn, output layout)
    ("var-mesh4-empty", (4,), [Shard(1)], (3, 9), lambda x: x.var(1), (Replicate(),)),
    ("std-mesh4-uneven-keepdim", (4,), [Shard(0)], (10, 3), lambda x: x.std(0, keepdim=True), (Replicate(),)),
    ("var_mean-mesh4-all", (4,), [Shard(1)], (3, 9), lambda x: torch.var_mean(x), (Replicate(),)),
    (
        "var-nested-empty",
        (2, 2),
        [Shard(1), Shard(1)],
        (4, 3),
        lambda x: x.var(1, correction=0),
        (Replicate(), Replicate()),
    ),
    (
        "std_mean-2d-both-reduced",
        (2, 2),
        [Shard(0), Shard(1)],
        (3, 5),
        lambda x: torch.std_mean(x, (0, 1)),
        (Replicate(), Replicate()),
    ),
    ("var-2d-kept-shard", (2, 2), [Shard(1), Shard(0)], (6, 7), lambda x: x.var(1), (Replicate(), Shard(0))),
]


@pytest.mark.parametrize("case,mesh_shape,placements,shape,fn,want", ALGO_CASES, ids=[c[0] for c in ALGO_CASES])
@pytest.mark.usefixtures("latency_only_links")
def test_chan_merge_one_round(case, mesh_shape, placements, shape, fn, want):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=f64)
    got = run_case(fn, full, mesh_shape, placements)
    assert all(pl == want for pl in got.layouts)
    assert (got.rounds, got.counts) == (
        1,
        {"all_gather": 1},
    )  # one gather over every mesh dim that shards a reduced dim
    assert got.grad_layout == tuple(placements)


def test_var_of_an_empty_reduction_is_nan_like_torch():
    full = torch.zeros(4, 0, dtype=f64)
    got = run_case(lambda x: torch.var_mean(x, 1), full, (4,), [Shard(0)], grad=False)
    assert got.layouts[0] == (Shard(0),)


# ------------------------------------------------------------ bytes, rounds, accuracy (mesh (4,), f32[8, 4096] on S(1))

ROWS, COLS, RANKS = 8, 4096, 4
STATS_PER_ROW = 2 * 8  # (mean, M2) in float64


def _moment_comm(fn, full):
    """(bytes with full_tensor, rounds of the op alone, output layout, full result)."""

    def body():
        mesh = so.init_device_mesh("cpu", (RANKS,))
        x = so.distribute_tensor(full, mesh, [Shard(1)])
        with so.CommDebugMode() as op_only:
            y = fn(x)
        ys = list(y) if isinstance(y, tuple) else [y]
        with so.CommDebugMode() as with_full:
            y = fn(x)
            ys = list(y) if isinstance(y, tuple) else [y]
            fulls = [t.full_tensor() for t in ys]
        return with_full.get_total_bytes(), op_only.get_rounds(), tuple(ys[0].placements), fulls

    results = so.run(body, RANKS)
    assert len({r[0] for r in results}) == 1
    return results[0]


@pytest.fixture(scope="module")
def large_mean():
    return 1e4 + torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    "name,fn,ref",
    [
        ("var", lambda x: x.var(1), lambda x: x.var(1)),
        ("std", lambda x: x.std(1), lambda x: x.std(1)),
        ("var_mean", lambda x: torch.var_mean(x, 1), lambda x: torch.var_mean(x, 1)),
        ("std_mean", lambda x: torch.std_mean(x, 1, correction=0), lambda x: torch.std_mean(x, 1, correction=0)),
    ],
)
def test_moments_one_round_small_bytes_and_accurate(large_mean, name, fn, ref):
    nbytes, rounds, layout, fulls = _moment_comm(fn, large_mean)
    # one all_gather of (mean, M2) per row; the Replicate output needs nothing more for full_tensor()
    assert (nbytes, rounds, layout) == (ROWS * STATS_PER_ROW, 1, (Replicate(),))
    assert nbytes <= 1024
    want = ref(large_mean.double())
    wants = list(want) if isinstance(want, tuple) else [want]
    stat = fulls[0].double()
    rel = ((stat - wants[0]).abs() / wants[0].abs()).max().item()
    assert rel <= 1e-6, f"{name}: relative error {rel:.2e} vs float64 torch"
    if len(fulls) > 1:
        torch.testing.assert_close(fulls[1].double(), wants[1], rtol=1e-6, atol=0)


def test_backward_is_local():
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5), dtype=f64)

    def body():
        mesh = so.init_device_mesh("cpu", (RANKS,))
        x = so.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
        var, mean = torch.var_mean(x, 1)
        std = x.std(1)
        grads = [so.distribute_tensor(torch.full((ROWS,), v, dtype=f64), mesh, [Replicate()]) for v in (0.5, 2.0, -1.0)]
        with so.CommDebugMode() as comm:
            torch.autograd.backward([var, mean, std], grads)
        return comm.get_total_counts(), tuple(x.grad.placements), x.grad.full_tensor()

    counts, layout, got = so.run(body, RANKS)[0]
    x = full.clone().requires_grad_()
    var, mean = torch.var_mean(x, 1)
    torch.autograd.backward([var, mean, x.std(1)], [torch.full((ROWS,), v, dtype=f64) for v in (0.5, 2.0, -1.0)])
    torch.testing.assert_close(got, x.grad, rtol=1e-10, atol=1e-10)
    assert (counts, layout) == (0, (Shard(1),))


@pytest.mark.parametrize(
    "call", [lambda x: x.var(-3), lambda x: torch.std_mean(x, 2), lambda x: torch.var(x, (0, 7), correction=0)]
)
def test_bad_dim_is_a_sharding_error(call):
    check_bad_dim_refused(call, r"dim .* out of range")


@pytest.mark.parametrize(
    "name,fn",
    [
        ("every dim, dof 0: nan where x is the mean", lambda x: x.var(correction=4)),
        ("every dim, dof < 0: inf", lambda x: x.std(correction=7)),
        ("dim list, dof < 0: divides as it is", lambda x: x.var((0, 1), correction=6)),
        ("dim, dof 0", lambda x: torch.var_mean(x, 1, correction=2)),
    ],
)
def test_gradient_when_correction_exceeds_the_count_is_torchs(name, fn):
    full = torch.tensor([[1.0, 3.0], [2.0, 2.0]], dtype=f64)
    outcome = run_case(fn, full, (4,), [Shard(1)])  # compares values and gradients (NaN/inf where torch has them)
    assert outcome.grad_layout == (Shard(1),)
