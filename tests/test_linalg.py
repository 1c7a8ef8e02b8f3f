"""Linear algebra (ops/linalg.py) against single-device torch.

Decompositions run replicated on purpose (no fallback warning, listed in REPLICATE_ONLY);
tril/triu and diagonal keep sharded layouts with no communication.
"""

import warnings

import pytest
import torch

import shardops as so
from shardops import Partial, Replicate, Shard
from shardops.dispatch.registry import REPLICATE_ONLY, RULES

aten = torch.ops.aten
R = Replicate()


def _data(shape, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), g


def _sharded(fn, shape, placements):
    mesh = so.init_device_mesh("cpu", (4,))
    x, g = _data(shape)
    xd = so.distribute_tensor(x, mesh, placements).requires_grad_()
    with so.CommDebugMode() as forward:
        y = fn(xd)
    grad = torch.randn(y.shape, generator=g, dtype=torch.float64)
    gd = so.distribute_tensor(grad, mesh, [R if p.is_partial() else p for p in y.placements])
    with so.CommDebugMode() as backward:
        y.backward(gd)
    return {
        "y": y.full_tensor(),
        "dx": xd.grad.full_tensor(),
        "grad": grad,
        "y_layout": y.placements,
        "dx_layout": xd.grad.placements,
        "forward": forward.log,
        "backward": backward.log,
    }


def _check(fn, shape, placements):
    # Other ops of the call (e.g. the bmm of a @ a.mT) may still fall back: recorded, not errors.
    # The warnings filter is process-wide, so it is set here, around the rank threads.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", so.FallbackWarning)
        res = so.run(_sharded, 4, fn, shape, placements)[0]
    res["warnings"] = [str(w.message) for w in caught]
    x, _ = _data(shape)
    xr = x.clone().requires_grad_()
    y = fn(xr)
    y.backward(res["grad"])
    torch.testing.assert_close(res["y"], y.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(res["dx"], xr.grad, rtol=1e-10, atol=1e-10)
    return res


# ------------------------------------------------------------------ replicated on purpose

DECOMPOSITIONS = {
    "svdvals": (lambda a: torch.linalg.svd(a)[1], (6, 5, 4), [Shard(0)], aten._linalg_svd.default),
    "qr-r": (lambda a: torch.linalg.qr(a)[1], (6, 5, 4), [Shard(1)], aten.linalg_qr.default),
    "eigh-values": (lambda a: torch.linalg.eigh(a @ a.mT)[0], (6, 4, 4), [Shard(2)], aten._linalg_eigh.default),
    "diag-embed": (torch.diag_embed, (6, 5), [Shard(0)], aten.diag_embed.default),
    "diag-2d": (lambda a: torch.diag(a[0], 1), (6, 5), [Shard(1)], aten.diagonal_copy.default),
}


@pytest.mark.parametrize("name", list(DECOMPOSITIONS))
def test_replicated_on_purpose(name):
    fn, shape, placements, op = DECOMPOSITIONS[name]
    res = _check(fn, shape, placements)
    own = {str(o) for o in REPLICATE_ONLY if str(o).startswith(("aten._linalg", "aten.linalg", "aten.diag"))}
    assert not [w for w in res["warnings"] if any(f"{o} has no sharded strategy" in w for o in own)]
    assert op in REPLICATE_ONLY or op in RULES


def test_replicate_registry():
    for op in (
        aten._linalg_svd.default,
        aten.linalg_qr.default,
        aten._linalg_eigh.default,
        aten.diag.default,
        aten.diag_embed.default,
        aten.linalg_solve_triangular.default,
    ):
        assert op in REPLICATE_ONLY and op not in RULES


# ------------------------------------------------------------------ tril / triu: local on any shard

TRIANGLES = {
    "tril": lambda a: torch.tril(a),
    "tril+2": lambda a: torch.tril(a, 2),
    "triu-1": lambda a: a.triu(-1),
    "tril_-1": lambda a: (a * 1).tril_(-1),
    "triu_+3": lambda a: (a * 1).triu_(3),
}
# (3, 5, 7) over 4 ranks: batch 1,1,1,0; rows 2,2,1,0; columns 2,2,2,1: empty and short shards
TRIANGLE_LAYOUTS = {"batch": [Shard(0)], "rows": [Shard(1)], "cols": [Shard(2)]}


@pytest.mark.parametrize("layout", list(TRIANGLE_LAYOUTS))
@pytest.mark.parametrize("name", list(TRIANGLES))
def test_triangle_local(name, layout):
    placements = TRIANGLE_LAYOUTS[layout]
    res = _check(TRIANGLES[name], (3, 5, 7), placements)
    assert res["forward"] == [] and res["backward"] == []
    assert res["y_layout"] == res["dx_layout"] == tuple(placements)


def _partial_triangle():
    mesh = so.init_device_mesh("cpu", (4,))
    x, _ = _data((5, 5))
    xd = so.distribute_tensor(x, mesh, [Partial("sum")])
    with so.CommDebugMode() as comm:
        y = torch.triu(xd, 1)
    return y.placements, comm.log, y.full_tensor()


def test_triangle_passes_pending_sum():
    layout, log, y = so.run(_partial_triangle, 4)[0]
    assert layout == (Partial("sum"),) and log == []
    torch.testing.assert_close(y, torch.triu(_data((5, 5))[0], 1))


def _triangle_mesh2x2():
    mesh = so.init_device_mesh("cpu", (2, 2))
    x, _ = _data((9, 7))
    xd = so.distribute_tensor(x, mesh, [Shard(1), Shard(0)])
    with so.CommDebugMode() as comm:
        y = torch.tril(xd, -2)
    return y.placements, comm.log, y.full_tensor()


def test_triangle_rows_and_columns_sharded():
    layout, log, y = so.run(_triangle_mesh2x2, 4)[0]
    assert layout == (Shard(1), Shard(0)) and log == []
    torch.testing.assert_close(y, torch.tril(_data((9, 7))[0], -2))


# ------------------------------------------------------------------ diagonal


@pytest.mark.parametrize(
    "name,fn,placements,out_layout",
    [
        pytest.param("batch", lambda a: torch.diagonal(a, 1, -2, -1), [Shard(0)], (Shard(0),), id="batch-dim0"),
        pytest.param("middle", lambda a: torch.diagonal(a, -1, 0, 2), [Shard(1)], (Shard(0),), id="kept-dim1"),
    ],
)
def test_diagonal_batch_shard_local(name, fn, placements, out_layout):
    res = _check(fn, (6, 5, 7), placements)
    assert res["forward"] == [] and res["backward"] == []
    assert res["y_layout"] == out_layout and res["dx_layout"] == tuple(placements)


def test_diagonal_matrix_dim_sharded_replicates():
    res = _check(lambda a: torch.diagonal(a, 0, 1, 2), (6, 5, 7), [Shard(2)])
    assert torch.Size(res["y"].shape) == torch.Size([6, 5])  # values checked in _check; the plan moves data
