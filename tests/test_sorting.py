"""topk / sort / argsort (ops/sorting.py) against single-device torch: values, indices,
gradients, layouts and bytes.

Ties: torch's CPU topk orders ties by an unspecified rule (std::nth_element), so the sharded
top-k breaks them like a stable sort (smallest global index first). The reference for tied
data on the sharded path is therefore `torch.sort(x, stable=True)[..., :k]`; values always
equal torch's bitwise, and the local path (whole rows on a rank) gives torch's own indices.
"""

import math
import random

import pytest
import torch

import shardops as so
from shardops import Replicate, Shard, StridedShard

R = Replicate()


def _data(shape, kind, dtype=torch.float64, seed=99):
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        x = torch.randint(0, 3, shape, generator=g).to(dtype)
    elif kind == "perm":  # distinct integers
        x = torch.randperm(math.prod(shape), generator=g).reshape(shape).to(dtype)
    else:
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        if kind == "nan":
            flat = x.view(-1)
            flat[::7] = math.nan
            flat[3::11] = math.inf
            flat[5::13] = -math.inf
    return x, g


def _call(op, x, dim, kwargs):
    if op == "topk":
        return torch.topk(x, dim=dim, **kwargs)
    if op == "sort":
        return x.sort(dim=dim, **kwargs)
    return None, torch.argsort(x, dim=dim, **kwargs)


def _sharded(op, mesh_shape, placements, shape, dim, kwargs, kind, dtype):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    x, g = _data(shape, kind, dtype)
    differentiable = dtype.is_floating_point and op != "argsort"
    xd = so.distribute_tensor(x, mesh, placements).requires_grad_(differentiable)
    with so.CommDebugMode() as forward:
        values, indices = _call(op, xd, dim, kwargs)
    out = {"indices": indices.full_tensor(), "layout": indices.placements, "forward": forward.log}
    if values is not None:
        out["values"] = values.full_tensor()
    if differentiable:
        grad = torch.randn(values.shape, generator=g, dtype=torch.float64).to(dtype)
        gd = so.distribute_tensor(grad, mesh, values.placements)
        with so.CommDebugMode() as backward:
            values.backward(gd)
        out.update(
            grad_out=grad,
            dx=xd.grad.full_tensor(),
            dx_layout=xd.grad.placements,
            backward=backward.log,
            x_layout=xd.placements,
            local_numel=xd.to_local().numel(),
        )
    return out


def _run(op, mesh_shape, placements, shape, dim, kwargs, kind="randn", dtype=torch.float64):
    return so.run(_sharded, math.prod(mesh_shape), op, mesh_shape, placements, shape, dim, kwargs, kind, dtype)


def _stable_reference(x, dim, descending, k=None):
    v, i = torch.sort(x, dim=dim, descending=descending, stable=True)
    return (v, i) if k is None else (v.narrow(dim, 0, k), i.narrow(dim, 0, k))


def _assert_values(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _check(op, mesh_shape, placements, shape, dim, kwargs, kind="randn", dtype=torch.float64, tie_rule="torch"):
    """Values bitwise; indices torch's (or the stable reference, tie_rule="stable"); gradients torch's."""
    res = _run(op, mesh_shape, placements, shape, dim, kwargs, kind, dtype)[0]
    x, _ = _data(shape, kind, dtype)
    xr = x.clone().requires_grad_(dtype.is_floating_point and op != "argsort")
    # sorted=False leaves the order to the implementation; ours is the sorted one, so the
    # sorted=True reference pins it (the data has no ties there)
    want_v, want_i = _call(op, xr, dim, {**kwargs, "sorted": True} if op == "topk" else kwargs)
    if tie_rule == "stable":
        want_v, want_i = _stable_reference(x, dim, kwargs.get("largest", True), kwargs["k"])
    assert torch.equal(res["indices"], want_i)
    if want_v is not None:
        _assert_values(res["values"], want_v.detach())
    if "dx" in res:
        if tie_rule == "stable":
            want_dx = torch.zeros_like(x).scatter(dim, want_i, res["grad_out"])
        else:
            want_v.backward(res["grad_out"])
            want_dx = xr.grad
        _assert_values(res["dx"], want_dx)
        assert res["dx_layout"] == res["x_layout"]  # the input's gradient keeps the input's layout
    return res


# ------------------------------------------------------------------ topk, sharded algorithm, exact bytes


def _topk_bytes(rows, k, itemsize):
    return rows * k * (itemsize + 4)  # values and int32 global indices, one all_gather


def test_topk_acceptance_f32():
    """f32[8, 4096] Shard(1), k=5 on 4 ranks: forward and backward together at most 2 KiB."""
    res = _run("topk", (4,), [Shard(1)], (8, 4096), 1, {"k": 5}, dtype=torch.float32)
    x, _ = _data((8, 4096), "randn", torch.float32)
    want = torch.topk(x, 5, 1)
    for r in res:
        assert torch.equal(r["values"], want.values) and torch.equal(r["indices"], want.indices)
        assert r["forward"] == [("all_gather", _topk_bytes(8, 5, 4))]
        assert r["backward"] == []  # each rank scatters the gradients it owns
        assert sum(b for _, b in r["forward"] + r["backward"]) == 320 <= 2048
        assert r["layout"] == (R,) and r["dx_layout"] == (Shard(1),)
    _check("topk", (4,), [Shard(1)], (8, 4096), 1, {"k": 5}, dtype=torch.float32)


TOPK_1D = [
    # id, shape, kwargs, data, tie rule; 1-d rows so the sharded algorithm is the cheapest plan
    pytest.param((64,), {"k": 5}, "ties", "stable", id="ties-largest"),
    pytest.param((64,), {"k": 5, "largest": False}, "ties", "stable", id="ties-smallest"),
    pytest.param((64,), {"k": 6}, "nan", "stable", id="nan-inf-largest"),  # NaNs tie with NaNs
    pytest.param((64,), {"k": 6, "largest": False}, "nan", "stable", id="nan-inf-smallest"),
    pytest.param((64,), {"k": 4, "sorted": False}, "randn", "torch", id="unsorted"),
    pytest.param((9,), {"k": 1}, "randn", "torch", id="empty-shard"),  # 3,3,3,0
    pytest.param((13,), {"k": 2}, "randn", "torch", id="short-shard"),  # 4,4,4,1: rank 3 sends a pad
]


@pytest.mark.parametrize("shape,kwargs,kind,tie_rule", TOPK_1D)
def test_topk_sharded_algorithm(shape, kwargs, kind, tie_rule):
    res = _check("topk", (4,), [Shard(0)], shape, 0, kwargs, kind, tie_rule=tie_rule)
    assert res["forward"] == [("all_gather", _topk_bytes(1, kwargs["k"], 8))]
    assert res["layout"] == (R,)


def test_topk_int64():
    res = _check("topk", (4,), [Shard(0)], (64,), 0, {"k": 3}, "perm", dtype=torch.int64)
    assert res["forward"] == [("all_gather", _topk_bytes(1, 3, 8))]


@pytest.mark.parametrize(
    "placements,rows",
    [
        pytest.param([Shard(0), Shard(1)], 2, id="rows-and-dim"),
        pytest.param([Shard(1), Shard(1)], 4, id="nested"),
        pytest.param([StridedShard(1, 2), Shard(1)], 4, id="strided"),
    ],
)
def test_topk_sharded_mesh2x2(placements, rows):
    # rows wide enough that moving them (an all_to_all onto dim 0) costs more than one joint
    # all_gather of k per rank over 4 ranks (at 64 columns the two are within bytes of each other)
    res = _check("topk", (2, 2), placements, (4, 1024), 1, {"k": 3})
    assert res["forward"] == [("all_gather", _topk_bytes(rows, 3, 8))]  # one collective, whatever the group


# ------------------------------------------------------------------ sort / argsort over a sharded dim

SORTS = [
    pytest.param("sort", {}, "randn", id="sort"),
    pytest.param("sort", {"descending": True}, "nan", id="sort-desc-nan"),
    pytest.param("sort", {"stable": True}, "ties", id="sort-stable-ties"),
    pytest.param("sort", {"descending": True, "stable": True}, "ties", id="sort-desc-stable-ties"),
    pytest.param("sort", {}, "ties", id="sort-unstable-ties"),  # torch's own sort of whole rows: its order
    pytest.param("argsort", {"stable": True}, "ties", id="argsort-stable-ties"),
    pytest.param("argsort", {"descending": True}, "randn", id="argsort-desc"),
]


@pytest.mark.parametrize("op,kwargs,kind", SORTS)
def test_sort_sharded_dim(op, kwargs, kind):
    """(50,) over 4 ranks (13,13,13,11): gather the dim, sort, keep the own slice: outputs stay S(0)."""
    for r in _run(op, (4,), [Shard(0)], (50,), 0, kwargs, kind):
        assert r["layout"] == (Shard(0),)
    res = _check(op, (4,), [Shard(0)], (50,), 0, kwargs, kind)
    if op == "sort":  # forward: the rank's own values; backward: its (grad, index) pairs, one round each
        n = res["local_numel"]
        assert res["forward"] == [("all_gather", n * 8)]
        assert res["backward"] == [("all_gather", n * 16)]


@pytest.mark.parametrize(
    "placements",
    [
        pytest.param([Shard(0), Shard(0)], id="nested"),
        pytest.param([StridedShard(0, 2), Shard(0)], id="strided"),
    ],
)
@pytest.mark.parametrize("op,kwargs", [("sort", {"stable": True}), ("topk", {"k": 2})], ids=["sort", "topk"])
def test_sort_topk_1d_mesh2x2(op, kwargs, placements):
    _check(op, (2, 2), placements, (30,), 0, kwargs, "ties", tie_rule="stable" if op == "topk" else "torch")


@pytest.mark.parametrize(
    "op,kwargs", [("topk", {"k": 3}), ("sort", {}), ("argsort", {"stable": True})], ids=["topk", "sort", "argsort"]
)
def test_unsharded_dim_is_local(op, kwargs):
    res = _check(op, (4,), [Shard(0)], (8, 6), 1, kwargs, "ties" if op != "topk" else "randn")
    assert res["forward"] == [] and res["layout"] == (Shard(0),)
    assert res.get("backward", []) == []


# ------------------------------------------------------------------ the grid: any layout, any plan

GRID_OPS = {
    "topk-k1": ("topk", {"k": 1}),
    "topk-k3-smallest": ("topk", {"k": 3, "largest": False}),
    "sort": ("sort", {}),
    "sort-desc-stable": ("sort", {"descending": True, "stable": True}),
    "argsort-stable": ("argsort", {"stable": True}),
}
GRID_LAYOUTS = {
    (4,): {"S0": [Shard(0)], "S1": [Shard(1)], "R": [R]},
    (2, 2): {
        "S0,S1": [Shard(0), Shard(1)],
        "S1,S0": [Shard(1), Shard(0)],
        "S1,S1": [Shard(1), Shard(1)],
        "R,S1": [R, Shard(1)],
    },
}
GRID = [
    pytest.param(name, mesh, layout, dim, kind, id=f"{name}-{'x'.join(map(str, mesh))}-{layout}-dim{dim}-{kind}")
    for name in GRID_OPS
    for mesh, layouts in GRID_LAYOUTS.items()
    for layout in layouts
    for dim in (0, 1)
    for kind in ("randn", "ties")
]
SAMPLE = random.Random(0).sample(GRID, 16)


def _grid_case(name, mesh, layout, dim, kind):
    op, kwargs = GRID_OPS[name]
    shape = (6, 9)  # over 4 ranks: 2,2,2,0 and 3,3,3,0: empty shards
    res = _run(op, mesh, GRID_LAYOUTS[mesh][layout], shape, dim, kwargs, kind)[0]
    x, _ = _data(shape, kind)
    if op == "topk":
        want_v, _ = torch.topk(x, dim=dim, **kwargs)
        _assert_values(res["values"], want_v)
        picked = x.gather(dim, res["indices"])  # the indices point at those values, each once
        _assert_values(picked, want_v)
        assert all(
            len(set(row.tolist())) == row.numel() for row in res["indices"].movedim(dim, -1).reshape(-1, kwargs["k"])
        )
        if kind == "randn":
            _check(op, mesh, GRID_LAYOUTS[mesh][layout], shape, dim, kwargs, kind)
    else:
        _check(op, mesh, GRID_LAYOUTS[mesh][layout], shape, dim, kwargs, kind)


@pytest.mark.parametrize("name,mesh,layout,dim,kind", SAMPLE)
def test_sorting_sample(name, mesh, layout, dim, kind):
    _grid_case(name, mesh, layout, dim, kind)  # asserts values, indices and gradients against torch inside
    assert name in GRID_OPS


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh,layout,dim,kind", GRID)
def test_sorting_grid(name, mesh, layout, dim, kind):
    _grid_case(name, mesh, layout, dim, kind)  # asserts values, indices and gradients against torch inside
    assert name in GRID_OPS


def _topk_k_too_large():
    mesh = so.init_device_mesh("cpu", (4,))
    xd = so.distribute_tensor(torch.zeros(3, 8), mesh, [Shard(1)])
    with so.CommDebugMode() as comm:
        with pytest.raises(
            so.ShardingError,
            match=r"topk: k=9 is out of range for dim 1 of size 8 of float32\[3, 8\]:S\(1\); use 0 <= k <= 8\.",
        ):
            torch.topk(xd, 9, dim=1)
    return comm.get_total_counts()


def test_topk_k_out_of_range_raises_before_moving_data():
    assert so.run(_topk_k_too_large, 4) == [0] * 4
