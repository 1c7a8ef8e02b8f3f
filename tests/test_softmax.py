"""Softmax family (ops/softmax.py) against single-device torch: values, gradients, layouts, bytes, rounds.

Backward form: `y.backward(grad)` with a grad DTensor laid out like `y`. It needs no
reduction of its own, so the bytes counted are the softmax's alone (a `(y * w).sum()`
would add the sum's own collectives).
"""

import contextlib
import math
import random

import pytest
import torch

import shardops as so
from planner_harness import inputs_stay_put
from shardops import Partial, Replicate, Shard

aten = torch.ops.aten
OPS = {
    "softmax": lambda x, d: torch.softmax(x, d),
    "log_softmax": lambda x, d: torch.log_softmax(x, d),
    "safe_softmax": lambda x, d: aten._safe_softmax(x, d),
}
SHAPE = (8, 12, 16)
UNEVEN = (3, 5, 7)  # over 4 ranks: 1,1,1,0 / 2,2,1,0 / 2,2,2,1 -> empty shards
PLACEMENTS = {"S0": Shard(0), "S1": Shard(1), "S2": Shard(2), "R": Replicate()}
LAYOUTS = {(4,): [(a,) for a in PLACEMENTS], (2, 2): [(a, b) for a in PLACEMENTS for b in PLACEMENTS]}


def _data(shape, dtype, kind):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "large":  # rows whose max is ~1e4: exp(x) overflows without the max shift
        x = x + 1e4
    elif kind == "neginf":  # some rows -inf everywhere along every dim, some -inf in part
        x[0] = -math.inf
        x[:, 0] = -math.inf
        x[..., 1::3] = -math.inf
    return x.to(dtype), torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _softmax_case(op, dim, mesh_shape, layout, shape, dtype, kind):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    full, gfull = _data(shape, dtype, kind)
    x = so.distribute_tensor(full, mesh, [PLACEMENTS[p] for p in layout]).requires_grad_()
    y = OPS[op](x, dim)
    y.backward(so.distribute_tensor(gfull, mesh, y.placements))
    with torch.no_grad():
        return x.placements, y.placements, x.grad.placements, y.full_tensor(), x.grad.full_tensor()


def _reference(op, dim, shape, dtype, kind):
    full, gfull = _data(shape, dtype, kind)
    x = full.clone().requires_grad_()
    y = OPS[op](x, dim)
    y.backward(gfull)
    return y.detach(), x.grad


@contextlib.contextmanager
def links(model):
    """Plan under another link model (set_links invalidates every planning cache both ways)."""
    so.set_links(model)
    try:
        yield
    finally:
        so.set_links("threads")


def _check(op, dim, mesh_shape, layout, shape=SHAPE, dtype=torch.float64, kind="randn", keeps_layout=False):
    """Values and gradients equal torch's. `keeps_layout`: inputs stay put, so that the sharded
    algorithm runs wherever the softmax dim is sharded, and output and gradient keep the layout.

    Under the default link model a rank of SHAPE holds only 2-4 entries of a row, and the cost
    model may rightly prefer moving the data (all_to_all to another dim) over gathering
    statistics of about the same size.
    """
    with inputs_stay_put() if keeps_layout else contextlib.nullcontext():
        results = so.run(_softmax_case, math.prod(mesh_shape), op, dim, mesh_shape, layout, shape, dtype, kind)
    y_ref, g_ref = _reference(op, dim, shape, dtype, kind)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    for x_pl, y_pl, g_pl, y, g in results:
        torch.testing.assert_close(y, y_ref, equal_nan=True, **tol)
        torch.testing.assert_close(g, g_ref, equal_nan=True, **tol)
        assert g_pl == x_pl, "the gradient comes back in the input's layout"
        if keeps_layout:
            assert y_pl == x_pl, "the output keeps the input's layout"


def _grid():
    return [
        pytest.param(
            op, dim, mesh_shape, layout, id=f"{op}-dim{dim}-{'x'.join(map(str, mesh_shape))}-{'.'.join(layout)}"
        )
        for op in OPS
        for dim in range(3)
        for mesh_shape, layouts in LAYOUTS.items()
        for layout in layouts
    ]


GRID = _grid()
SAMPLE = random.Random(5).sample(GRID, 16)


@pytest.mark.parametrize("sharded_algorithm", [False, True], ids=["cost-model", "inputs-stay"])
@pytest.mark.parametrize("op,dim,mesh_shape,layout", SAMPLE)
def test_softmax_matches_torch_sample(op, dim, mesh_shape, layout, sharded_algorithm):
    _check(op, dim, mesh_shape, layout, keeps_layout=sharded_algorithm)


@pytest.mark.slow
@pytest.mark.parametrize("sharded_algorithm", [False, True], ids=["cost-model", "inputs-stay"])
@pytest.mark.parametrize("op,dim,mesh_shape,layout", GRID)
def test_softmax_matches_torch_grid(op, dim, mesh_shape, layout, sharded_algorithm):
    _check(op, dim, mesh_shape, layout, keeps_layout=sharded_algorithm)


EDGE = [
    # (op, dim, mesh, layout, shape, kind): the sharded dim is the softmax dim in each
    ("softmax", 1, (4,), ("S1",), SHAPE, "large"),
    ("log_softmax", 1, (4,), ("S1",), SHAPE, "large"),
    ("softmax", 2, (2, 2), ("S2", "S2"), SHAPE, "neginf"),
    ("log_softmax", 2, (4,), ("S2",), SHAPE, "neginf"),
    ("safe_softmax", 2, (4,), ("S2",), SHAPE, "neginf"),
    ("safe_softmax", 0, (2, 2), ("S0", "S2"), SHAPE, "neginf"),
    ("softmax", 0, (4,), ("S0",), UNEVEN, "randn"),
    ("log_softmax", 1, (4,), ("S1",), UNEVEN, "randn"),
    ("safe_softmax", 1, (2, 2), ("S1", "S1"), UNEVEN, "neginf"),
    ("log_softmax", 0, (2, 2), ("S0", "S1"), UNEVEN, "large"),
    ("softmax", 2, (2, 2), ("S1", "S2"), UNEVEN, "randn"),
]


@pytest.mark.parametrize("op,dim,mesh_shape,layout,shape,kind", EDGE, ids=lambda v: str(v).replace(" ", ""))
def test_softmax_edge_cases(op, dim, mesh_shape, layout, shape, kind):
    """Large maxima, -inf rows (NaN like torch, 0 for _safe_softmax), uneven and empty shards."""
    _check(op, dim, mesh_shape, layout, shape=shape, kind=kind, keeps_layout=True)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_float32_and_bfloat16(op):
    _check(op, 1, (4,), ("S1",), dtype=torch.float32, keeps_layout=True)
    _check(op, 1, (4,), ("S1",), dtype=torch.bfloat16, keeps_layout=True)


# ------------------------------------------------------------------ bytes and rounds

ROWS, COLS = 8, 4096


def _bytes_case(op):
    mesh = so.init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(0)
    full, gfull = torch.randn(ROWS, COLS, generator=g), torch.randn(ROWS, COLS, generator=g)
    x = so.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    grad = so.distribute_tensor(gfull, mesh, [Shard(1)])
    with so.CommDebugMode() as comm:
        y = OPS[op](x, 1)
        forward_rounds = comm.get_rounds()
        y.backward(grad)
    return comm.get_comm_counts(), comm.get_total_bytes(), forward_rounds, y.placements, x.grad.placements


@pytest.mark.parametrize("op", list(OPS))
def test_softmax_bytes_and_rounds(op):
    """f32[8, 4096] Shard(1) on mesh (4,): forward = one all_gather of a (max, sum) pair per row,
    backward = one all_reduce of a row sum; nothing else moves, the layout stays Shard(1)."""
    forward_bytes = ROWS * 2 * 4  # this rank's (max, sum exp) per row, f32
    backward_bytes = ROWS * 4  # sum(grad * y) or sum(grad) per row, f32
    for counts, nbytes, rounds, y_pl, g_pl in so.run(_bytes_case, 4, op):
        assert counts == {"all_gather": 1, "all_reduce": 1}
        assert nbytes == forward_bytes + backward_bytes <= 1024
        assert rounds == 1
        assert y_pl == g_pl == (Shard(1),)


def test_two_all_reduces_win_when_bandwidth_dominates():
    """With negligible latency the 2-round row (half the bytes of the gather) is the cheaper candidate."""
    with links(so.Link(1e-12, 1e9)):
        results = so.run(_bytes_case, 4, "softmax")
    for counts, nbytes, rounds, y_pl, g_pl in results:
        assert counts == {"all_reduce": 3}
        assert nbytes == ROWS * 4 * 2 + ROWS * 4
        assert rounds == 2
        assert y_pl == g_pl == (Shard(1),)
    with links(so.Link(1e-12, 1e9)):
        results = so.run(_softmax_case, 4, "log_softmax", 1, (4,), ("S1",), (8, 64), torch.float64, "neginf")
    y_ref, g_ref = _reference("log_softmax", 1, (8, 64), torch.float64, "neginf")
    for _, y_pl, _, y, g in results:
        assert y_pl == (Shard(1),)
        torch.testing.assert_close(y, y_ref, equal_nan=True, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(g, g_ref, equal_nan=True, rtol=1e-10, atol=1e-10)


def _unsharded_dim_case():
    mesh = so.init_device_mesh("cpu", (4,))
    x = so.distribute_tensor(torch.randn(8, 16, dtype=torch.float64), mesh, [Shard(0)]).requires_grad_()
    grad = so.distribute_tensor(torch.ones(8, 16, dtype=torch.float64), mesh, [Shard(0)])
    with so.CommDebugMode() as comm:
        y = torch.log_softmax(x, 1)
        y.backward(grad)
    return comm.get_total_counts(), y.placements, x.grad.placements


def test_softmax_over_unsharded_dim_is_local():
    for count, y_pl, g_pl in so.run(_unsharded_dim_case, 4):
        assert count == 0
        assert y_pl == g_pl == (Shard(0),)


def _partial_grad_case():
    mesh = so.init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(3)
    full = torch.randn(6, 10, generator=g, dtype=torch.float64)
    parts = [torch.randn(6, 10, generator=g, dtype=torch.float64) for _ in range(4)]
    x = so.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    y = torch.softmax(x, 1)
    grad = so.DTensor.from_local(parts[mesh.get_rank()], mesh, [Partial("sum")])
    y.backward(grad)
    return x.grad.full_tensor(), full, sum(parts)


def test_softmax_backward_with_pending_grad():
    for got, full, grad in so.run(_partial_grad_case, 4):
        x = full.clone().requires_grad_()
        torch.softmax(x, 1).backward(grad)
        torch.testing.assert_close(got, x.grad, rtol=1e-10, atol=1e-10)


LONG_ROWS = (40, 40, 40)  # 10+ entries of a row per rank: gathering statistics beats moving data


@pytest.mark.parametrize(
    "op,dim,mesh_shape,layout",
    [
        ("softmax", 0, (4,), ("S0",)),
        ("log_softmax", 1, (4,), ("S1",)),
        ("safe_softmax", 2, (4,), ("S2",)),
        ("softmax", 2, (2, 2), ("S2", "S2")),
        ("log_softmax", 1, (2, 2), ("S0", "S1")),
        ("softmax", 0, (2, 2), ("S0", "S2")),
    ],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_softmax_keeps_layout_over_sharded_dim_by_cost(op, dim, mesh_shape, layout):
    """Under the default link model too, once a rank holds enough of each row."""
    results = so.run(
        _softmax_case, math.prod(mesh_shape), op, dim, mesh_shape, layout, LONG_ROWS, torch.float64, "randn"
    )
    y_ref, g_ref = _reference(op, dim, LONG_ROWS, torch.float64, "randn")
    for x_pl, y_pl, g_pl, y, g in results:
        assert x_pl == y_pl == g_pl
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)
