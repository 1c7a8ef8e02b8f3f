"""torch compatibility and reliability items, each against single-device torch.

distribute_tensor's src_data_rank (group rank on each mesh dim), _foreach ops and optimizers over
parameters of several meshes, prims.* ops, softmax with dtype=, sort/topk on 0-dim tensors,
linalg__powsum / _foreach_powsum, var_mean of rows holding +-inf, cat with a 1-d empty DTensor,
int32 class targets, and one canonical resolution of a norm pending on several mesh dims.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from index_harness import S0, S1, R, check
from shardops import NormPartial, Replicate, Shard

GEN = torch.Generator().manual_seed(0)
aten = torch.ops.aten


def _strict(fn):
    def body(*args):
        so.set_strict(True)
        try:
            return fn(*args)
        finally:
            so.set_strict(False)

    return body


# ------------------------------------------------------------------ distribute_tensor(src_data_rank)


def test_src_data_rank_is_the_group_rank_on_every_mesh_dim():
    """As in torch: on a sub-mesh without global rank 0 the default source is the sub-mesh's first rank;
    src_data_rank=1 on a (2, 2) mesh is the rank at coordinate (1, 1)."""

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        mine = torch.full((4, 2), float(mesh.get_rank()))
        sub = mesh["a"]  # ranks (0, 2) or (1, 3)
        first = so.distribute_tensor(mine, sub, [Shard(0)]).full_tensor()
        second = so.distribute_tensor(mine, sub, [Replicate()], src_data_rank=1).full_tensor()
        corner = so.distribute_tensor(mine, mesh, [Shard(0), Shard(1)], src_data_rank=1).full_tensor()
        return sub.mesh.tolist(), first[0, 0].item(), second[0, 0].item(), corner.unique().tolist()

    for ranks, first, second, corner in so.run(body, 4):
        assert first == ranks[0] and second == ranks[1]
        assert corner == [3.0]


def test_src_data_rank_out_of_range_is_refused():
    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        so.distribute_tensor(torch.ones(4), mesh, [Shard(0), Replicate()], src_data_rank=2)

    with pytest.raises(so.ShardingError, match="src_data_rank=2"):
        so.run(body, 4)


# ------------------------------------------------------------------ several meshes


def _two_mesh_params(ws, gs, layouts):
    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    meshes = [mesh["a"], mesh["b"]]
    params = []
    for w, g, m, pl in zip(ws, gs, meshes, layouts):
        p = torch.nn.Parameter(so.distribute_tensor(w, m, pl))
        p.grad = so.distribute_tensor(g, m, pl)
        params.append(p)
    return params


def test_foreach_ops_across_meshes_go_position_by_position():
    a, b = torch.randn(8, 6, generator=GEN), torch.randn(5, 7, generator=GEN)

    @_strict
    def body():
        pa, pb = _two_mesh_params([a, b], [a, b], [[S0], [S1]])
        with so.CommDebugMode() as comm:
            added = torch._foreach_add([pa.detach(), pb.detach()], [pa.detach(), pb.detach()], alpha=0.5)
            torch._foreach_mul_([pa.grad, pb.grad], 3.0)
            norms = torch._foreach_norm([pa.grad, pb.grad])
        return comm.get_total_counts(), [t.full_tensor() for t in added], [n.full_tensor() for n in norms]

    for counts, added, norms in so.run(body, 4):
        assert counts == 0
        torch.testing.assert_close(added, [a * 1.5, b * 1.5])
        torch.testing.assert_close(norms, [(a * 3).norm(), (b * 3).norm()])


def test_foreach_optimizer_over_parameters_of_two_meshes():
    ws = [torch.randn(8, 6, generator=GEN), torch.randn(6, 5, generator=GEN)]
    gs = [torch.randn_like(w) for w in ws]

    @_strict
    def body():
        params = _two_mesh_params(ws, gs, [[S0], [S1]])
        opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
        with so.CommDebugMode() as comm:
            opt.step()
            opt.step()
        return comm.get_total_counts(), [p.full_tensor() for p in params]

    ref = [torch.nn.Parameter(w.clone()) for w in ws]
    for r, g in zip(ref, gs):
        r.grad = g.clone()
    opt = torch.optim.AdamW(ref, lr=0.1, foreach=True)
    opt.step()
    opt.step()
    for counts, values in so.run(body, 4):
        assert counts == 0
        torch.testing.assert_close(values, [r.detach() for r in ref])


def test_clip_grad_norm_per_mesh_keeps_one_collective_per_group():
    """clip_grad_norm_ over the parameters of one mesh (what torch supports): many tensors, one all_reduce
    per mesh dim that shards a gradient. Parameters of two meshes in one call are refused, as by torch."""
    ws = [torch.randn(8, 6, generator=GEN), torch.randn(6, 5, generator=GEN), torch.randn(7, generator=GEN)]
    gs = [torch.randn_like(w) for w in ws]

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        layouts = [[S0, S1], [R, S1], [S0, R]]
        params = []
        for w, g, pl in zip(ws, gs, layouts):
            p = torch.nn.Parameter(so.distribute_tensor(w, mesh, pl))
            p.grad = so.distribute_tensor(g, mesh, pl)
            params.append(p)
        with so.CommDebugMode() as comm:
            total = torch.nn.utils.clip_grad_norm_(params, 1.0)
        counts = comm.get_comm_counts()
        a, b = _two_mesh_params(ws[:2], gs[:2], [[S0], [S1]])
        try:
            torch.nn.utils.clip_grad_norm_([a, b], 1.0)
            refused = ""
        except (so.ShardingError, RuntimeError) as e:
            refused = str(e)
        return counts, total.full_tensor(), [p.grad.full_tensor() for p in params], refused

    ref = [torch.nn.Parameter(w.clone()) for w in ws]
    for r, g in zip(ref, gs):
        r.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    for counts, total, grads, refused in so.run(body, 4):
        assert counts.get("all_reduce", 0) <= 2 and sum(counts.values()) <= 2, counts
        torch.testing.assert_close(total, want)
        torch.testing.assert_close(grads, [r.grad for r in ref])
        assert "mesh" in refused


# ------------------------------------------------------------------ registrations


def test_prims_pointwise_ops_and_view_of():
    """PyTorch's DTensor test_prims_pointwise_ops / test_prims_view_of: sharded, no fallback."""
    x, y = torch.randn(12, 8, generator=GEN), torch.randn(12, 8, generator=GEN)
    prims = torch.ops.prims
    unary = [
        prims.bessel_i0e,
        prims.bessel_i1,
        prims.bessel_i1e,
        prims.bessel_j0,
        prims.bessel_j1,
        prims.erfcx,
        prims.ndtri,
        prims.spherical_bessel_j0,
    ]

    @_strict
    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        dx, dy = so.distribute_tensor(x, mesh, [S0]), so.distribute_tensor(y, mesh, [S0])
        with so.CommDebugMode() as comm:
            outs = [op(dx.abs().clamp(0.1, 3.0)) for op in unary]
            outs += [prims.div(dx, dy), prims.ne(dx, dy), prims.gcd(dx.int(), dy.int()), prims.view_of(dx)]
        return comm.get_total_counts(), [(o.placements, o.full_tensor()) for o in outs]

    want = [op(x.abs().clamp(0.1, 3.0)) for op in unary] + [
        prims.div(x, y),
        prims.ne(x, y),
        prims.gcd(x.int(), y.int()),
        x,
    ]
    for counts, outs in so.run(body, 4):
        assert counts == 0
        for (placements, value), w in zip(outs, want):
            assert placements == (S0,)
            torch.testing.assert_close(value, w, equal_nan=True)


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: torch.softmax(t, 1, dtype=torch.float64),
        lambda t: torch.log_softmax(t, 1, dtype=torch.float64),
        lambda t: F.softmin(t, 1, dtype=torch.float64),
        lambda t: t.softmax(-1, dtype=torch.float64),
    ],
    ids=["softmax", "log_softmax", "softmin", "method"],
)
def test_softmax_with_dtype_takes_the_sharded_path(fn):
    """dtype= casts first (x.to(dtype) passes device=, which once defeated the meta run and gathered)."""
    x = torch.randn(4, 256, generator=GEN)
    got = check(fn, [x], (4,), [[S1]])
    shard_bytes = 4 * 64 * 8  # one float64 shard of the output
    assert got["fwd"] < shard_bytes / 4 and got["bwd"] < shard_bytes / 4, (got["fwd"], got["bwd"])
    assert got["layout"] == (S1,)


@pytest.mark.parametrize("op", ["sort", "topk"])
def test_sort_and_topk_backward_on_a_0_dim_tensor(op):
    fn = (lambda t: torch.sort(t).values * 2) if op == "sort" else (lambda t: torch.topk(t, 1).values * 2)
    check(fn, [torch.tensor(3.0, dtype=torch.float64)], (4,), [[R]])
    check(fn, [torch.tensor(3.0, dtype=torch.float64)], (2, 2), [[R, R]])


def test_powsum_ops_are_pending_sums():
    x = torch.randn(8, 12, generator=GEN, dtype=torch.float64)

    @_strict
    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        d = so.distribute_tensor(x, mesh, [S0, S1])
        with so.CommDebugMode() as comm:
            rows = aten.linalg__powsum(d, 3, [1])
            both = aten._foreach_powsum([d, d.t()], 0.5)
        return comm.get_total_counts(), rows.placements, rows.full_tensor(), [b.full_tensor() for b in both]

    for counts, placements, rows, both in so.run(body, 4):
        assert counts == 0 and placements == (S0, so.Partial("sum"))
        torch.testing.assert_close(rows, aten.linalg__powsum(x, 3, [1]))
        torch.testing.assert_close(both, aten._foreach_powsum([x, x.t()], 0.5))


# ------------------------------------------------------------------ reliability items


def test_var_mean_of_rows_holding_inf_follows_torchs_welford():
    """torch's mean of a row holding +-inf is NaN unless the only infinity is the row's last element."""
    g = torch.Generator().manual_seed(3)
    cases = []
    for trial in range(12):
        x = torch.randn(3, 11, generator=g, dtype=torch.float64)
        for r in range(3):
            k = int(torch.randint(0, 3, (1,), generator=g))
            x[r, torch.randperm(11, generator=g)[:k]] = torch.where(
                torch.rand(k, generator=g) > 0.5, math.inf, -math.inf
            ).double()
        x[trial % 3, -1] = math.inf if trial % 2 else x[trial % 3, -1]
        cases.append(x)
    fns = [
        lambda t: torch.var_mean(t, 1),
        lambda t: torch.std_mean(t, 1, correction=0),
        lambda t: torch.var_mean(t, (0, 1)),
    ]

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        bad = []
        for k, x in enumerate(cases):
            for pl in ([S1, R], [S0, S1], [S1, S1]):
                d = so.distribute_tensor(x, mesh, pl)
                for j, fn in enumerate(fns):
                    got, want = fn(d), fn(x)
                    if not all(torch.allclose(a.full_tensor(), b, equal_nan=True) for a, b in zip(got, want)):
                        bad.append((k, pl, j))
        return bad

    assert so.run(body, 4)[0] == []


def test_cat_with_an_empty_vector_gives_dtensor_gradients():
    a, b = torch.zeros(0, dtype=torch.float64), torch.randn(5, generator=GEN, dtype=torch.float64)
    with so.allow_replicate(torch.cat):  # cat along the sharded dim of 1-d tensors gathers (strict mode asks)
        got = check(lambda x, y: torch.cat([x, y]), [a, b], (2,), [[S0], [S0]])
        assert got["grad_layouts"][0] is not None  # a DTensor gradient, laid out like its input
        check(lambda x, y: torch.cat([y, x, y]), [a, b], (2, 2), [[S0, R], [R, S0]])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_class_target_dtypes_as_torch(dtype):
    logits = torch.randn(3, 5, generator=GEN)
    target = torch.tensor([0, 4, 2]).to(dtype)
    try:
        want = F.cross_entropy(logits, target)
    except RuntimeError:
        want = None

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(logits, mesh, [S1])
        try:
            return F.cross_entropy(x, so.from_local(target, mesh, [R])).full_tensor()
        except so.ShardingError as e:
            return str(e)

    for got in so.run(body, 2):
        if want is None:
            assert isinstance(got, str) and "Long or Byte" in got
        else:
            torch.testing.assert_close(got, want)


def test_norm_pending_on_several_mesh_dims_resolves_the_same_on_every_plan():
    """Resolving to Replicate, or through shards first, gives bitwise the same values (one canonical order)."""

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        diffs = 0
        for seed in range(10):
            for p in (2.0, 3.0, 0.5):
                g = torch.Generator().manual_seed(seed * 7 + mesh.get_rank())
                local = torch.rand(5, 3, generator=g) * 10
                d = so.DTensor.from_local(local, mesh, [NormPartial(p), NormPartial(p)])
                whole = d.full_tensor()
                for target in ([S0, S1], [R, S0], [S1, S0], [S0, R]):
                    diffs += not torch.equal(whole, d.redistribute(placements=target).full_tensor())
        with so.CommDebugMode() as comm:
            d.full_tensor()
        return diffs, comm.get_total_counts()

    for diffs, counts in so.run(body, 4):
        assert diffs == 0
        assert counts == 1  # one joint all_reduce over both mesh dims
