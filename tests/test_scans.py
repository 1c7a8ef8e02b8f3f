"""Scans (cumsum, cumprod, logcumsumexp, cummax, cummin) on every layout against single-device torch,
their sharded algorithm (output stays Shard(d), only shard totals move), gradients, and byte counts."""

from __future__ import annotations

import math

import pytest
import torch

import shardops as so
from algo_harness import latency_only_links, run_case  # noqa: F401  (fixture)
from reduction_harness import Grid, Op, assert_same, check_bad_dim_refused, distribute, expected
from shardops import Partial, Replicate, Shard

f64, f32 = torch.float64, torch.float32

OPS = [
    Op("cumsum_dim0", lambda x: torch.cumsum(x, 0), grad=True),
    Op("cumsum_dim1", lambda x: x.cumsum(1), grad=True),
    Op("cumsum_dim-1_dtype_f64", lambda x: x.cumsum(-1, dtype=torch.float64), dtype=f32, grad=True),
    Op("cumsum_int", lambda x: torch.cumsum(x, 1), data="int", dtype=torch.int32),
    Op("cumsum_bool", lambda x: x.cumsum(0), data="bool", partial_ok=False),
    Op("cumprod_dim1", lambda x: torch.cumprod(x, 1), data="pos", grad=True),
    Op("cumprod_dim-2", lambda x: x.cumprod(-2), data="pos", grad=True),
    Op("cumprod_int", lambda x: x.cumprod(0), data="int", dtype=torch.int64),
    Op("logcumsumexp_dim1", lambda x: torch.logcumsumexp(x, 1), grad=True),
    Op("logcumsumexp_dim0_f32", lambda x: x.logcumsumexp(0), dtype=f32, grad=True),
    Op("cummax_dim1", lambda x: torch.cummax(x, 1), data="ties", grad=True),
    Op("cummax_dim0", lambda x: x.cummax(0), data="ties", grad=True),
    Op("cummax_nan", lambda x: x.cummax(1), data="nan", grad=True),
    Op("cummin_dim-1", lambda x: torch.cummin(x, -1), data="ties", grad=True),
    Op("cummin_dim0_nan", lambda x: x.cummin(0), data="nan", grad=True),
    Op("cummax_int", lambda x: x.cummax(1), data="int", dtype=torch.int64),
    # aten overloads called directly take the same sharded backward
    Op("aten_cumsum", lambda x: torch.ops.aten.cumsum.default(x, 1), grad=True),
    Op(
        "aten_cumprod_dtype",
        lambda x: torch.ops.aten.cumprod.default(x, 0, dtype=f64),
        data="pos",
        dtype=f32,
        grad=True,
    ),
    Op("aten_cummin", lambda x: torch.ops.aten.cummin.default(x, -1), data="ties", grad=True),
]
GRID = Grid(OPS)


test_scan_sample, test_scan_grid = GRID.tests("test_scan", per_op=4, seed=5)


# ------------------------------------------------------------------ the sharded algorithm itself

# The sharded scan on uneven and empty shards: 9 = 3+3+3+0 on (4,); 3 = (1+1)+(1+0) nested on (2,2).
SCAN_FNS = {
    "cumsum": (lambda x: x.cumsum(-1), "randn"),
    "cumprod": (lambda x: x.cumprod(-1), "pos"),
    "logcumsumexp": (lambda x: x.logcumsumexp(-1), "randn"),
    "cummax": (lambda x: x.cummax(-1), "ties"),
    "cummin": (lambda x: x.cummin(-1), "nan"),
}
ALGO_CASES = [
    ("mesh4-9", (4,), [Shard(0)], (9,)),
    ("mesh4-1x9", (4,), [Shard(1)], (1, 9)),
    ("mesh4-3x30", (4,), [Shard(1)], (3, 30)),
    ("mesh2x2-nested-3", (2, 2), [Shard(0), Shard(0)], (3,)),
    ("mesh2x2-nested-11", (2, 2), [Shard(0), Shard(0)], (11,)),
    ("mesh2x2-S1-S0", (2, 2), [Shard(1), Shard(0)], (3, 13)),
]


def _data(kind: str, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "pos":
        x = 0.5 + torch.rand(shape, generator=g, dtype=f64)
        x.view(-1)[3::7] = 0.0  # zeros in several shards: cumprod's backward must find the first one globally
        return x
    x = (
        torch.randint(-2, 3, shape, generator=g).to(f64)
        if kind in ("ties", "nan")
        else torch.randn(shape, generator=g, dtype=f64)
    )
    if kind == "nan":
        x.view(-1)[2::5] = math.nan
    return x


@pytest.mark.parametrize("name", list(SCAN_FNS))
@pytest.mark.parametrize("case,mesh_shape,placements,shape", ALGO_CASES, ids=[c[0] for c in ALGO_CASES])
@pytest.mark.usefixtures("latency_only_links")
def test_sharded_scan_keeps_layout_and_matches_torch(name, case, mesh_shape, placements, shape):
    fn, kind = SCAN_FNS[name]
    got = run_case(fn, _data(kind, shape), mesh_shape, placements)
    assert all(pl == tuple(placements) for pl in got.layouts), f"{name}: output left the input's layout: {got.layouts}"
    assert got.rounds == 1 and got.counts == {"all_gather": 1}
    assert got.grad_layout == tuple(placements)


def test_cumsum_of_partial_sum_stays_pending():
    full = torch.randn(6, 10, generator=torch.Generator().manual_seed(2), dtype=f64)
    op = Op("cumsum", lambda x: x.cumsum(1), grad=True)
    outs, weights, grad = expected(op, full)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = distribute(full, mesh, [Partial("sum")], seed=3).requires_grad_()
        y = x.cumsum(1)
        f = y.full_tensor()
        (f * weights[0]).sum().backward()
        return tuple(y.placements), f.detach(), x.grad.full_tensor(), tuple(x.grad.placements)

    layout, got, got_grad, grad_layout = so.run(body, 4)[0]
    assert layout == (Partial("sum"),)
    assert_same(got, outs[0], "cumsum of P(sum)")
    assert_same(got_grad, grad, "gradient")
    assert grad_layout == (Replicate(),)  # a pending input gets a Replicate gradient


@pytest.mark.parametrize("kind", ["ties", "nan"])
@pytest.mark.parametrize("name", ["cummax", "cummin"])
def test_extreme_scan_indices_are_global_and_torchs(name, kind):
    """Ties go to the newest index, NaN sticks (and a newer NaN takes over), across shard borders."""
    full = _data(kind, (4, 230), seed=9)
    want = getattr(torch, name)(full, 1)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        y = getattr(torch, name)(so.distribute_tensor(full, mesh, [Shard(1)]), 1)
        return tuple(y.values.placements), y.values.full_tensor(), y.indices.full_tensor()

    layout, values, indices = so.run(body, 4)[0]
    assert layout == (Shard(1),)
    assert torch.equal(indices, want.indices)
    torch.testing.assert_close(values, want.values, equal_nan=True, rtol=0, atol=0)


def test_inplace_cumsum_keeps_self_layout():
    full = torch.randn(3, 40, generator=torch.Generator().manual_seed(4), dtype=f64)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(full, mesh, [Shard(1)])
        x.cumsum_(1)
        return tuple(x.placements), x.full_tensor()

    layout, got = so.run(body, 4)[0]
    assert layout == (Shard(1),)
    assert_same(got, full.cumsum(1), "cumsum_")


def test_scan_over_unsharded_dim_is_local_and_keeps_other_shards():
    full = torch.randn(12, 5, generator=torch.Generator().manual_seed(6), dtype=f64)

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        x = so.distribute_tensor(full, mesh, [Shard(0), Replicate()])
        with so.CommDebugMode() as comm:
            y = x.logcumsumexp(1)
        return tuple(y.placements), comm.get_total_counts(), y.full_tensor()

    layout, counts, got = so.run(body, 4)[0]
    assert (layout, counts) == ((Shard(0), Replicate()), 0)
    assert_same(got, full.logcumsumexp(1), "logcumsumexp")


# ----------------------------------------------------------------- bytes per rank (mesh (4,), x = f32[8, 4096] on S(1))

ROWS, COLS, RANKS = 8, 4096, 4
F32, I64 = 4, 8


@pytest.fixture(scope="module")
def wide():
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7))


def _scan_comm(fn, full):
    """(bytes, counts, rounds, layout) of the op alone on S(1); values checked against torch."""

    def body():
        mesh = so.init_device_mesh("cpu", (RANKS,))
        x = so.distribute_tensor(full, mesh, [Shard(1)])
        with so.CommDebugMode() as comm:
            y = fn(x)
        ys = list(y) if isinstance(y, tuple) else [y]
        return (
            comm.get_total_bytes(),
            comm.get_comm_counts(),
            comm.get_rounds(),
            tuple(ys[0].placements),
            [t.full_tensor() for t in ys],
        )

    results = so.run(body, RANKS)
    want = fn(full)
    for got, w in zip(results[0][4], list(want) if isinstance(want, tuple) else [want]):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)
    assert len({r[0] for r in results}) == 1, "every rank puts in the same bytes"
    return results[0][:4]


@pytest.mark.parametrize(
    "name,fn,per_row",
    [
        # one all_gather of the shard totals: one f32 per row
        ("cumsum", lambda x: x.cumsum(1), F32),
        ("cumprod", lambda x: (x * 1e-3 + 1).cumprod(1), F32),
        ("logcumsumexp", lambda x: x.logcumsumexp(1), F32),
        # (value, global index) per row, packed in the same single all_gather
        ("cummax", lambda x: x.cummax(1), F32 + I64),
        ("cummin", lambda x: x.cummin(1), F32 + I64),
    ],
)
def test_bytes_of_scan_over_sharded_dim(wide, name, fn, per_row):
    assert per_row * ROWS <= 1024
    assert _scan_comm(fn, wide) == (ROWS * per_row, {"all_gather": 1}, 1, (Shard(1),))


@pytest.mark.parametrize(
    "name,fn,per_row",
    [
        ("cumsum", lambda x: x.cumsum(1), F32),  # exclusive suffix of the shard totals of grad
        ("logcumsumexp", lambda x: x.logcumsumexp(1), 2 * F32),  # positive and negative parts, one gather
        ("cummax", lambda x: x.cummax(1)[0], F32 + I64),  # (grad sum, argmax index) aimed at earlier ranks
        ("cumprod", lambda x: (x * 1e-3 + 1).cumprod(1), 5 * F32 + I64),  # T, A, P, B, Q and the first zero
    ],
)
def test_backward_of_scan_moves_only_totals(wide, name, fn, per_row):
    def body():
        mesh = so.init_device_mesh("cpu", (RANKS,))
        x = so.distribute_tensor(wide, mesh, [Shard(1)]).requires_grad_()
        y = fn(x)
        g = so.distribute_tensor(torch.ones(ROWS, COLS), mesh, [Shard(1)])
        with so.CommDebugMode() as comm:
            y.backward(g)
        return comm.get_total_bytes(), comm.get_comm_counts(), tuple(x.grad.placements), x.grad.full_tensor()

    nbytes, counts, layout, got = so.run(body, RANKS)[0]
    x = wide.clone().requires_grad_()
    fn(x).backward(torch.ones(ROWS, COLS))
    torch.testing.assert_close(got, x.grad, rtol=1e-4, atol=1e-4)
    assert layout == (Shard(1),)
    assert (nbytes, counts) == (ROWS * per_row, {"all_gather": 1})


# ------------------------------------------------------------------ errors and other dtypes


@pytest.mark.parametrize("call", [lambda x: torch.cumsum(x, 2), lambda x: x.cummax(-3), lambda x: x.logcumsumexp(5)])
def test_bad_dim_is_a_sharding_error_naming_the_op(call):
    check_bad_dim_refused(call, r"(cumsum|cummax|logcumsumexp): dim .* out of range")


@pytest.mark.parametrize("name", ["cumsum", "cumprod"])
def test_complex_scans_keep_the_shard(name):
    full = torch.randn(3, 40, generator=torch.Generator().manual_seed(2), dtype=torch.complex128)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        y = getattr(torch, name)(so.distribute_tensor(full, mesh, [Shard(1)]), 1)
        return tuple(y.placements), y.full_tensor()

    layout, got = so.run(body, 4)[0]
    assert layout == (Shard(1),)
    torch.testing.assert_close(got, getattr(torch, name)(full, 1))
