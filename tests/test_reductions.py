"""Linear reductions and arg-reductions on every layout against single-device torch, plus their byte counts."""

from __future__ import annotations

import pytest
import torch

import shardops as so
from reduction_harness import Grid, Op, check_case
from shardops import NormPartial, Partial, Replicate, Shard, StridedShard

f64, f32 = torch.float64, torch.float32

OPS = [
    # sum / nansum / prod / mean / nanmean, every overload: default, dim, dim list, keepdim, negative dims, dtype=
    Op("sum", lambda x: x.sum(), grad=True),
    Op("sum_dim0", lambda x: torch.sum(x, 0), grad=True),
    Op("sum_dim-1_keepdim", lambda x: x.sum(-1, keepdim=True), grad=True),
    Op("sum_dims01", lambda x: torch.sum(x, (0, 1)), grad=True),
    Op("sum_dims_empty_keepdim", lambda x: torch.sum(x, [], keepdim=True), grad=True),
    Op("sum_dtype_f32", lambda x: x.sum(1, dtype=torch.float32), grad=True),
    Op("sum_int", lambda x: x.sum(0), data="int", dtype=torch.int64),
    Op("sum_bool", lambda x: x.sum(), data="bool", partial_ok=False),
    Op("nansum", lambda x: x.nansum(), data="nan", grad=True),
    Op("nansum_dim1_keepdim", lambda x: torch.nansum(x, 1, keepdim=True), data="nan", grad=True),
    Op("prod", lambda x: x.prod(), data="pos", grad=True),
    Op("prod_dim0", lambda x: torch.prod(x, 0), data="pos", grad=True),
    Op("prod_dim-1_keepdim", lambda x: x.prod(-1, keepdim=True), data="pos", grad=True),
    Op("prod_zeros_nan", lambda x: x.prod(), data="nan", grad=True, partial_ok=False),
    Op("prod_int", lambda x: x.prod(1), data="int", dtype=torch.int64),
    Op("mean", lambda x: x.mean(), grad=True),
    Op("mean_dim0", lambda x: torch.mean(x, 0), grad=True),
    Op("mean_dim1_keepdim", lambda x: x.mean(1, keepdim=True), grad=True),
    Op("mean_dims-2-1", lambda x: x.mean((-2, -1)), grad=True),
    Op("mean_f32_dtype_f64", lambda x: x.mean(0, dtype=torch.float64), dtype=f32, grad=True),
    Op("mean_f32", lambda x: x.mean(1), dtype=f32, grad=True),
    Op("nanmean", lambda x: x.nanmean(), data="nan", grad=True, partial_ok=False),
    Op("nanmean_dim0_keepdim", lambda x: torch.nanmean(x, 0, keepdim=True), data="nan", grad=True, partial_ok=False),
    # extremes
    Op("amax", lambda x: x.amax(), data="ties", grad=True),
    Op("amax_dim0", lambda x: torch.amax(x, 0), data="ties", grad=True),
    Op("amin_dims01_keepdim", lambda x: x.amin((0, 1), keepdim=True), data="ties", grad=True),
    Op("amin_dim-1", lambda x: torch.amin(x, -1), data="nan", grad=True),
    Op("amax_int", lambda x: x.amax(1), data="int", dtype=torch.int64),
    Op("max", lambda x: x.max(), data="ties", grad=True),
    Op("min_nan", lambda x: torch.min(x), data="nan", grad=True),
    Op("max_dim0", lambda x: x.max(0), data="ties", grad=True),
    Op("max_dim1_keepdim", lambda x: torch.max(x, 1, keepdim=True), data="ties", grad=True),
    Op("min_dim-1", lambda x: x.min(-1), data="ties", grad=True),
    Op("min_dim0_nan", lambda x: torch.min(x, 0), data="nan", grad=True),
    Op("max_dim0_int", lambda x: x.max(0), data="int", dtype=torch.int64),
    Op("max_dim1_bool", lambda x: x.max(1), data="bool", partial_ok=False),
    Op("aminmax", lambda x: torch.aminmax(x), data="ties", grad=True),
    Op("aminmax_dim0", lambda x: x.aminmax(dim=0), data="ties", grad=True),
    Op("aminmax_dim1_keepdim", lambda x: torch.aminmax(x, dim=1, keepdim=True), data="nan", grad=True),
    # arg-reductions: ties go to the smallest global index, NaN is the max (and the min)
    Op("argmax", lambda x: x.argmax(), data="ties"),
    Op("argmax_dim0", lambda x: torch.argmax(x, 0), data="ties"),
    Op("argmax_dim1_keepdim", lambda x: x.argmax(1, keepdim=True), data="ties"),
    Op("argmax_keepdim", lambda x: torch.argmax(x, keepdim=True), data="ties"),
    Op("argmin_dim-1", lambda x: x.argmin(-1), data="ties"),
    Op("argmin_nan", lambda x: torch.argmin(x), data="nan"),
    Op("argmax_dim0_nan", lambda x: x.argmax(0), data="nan"),
    Op("argmin_int", lambda x: x.argmin(0), data="int", dtype=torch.int64),
    # logical reductions and counts
    Op("all", lambda x: x.all(), data="bool", partial_ok=False),
    Op("all_dim0", lambda x: torch.all(x, 0), data="bool", partial_ok=False),
    Op("any_dim1_keepdim", lambda x: x.any(1, keepdim=True), data="bool", partial_ok=False),
    Op("any_dims01", lambda x: torch.any(x, (0, 1)), data="bool", partial_ok=False),
    Op("all_int", lambda x: x.all(1), data="int", dtype=torch.int64),
    Op("any_uint8", lambda x: x.any(0), data="bool", dtype=torch.uint8, partial_ok=False),
    Op("count_nonzero", lambda x: torch.count_nonzero(x), data="int", dtype=torch.int64),
    Op("count_nonzero_dim0", lambda x: x.count_nonzero(0), data="int", dtype=torch.int64),
    Op("count_nonzero_dims01", lambda x: torch.count_nonzero(x, (0, 1)), data="ties"),
]
GRID = Grid(OPS)


test_reduction_sample, test_reduction_grid = GRID.tests("test_reduction", per_op=5, seed=4)


# ------------------------------------------------------------------ 3-d tensors and strided shards

CUBE = (4, 3, 5)
SPECIAL = [
    (Op("sum_dims02", lambda x: x.sum((0, 2)), grad=True), (2, 2), (Shard(0), Shard(2)), CUBE),
    (
        Op("mean_dims-1-3_keepdim", lambda x: x.mean((-1, -3), keepdim=True), grad=True),
        (2, 2),
        (Shard(2), Shard(1)),
        CUBE,
    ),
    (Op("argmax_flat", lambda x: x.argmax(), data="ties"), (2, 2), (Shard(2), Shard(0)), CUBE),
    (Op("argmin_flat_keepdim", lambda x: x.argmin(keepdim=True), data="ties"), (4,), (Shard(1),), CUBE),
    (Op("max_dim1", lambda x: x.max(1), data="ties", grad=True), (2, 2), (Shard(1), Shard(1)), CUBE),
    (Op("prod_dim2", lambda x: x.prod(2), data="pos", grad=True), (2, 2), (Shard(2), Shard(0)), CUBE),
    (Op("amax_dims12", lambda x: x.amax((1, 2)), data="ties", grad=True), (2, 2), (Shard(1), Shard(2)), CUBE),
    (
        Op("count_nonzero_dims01", lambda x: torch.count_nonzero(x, (0, 1)), data="int", dtype=torch.int64),
        (2, 2),
        (Shard(0), Shard(1)),
        CUBE,
    ),
    # a strided shard: dim 0 in 2 pieces, each chunked over the ranks (FSDP+TP after a view)
    (Op("sum_dim0_strided", lambda x: x.sum(0), grad=True), (2, 2), (StridedShard(0, 2), Shard(0)), (8, 6)),
    (Op("mean_dim0_strided", lambda x: x.mean(0), grad=True), (2, 2), (StridedShard(0, 2), Shard(0)), (10, 6)),
    (Op("argmax_dim0_strided", lambda x: x.argmax(0), data="ties"), (2, 2), (StridedShard(0, 2), Shard(0)), (8, 6)),
    (
        Op("max_dim0_strided", lambda x: x.max(0), data="ties", grad=True),
        (2, 2),
        (StridedShard(0, 2), Shard(0)),
        (10, 6),
    ),
    (Op("min_strided_flat", lambda x: x.min(), data="ties", grad=True), (4,), (StridedShard(1, 3),), (10, 6)),
    (Op("argmin_strided_flat", lambda x: x.argmin(), data="ties"), (4,), (StridedShard(1, 3),), (10, 6)),
    (Op("prod_strided_flat", lambda x: x.prod(), data="pos", grad=True), (4,), (StridedShard(0, 2),), (10, 6)),
    (Op("sum_dim1_kept_strided", lambda x: x.sum(1), grad=True), (2, 2), (StridedShard(0, 2), Shard(0)), (8, 6)),
]


@pytest.mark.parametrize("op,mesh_shape,layout,shape", SPECIAL, ids=[c[0].name for c in SPECIAL])
def test_reduction_special_layouts(op, mesh_shape, layout, shape):
    check_case(op, mesh_shape, layout, shape)


# ------------------------------------------------------------------ pending inputs and outputs


def _layouts_after(fn, full, placements, mesh_shape=(4,)):
    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(full, mesh, placements)
        out = fn(x)
        outs = out if isinstance(out, tuple) else (out,)
        return [tuple(o.placements) for o in outs], [o.full_tensor() for o in outs]

    return so.run(body, 4)[0]


LAYOUT_CASES = [
    ("sum of P(sum) stays pending", lambda x: x.sum(0), Partial("sum"), Partial("sum")),
    ("mean of P(sum) stays pending", lambda x: x.mean(1), Partial("sum"), Partial("sum")),
    ("amax of P(max) stays pending", lambda x: x.amax(0), Partial("max"), Partial("max")),
    ("prod of P(product) stays pending", lambda x: x.prod(1), Partial("product"), Partial("product")),
    ("sum over a sharded dim is pending", lambda x: x.sum(0), Shard(0), Partial("sum")),
    ("mean over a sharded dim is pending", lambda x: x.mean(1), Shard(1), Partial("sum")),
    ("amin over a sharded dim is pending", lambda x: x.amin(0), Shard(0), Partial("min")),
    ("sum over a kept dim keeps the shard", lambda x: x.sum(0), Shard(1), Shard(0)),
    ("keepdim keeps the shard in place", lambda x: x.sum(0, keepdim=True), Shard(1), Shard(1)),
]


@pytest.mark.parametrize("name,fn,src,want", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_layout_of_result(name, fn, src, want):
    full = torch.randn(8, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    layouts, fulls = _layouts_after(fn, full, [src])
    assert layouts == [(want,)]
    assert fulls[0].shape == fn(full).shape


def test_all_of_bool_min_partial_stays_pending():
    full = torch.rand(8, 6, generator=torch.Generator().manual_seed(1)) < 0.8
    layouts, fulls = _layouts_after(lambda x: x.all(1), full, [Partial("min")])
    assert layouts == [(Partial("min"),)]
    assert torch.equal(fulls[0], full.all(1))


# ----------------------------------------------------------------- bytes per rank (mesh (4,), x = f32[8, 4096] on S(1))

ROWS, COLS, RANKS = 8, 4096, 4


def _bytes(fn, full, placements, mesh_shape=(RANKS,)):
    """Logical bytes this rank puts into collectives for the op AND the full_tensor() of every output."""

    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(full, mesh, placements)
        with so.CommDebugMode() as comm:
            out = fn(x)
            outs = out if isinstance(out, tuple) else (out,)
            values = [o.full_tensor() for o in outs]
        return comm.get_total_bytes(), comm.get_comm_counts(), comm.get_rounds(), values

    results = so.run(body, RANKS)
    want = fn(full)
    wants = want if isinstance(want, tuple) else (want,)
    for got, w in zip(results[0][3], wants):
        assert torch.allclose(got.double(), w.double(), atol=1e-5, equal_nan=True)
    assert len({r[0] for r in results}) == 1, "every rank puts in the same bytes"
    return results[0][:3]


@pytest.fixture(scope="module")
def wide():
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7))


def test_bytes_mean_over_sharded_dim(wide):
    # local sum / global count -> P(sum); full_tensor all-reduces one f32 per row
    assert _bytes(lambda x: x.mean(1), wide, [Shard(1)]) == (ROWS * 4, {"all_reduce": 1}, 1)


def test_bytes_argmax_over_sharded_dim(wide):
    # one all_gather of (value, global index) per row, f32 value bits and int32 index packed in one int64:
    # 8 rows x 8 bytes; output Replicate
    assert _bytes(lambda x: x.argmax(1), wide, [Shard(1)]) == (ROWS * 8, {"all_gather": 1}, 1)


def test_bytes_max_dim_over_sharded_dim(wide):
    # values and indices come from the same single gather of pairs
    assert _bytes(lambda x: x.max(1), wide, [Shard(1)]) == (ROWS * 8, {"all_gather": 1}, 1)


def test_bytes_sum_and_amax_over_sharded_dim(wide):
    assert _bytes(lambda x: x.sum(1), wide, [Shard(1)]) == (ROWS * 4, {"all_reduce": 1}, 1)
    assert _bytes(lambda x: x.amax(1), wide, [Shard(1)]) == (ROWS * 4, {"all_reduce": 1}, 1)


# ------------------------------------------------------------------ mean of (10, 6) on S(0): 3+3+3+1 rows


@pytest.fixture(scope="module")
def ten_by_six():
    return torch.randn(10, 6, generator=torch.Generator().manual_seed(11))


def test_mean_uneven_rows_along_dim0_all_reduces_only(ten_by_six):
    # P(sum) of local sums / 10; full_tensor all-reduces 6 f32
    assert _bytes(lambda x: x.mean(0), ten_by_six, [Shard(0)]) == (6 * 4, {"all_reduce": 1}, 1)


def test_mean_uneven_rows_over_all_dims_moves_one_value(ten_by_six):
    # one f32 per rank, one round, whichever of "pending + all_reduce" and "gather the shard means" the model picks
    nbytes, counts, rounds = _bytes(lambda x: x.mean(), ten_by_six, [Shard(0)])
    assert (nbytes, rounds) == (4, 1)


def test_mean_uneven_rows_over_all_dims_no_all_gather(ten_by_six):
    assert _bytes(lambda x: x.mean(), ten_by_six, [Shard(0)])[1] == {"all_reduce": 1}


# ------------------------------------------------------------------ gradients stay where the data is


def test_sum_backward_keeps_shard_and_moves_nothing():
    full = torch.randn(8, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        x = so.distribute_tensor(full, mesh, [Shard(1), Replicate()]).requires_grad_()
        y = x.sum(1)
        ones = so.distribute_tensor(torch.ones(8, dtype=torch.float64), mesh, [Replicate(), Replicate()])
        with so.CommDebugMode() as comm:
            y.backward(ones)
        return tuple(x.grad.placements), comm.get_total_bytes(), x.grad.full_tensor()

    layout, nbytes, grad = so.run(body, 4)[0]
    assert layout == (Shard(1), Replicate())
    assert nbytes == 0
    assert torch.equal(grad, torch.ones(8, 12, dtype=torch.float64))


def test_max_dim_backward_moves_only_output_sized_values():
    full = torch.randn(8, 4096, generator=torch.Generator().manual_seed(6))

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
        values = x.max(1).values
        with so.CommDebugMode() as comm:
            values.sum().backward()
        return tuple(x.grad.placements), comm.get_total_bytes(), x.grad.full_tensor()

    layout, nbytes, grad = so.run(body, 4)[0]
    ref = full.clone().requires_grad_()
    ref.max(1).values.sum().backward()
    assert layout == (Shard(1),)
    assert nbytes <= 8 * 8  # at most one output-sized value per row and rank; the 128 KiB input never moves
    assert torch.equal(grad, ref.grad)


@pytest.mark.parametrize(
    "name,fn",
    [
        ("amin", lambda x: x.amin(1)),
        ("aminmax", lambda x: sum(torch.aminmax(x, dim=0))),
        ("max", lambda x: x.max()),
        ("prod", lambda x: x.prod(0)),
        ("median", lambda x: x.median()),
    ],
    ids=["amin", "aminmax", "max", "prod", "median"],
)
def test_gradient_of_pending_norm_input(name, fn):
    # NormP(2) on both mesh dims, rank (i, j) holding |x| * sqrt(a_i * b_j): forward and backward must read
    # the same resolved x, or two resolution paths round differently and `x == result` misses the extreme
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(12), dtype=torch.float64).abs() + 0.5
    w = torch.randn(fn(full).shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    a, b = (0.3, 0.7), (0.55, 0.45)

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        i, j = mesh.get_coordinate()
        local = full * (a[i] * b[j]) ** 0.5
        x = so.DTensor.from_local(local, mesh, [NormPartial(2), NormPartial(2)], shape=full.shape).requires_grad_()
        y = fn(x)
        (grad,) = torch.autograd.grad((y.full_tensor() * w).sum(), x)
        return y.full_tensor(), tuple(grad.placements), grad.full_tensor()

    value, layout, grad = so.run(body, 4)[0]
    ref = full.clone().requires_grad_()
    (fn(ref) * w).sum().backward()
    torch.testing.assert_close(value, fn(full), rtol=1e-10, atol=1e-10)
    assert layout == (Replicate(), Replicate())
    torch.testing.assert_close(grad, ref.grad, rtol=1e-10, atol=1e-10)


def test_grad_attribute_keeps_strided_shard():
    full = torch.randn(10, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(full, mesh, [StridedShard(1, 3)]).requires_grad_()
        x.sum().backward()
        return tuple(x.grad.placements)

    assert so.run(body, 4)[0] == (StridedShard(1, 3),)


# ------------------------------------------------------------------ user errors name the op


@pytest.mark.parametrize(
    "call,op_name",
    [
        (lambda x: torch.sum(x, 2), "sum"),
        (lambda x: x.mean((0, 0)), "mean"),
        (lambda x: torch.amax(x, -3), "amax"),
        (lambda x: x.max(5), "max"),
        (lambda x: torch.argmax(x, 2), "argmax"),
        (lambda x: x.prod(-3), "prod"),
        (lambda x: torch.all(x, 3), "all"),
        (lambda x: torch.count_nonzero(x, [0, 4]), "count_nonzero"),
        (lambda x: torch.aminmax(x, dim=2), "aminmax"),
    ],
    ids=["sum", "mean-repeated", "amax", "max", "argmax", "prod", "all", "count_nonzero", "aminmax"],
)
def test_bad_dim_raises_sharding_error_naming_op(call, op_name):
    full = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        call(so.distribute_tensor(full, mesh, [Shard(0)]))

    with pytest.raises(so.ShardingError, match=rf"^{op_name}: dim"):
        so.run(body, 4)


def test_named_rows_reach_torch_errors_unchanged():
    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        torch.sum(x, "rows")

    with pytest.raises((RuntimeError, TypeError)):
        so.run(body, 4)
