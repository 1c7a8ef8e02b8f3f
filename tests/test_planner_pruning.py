"""The pruned candidate search (planner.choice.candidates) equals the exhaustive ranking.

Random ops (real rules from the registry), shapes, layouts (partials and NormPartial
included), link models and meshes of 1-4 dims: the best k candidates of the search
are the first k of `all_candidates`, compared by the whole rank key and the layouts.
Metadata only (TensorSpec operands on planning meshes): no world, no data.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.utils._pytree as pytree

import shardops as so
from shardops import cost
from shardops.dispatch import core
from shardops.dispatch.registry import RULES
from shardops.mesh import DeviceMesh
from shardops.placements import NormPartial, Partial, Replicate, Shard
from shardops.planner.choice import candidates
from shardops.planner.rows import rank_key
from shardops.planner.search import all_candidates
from shardops.spec import TensorMeta, TensorSpec, contiguous_stride

aten = torch.ops.aten
R = Replicate()


def _mesh(shape) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape))


def _spec(mesh, shape, placements, dtype=torch.float32) -> TensorSpec:
    return TensorSpec(mesh, tuple(placements), TensorMeta(tuple(shape), contiguous_stride(shape), dtype))


def _placement(rng: random.Random, ndim: int, partials: bool):
    choices: list[so.Placement] = [R] + [Shard(d) for d in range(ndim)]
    if partials:
        choices += [Partial("sum"), Partial("max"), NormPartial(2.0)]
    return rng.choice(choices)


def _layout(rng, ndim, mesh_ndim, partials=False):
    pl = [_placement(rng, ndim, partials) for _ in range(mesh_ndim)]
    kinds = {p for p in pl if p.is_partial()}
    return tuple(R if p.is_partial() and len(kinds) > 1 else p for p in pl)  # one partial kind per tensor


def _call(rng: random.Random, mesh):
    """A random (op, args, kwargs) on TensorSpec operands of 2-3 dims, uneven sizes included."""
    nd = rng.choice([2, 3])
    shape = tuple(rng.choice([1, 5, 8, 66, 1024, 4099]) for _ in range(nd))
    m = mesh.ndim
    x = _spec(mesh, shape, _layout(rng, nd, m, partials=rng.random() < 0.3))
    y = _spec(mesh, shape, _layout(rng, nd, m, partials=rng.random() < 0.3))
    d = rng.randrange(nd)
    kind = rng.choice(
        [
            "add",
            "mul",
            "add_",
            "where",
            "sum",
            "amax",
            "mean",
            "softmax",
            "log_softmax",
            "var",
            "cumsum",
            "layer_norm",
            "topk",
            "logsumexp",
            "sort",
            "norm",
            "mm",
            "view",
        ]
    )
    if kind == "mm":  # matrix rows: batch, column/row parallel, Partial(sum) x Replicate
        a, b, c = shape[0], shape[-1], rng.choice([3, 64, 4096])
        lhs = _spec(mesh, (a, b), _layout(rng, 2, m, partials=rng.random() < 0.3))
        rhs = _spec(mesh, (b, c), _layout(rng, 2, m, partials=rng.random() < 0.3))
        return aten.mm.default, (lhs, rhs), {}
    if kind == "view":  # view rows may hold on one mesh dim only (Row.mesh_dim)
        src = _spec(mesh, (shape[0], 6, 4), _layout(rng, 3, m))
        return aten.view.default, (src, [shape[0] * 6, 4] if rng.random() < 0.5 else [shape[0], 3, 8]), {}
    if kind == "add":
        return aten.add.Tensor, (x, y), {}
    if kind == "mul":
        return aten.mul.Tensor, (x, y), {}
    if kind == "add_":  # in place: the in-place filter sees complete candidates only
        return aten.add_.Tensor, (x, y), {}
    if kind == "where":
        cond = _spec(mesh, shape, _layout(rng, nd, m), torch.bool)
        return aten.where.self, (cond, x, y), {}
    if kind == "sum":
        return aten.sum.dim_IntList, (x, [d]), {}
    if kind == "amax":
        return aten.amax.default, (x, [d]), {}
    if kind == "mean":
        return aten.mean.dim, (x, [d], rng.random() < 0.5), {}
    if kind == "softmax":
        return aten._softmax.default, (x, d, False), {}
    if kind == "log_softmax":
        return aten._log_softmax.default, (x, d, False), {}
    if kind == "var":
        return aten.var.correction, (x, [d]), {"correction": 1}
    if kind == "cumsum":
        return aten.cumsum.default, (x, d), {}
    if kind == "layer_norm":
        w = _spec(mesh, shape[-1:], _layout(rng, 1, m))
        return aten.native_layer_norm.default, (x, [shape[-1]], w, w, 1e-5), {}
    if kind == "topk":
        return aten.topk.default, (x, min(3, shape[d]), d), {}
    if kind == "logsumexp":
        return aten.logsumexp.default, (x, [d]), {}
    if kind == "sort":
        return aten.sort.default, (x, d), {}
    return aten.linalg_vector_norm.default, (x, 2.0, [d]), {}


def _rows(func, args, kwargs):
    flat, tree = pytree.tree_flatten((args, kwargs))
    pos = [i for i, a in enumerate(flat) if isinstance(a, TensorSpec)]
    specs = tuple(flat[i] for i in pos)
    schema = core.make_schema(func, flat, tree, specs)
    metas = core.meta_outputs(func, flat, tree)
    if isinstance(metas, Exception):
        return None
    rows = RULES[func](schema)
    inplace = func._schema.arguments[0].alias_info is not None and func._schema.arguments[0].alias_info.is_write
    return (
        rows,
        specs,
        [(mt.shape, mt.dtype.itemsize) for mt in metas[0]],
        core._inplace_filter(specs) if inplace else None,
    )


def _links(rng, ndim):
    if rng.random() < 0.5:
        return (rng.choice(["threads", "gloo", "nvlink", "ib"]),) * ndim
    return tuple(rng.choice(["threads", "gloo", "nvlink", "ib"]) for _ in range(ndim))


def _summary(c, mesh_shape):
    return (rank_key(c, mesh_shape), c.inputs, c.outputs, c.algorithm)


MESH_SIZES = [1, 2, 3, 4, 8]
MAX_SPACE = 6000  # exhaustive enumeration is the slow side of the comparison


def _random_cases(seed: int, count: int):
    rng = random.Random(seed)
    made = 0
    while made < count:
        ndim = rng.choice([1, 2, 3, 4])
        mesh = _mesh(tuple(rng.choice(MESH_SIZES) for _ in range(ndim)))
        func, args, kwargs = _call(rng, mesh)
        try:
            got = _rows(func, args, kwargs)
        except so.ShardingError:
            continue
        if got is None:
            continue
        rows, specs, shapes, filt = got
        if (len(rows) + 1) ** ndim > MAX_SPACE:
            continue
        made += 1
        yield func, rows, specs, shapes, filt, cost.resolve_links(_links(rng, ndim), ndim), rng.choice([1, 1, 3, 8])


@pytest.mark.parametrize("seed", range(6))
def test_pruned_search_equals_exhaustive_ranking(seed):
    checked = 0
    for func, rows, specs, shapes, filt, links, k in _random_cases(seed, 60):
        mesh_shape = specs[0].mesh.shape
        exhaustive = all_candidates(rows, specs, shapes, links, filt)
        pruned = candidates(rows, specs, shapes, links, filt, limit=k)
        want = [_summary(c, mesh_shape) for c in exhaustive[:k]]
        got = [_summary(c, mesh_shape) for c in pruned]
        assert got == want, f"{func} on {[s for s in specs]} mesh {mesh_shape}: pruned {got[:1]} exhaustive {want[:1]}"
        if filt is None:
            assert pruned.total == exhaustive.total, f"{func}: space count {pruned.total} vs {exhaustive.total}"
        rep_p, rep_e = pruned.replicate, exhaustive.replicate
        assert (rep_p is None) == (rep_e is None)
        if rep_p is not None:
            assert _summary(rep_p, mesh_shape) == _summary(rep_e, mesh_shape)
        checked += 1
    assert checked == 60


def test_the_search_is_used_on_large_spaces_and_keeps_the_choice():
    """The ops of the planning benchmark on (4096,) and (8,8,8,8): the runtime's default
    (pruned) choice is the exhaustive choice."""
    for shape, layout in (((4096,), (Shard(1),)), ((8, 8, 8, 8), (Shard(0), Shard(1), Shard(1), Shard(1)))):
        mesh = _mesh(shape)
        x = _spec(mesh, (1024, 32768), layout)
        w = _spec(mesh, (32768,), (R,) * len(shape))
        calls = [
            (aten.sum.dim_IntList, (x, [1]), {}),
            (aten.add.Tensor, (x, x), {}),
            (aten._softmax.default, (x, 1, False), {}),
            (aten.var.correction, (x, [1]), {"correction": 1}),
            (aten.cumsum.default, (x, 1), {}),
            (aten.native_layer_norm.default, (x, [32768], w, w, 1e-5), {}),
        ]
        for func, args, kwargs in calls:
            rows, specs, shapes, filt = _rows(func, args, kwargs)
            links = cost.resolve_links(None, mesh.ndim)
            best = candidates(rows, specs, shapes, links, filt)[0]
            exhaustive = all_candidates(rows, specs, shapes, links, filt)
            assert _summary(best, shape) == _summary(exhaustive[0], shape), f"{func} on {shape}"
            report = core.plan_op(func, args, kwargs, limit=3)
            # plan_op prices its choice with the exact plan: compare the choice, not the estimate
            assert _summary(report.candidates[0], shape)[1:] == _summary(exhaustive[0], shape)[1:]
            assert [_summary(c, shape) for c in report.candidates[1:3]] == [_summary(c, shape) for c in exhaustive[1:3]]
            assert report.candidates.total == exhaustive.total
