"""The DTensor type: pointwise ops with autograd, pending partials, views, in-place ops, errors."""

import pytest
import torch

import shardops as so
from shardops import Partial, Replicate, Shard

LAYOUTS_1D = {
    "S0,S1,R": ([Shard(0)], [Shard(1)], [Replicate()]),
    "S1,R,S0": ([Shard(1)], [Replicate()], [Shard(0)]),
    "R,S0,R": ([Replicate()], [Shard(0)], [Replicate()]),
    "S0,S0,S0": ([Shard(0)], [Shard(0)], [Shard(0)]),
}
LAYOUTS_2D = {
    "S0S1,R S0,R R": ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Replicate(), Replicate()]),
    "S1S0,S0 R,S0 R": ([Shard(1), Shard(0)], [Shard(0), Replicate()], [Shard(0), Replicate()]),
    "S0S0,R R,S0 S0": ([Shard(0), Shard(0)], [Replicate(), Replicate()], [Shard(0), Shard(0)]),
}


def _fn(a, b, c):
    return a * b + c.exp() - 2


def _pointwise_case(mesh_shape, layouts, shapes):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    dts = [so.distribute_tensor(f.detach(), mesh, pl).requires_grad_() for f, pl in zip(fulls, layouts)]
    out = _fn(*dts)
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * so.distribute_tensor(weight, mesh, out.placements)).sum().full_tensor().backward() if False else None
    loss = (out * out).full_tensor().sum()
    loss.backward()
    ref = (_fn(*fulls) ** 2).sum()
    grads = torch.autograd.grad(ref, fulls)
    return (
        torch.allclose(out.full_tensor(), _fn(*fulls)),
        torch.allclose(loss, ref),
        [torch.allclose(d.grad.full_tensor(), g_) for d, g_ in zip(dts, grads)],
        [d.grad.placements for d in dts],
    )


@pytest.mark.parametrize("layouts", list(LAYOUTS_1D.values()), ids=list(LAYOUTS_1D))
@pytest.mark.parametrize("shapes", [((6, 5), (5,), (6, 1)), ((7, 3), (7, 3), (3,))], ids=["bcast", "uneven"])
def test_pointwise_autograd_mesh4(layouts, shapes):
    layouts = [
        pl if all(p.dim < len(s) for p in pl if p.is_shard()) else [Replicate()] for pl, s in zip(layouts, shapes)
    ]
    for vals, loss_ok, grads_ok, _ in so.run(_pointwise_case, 4, (4,), layouts, shapes):
        assert vals and loss_ok and all(grads_ok)


@pytest.mark.parametrize("layouts", list(LAYOUTS_2D.values()), ids=list(LAYOUTS_2D))
def test_pointwise_autograd_mesh2x2(layouts):
    shapes = ((6, 5), (6, 5), (6, 1))
    layouts = [
        [p if not p.is_shard() or shapes[k][p.dim] > 1 else Replicate() for p in pl] for k, pl in enumerate(layouts)
    ]
    for vals, loss_ok, grads_ok, _placements in so.run(_pointwise_case, 4, (2, 2), layouts, shapes):
        assert vals and loss_ok and all(grads_ok)


def test_sharded_input_gets_gradient_in_its_own_layout():
    out = so.run(_pointwise_case, 4, (4,), ([Shard(1)], [Shard(1)], [Shard(1)]), ((6, 8), (6, 8), (6, 8)))
    assert out[0][3] == [(Shard(1),)] * 3


# ------------------------------------------------------------------ pending partials


def _partial_rules():
    mesh = so.init_device_mesh("cpu", (4,))
    r = mesh.get_rank()
    local = torch.tensor([1.0 + r, -2.0 * r, 0.5])  # true value = sum over ranks
    true = sum(torch.tensor([1.0 + k, -2.0 * k, 0.5]) for k in range(4))
    p = so.DTensor.from_local(local, mesh, [Partial()])
    q = so.DTensor.from_local(local * 3, mesh, [Partial()])
    rep = so.distribute_tensor(torch.tensor([2.0, 3.0, -1.0]), mesh, [Replicate()])
    cases = {
        "P+P": (p + q, true * 4),
        "P*scalar": (p * 2.5, true * 2.5),
        "P*R": (p * rep, true * torch.tensor([2.0, 3.0, -1.0])),
        "R*P": (rep * p, true * torch.tensor([2.0, 3.0, -1.0])),
        "-P": (-p, -true),
        "P/scalar": (p / 4, true / 4),
    }
    out = {}
    for name, (dt, want) in cases.items():
        out[name] = (dt.placements, torch.allclose(dt.full_tensor(), want))
    plus_one = p + 1
    out["P+1"] = (plus_one.placements, torch.allclose(plus_one.full_tensor(), true + 1))
    with so.CommDebugMode() as comm:
        p + q
        p * 2.5
        p * rep
        _ = -p
    out["comm"] = comm.get_total_counts()
    return out


def test_partial_sum_stays_pending_where_exact():
    out = so.run(_partial_rules, 4)[0]
    for name in ("P+P", "P*scalar", "P*R", "R*P", "-P", "P/scalar"):
        placements, ok = out[name]
        assert placements == (Partial(),), name
        assert ok, name
    assert out["comm"] == 0  # linear ops on pending sums issue no collective


def test_partial_plus_scalar_adds_it_once():
    placements, ok = so.run(_partial_rules, 4)[0]["P+1"]
    assert ok
    assert placements != (Partial(),)


def _scalar_cache():
    mesh = so.init_device_mesh("cpu", (2,))
    x = so.distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    return [
        (x * 2).full_tensor().tolist(),
        (x * 3).full_tensor().tolist(),
        (x * 2.0).full_tensor().tolist(),
        (x + True).full_tensor().tolist(),
        (x + 1).full_tensor().tolist(),
        (x * -1).full_tensor().tolist(),
    ]


def test_cache_keys_on_scalar_arguments():
    a, b, c, d, e, f = so.run(_scalar_cache, 2)[0]
    assert a == [0, 2, 4, 6] and b == [0, 3, 6, 9] and c == a
    assert d == e == [1, 2, 3, 4] and f == [0, -1, -2, -3]


def _negative_scalar_swaps_max_min():
    mesh = so.init_device_mesh("cpu", (2,))
    r = mesh.get_rank()
    p = so.DTensor.from_local(torch.tensor([1.0, 5.0]) * (r + 1), mesh, [Partial("max")])
    y = p * -2
    return y.placements, y.full_tensor().tolist()


def test_negative_scalar_turns_pending_max_into_min():
    placements, value = so.run(_negative_scalar_swaps_max_min, 2)[0]
    assert value == [-4.0, -20.0]
    assert placements in ((Partial("min"),), (Replicate(),), (Shard(0),))


# ------------------------------------------------------------------ views


def _views():
    mesh = so.init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(1)
    full = torch.randn(4, 6, 5, generator=g)
    x = so.distribute_tensor(full, mesh, [Shard(0), Shard(2)])
    results = {
        "view": (x.view(4, 30), full.view(4, 30)),
        "reshape_split": (x.reshape(2, 2, 6, 5), full.reshape(2, 2, 6, 5)),
        "permute": (x.permute(2, 0, 1), full.permute(2, 0, 1)),
        "transpose": (x.transpose(0, 2), full.transpose(0, 2)),
        "unsqueeze": (x.unsqueeze(1), full.unsqueeze(1)),
        "squeeze": (x.unsqueeze(0).squeeze(0), full),
        "expand": (x[:, :1].expand(4, 3, 5), full[:, :1].expand(4, 3, 5)),
        "select": (x[:, 2], full[:, 2]),
        "slice": (x[:, 1:4], full[:, 1:4]),
        "flatten_uneven": (x.flatten(1), full.flatten(1)),
    }
    return {k: (torch.equal(v.full_tensor(), w), v.placements) for k, v, w in ((k, *vw) for k, vw in results.items())}


def test_view_ops_match_torch():
    out = so.run(_views, 4)[0]
    for name, (ok, _) in out.items():
        assert ok, name
    assert out["permute"][1] == (Shard(1), Shard(0))
    assert out["unsqueeze"][1] == (Shard(0), Shard(3))


# ------------------------------------------------------------------ in-place, fallback, errors


def _inplace_add():
    mesh = so.init_device_mesh("cpu", (2,))
    x = so.distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(1)])
    y = so.distribute_tensor(torch.ones(2, 3), mesh, [Shard(0)])
    x.add_(y)
    return x.placements, x.full_tensor().tolist()


def test_inplace_keeps_self_layout():
    placements, value = so.run(_inplace_add, 2)[0]
    assert placements == (Shard(1),)
    assert value == [[1, 2, 3], [4, 5, 6]]


def _inplace_resolves_partial():
    mesh = so.init_device_mesh("cpu", (2,))
    r = mesh.get_rank()
    p = so.DTensor.from_local(torch.tensor([1.0, 2.0]) * (r + 1), mesh, [Partial()])
    local_before = p.to_local()
    p.add_(1.0)
    return p.placements, p.full_tensor().tolist(), p.to_local().data_ptr() == local_before.data_ptr()


def test_inplace_add_scalar_resolves_pending_partial_in_place():
    placements, value, same_storage = so.run(_inplace_resolves_partial, 2)[0]
    assert placements == (Replicate(),)
    assert value == [4.0, 7.0]
    assert same_storage


def test_inplace_needing_layout_change_raises():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
        x.unsqueeze_(0)  # fine: keeps the shard (renumbered)
        assert x.shape == (1, 4, 4) and x.placements == (Shard(1),)
        x.transpose_(1, 2)  # fine: an in-place view renumbers the shard dim, no data moves
        assert x.placements == (Shard(2),)
        z = so.distribute_tensor(torch.zeros(1, 4), mesh, [Shard(0)])
        z.squeeze_(0)  # drops the sharded dim: self's data would have to move

    with pytest.raises(so.ShardingError, match="in-place"):
        so.run(body, 2)


def test_ops_across_meshes_raise():
    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        a = so.distribute_tensor(torch.ones(4), mesh["dim_0"] if mesh.mesh_dim_names else mesh, [Shard(0), Replicate()])
        other = so.DeviceMesh("cpu", torch.arange(4).reshape(4))
        b = so.distribute_tensor(torch.ones(4), other, [Replicate()], src_data_rank=None)
        return a + b

    with pytest.raises(so.ShardingError, match="different meshes"):
        so.run(body, 4)


def test_from_local_with_inconsistent_shape_raises():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        return so.DTensor.from_local(torch.ones(3, 2), mesh, [Shard(0)], shape=(4, 2))

    with pytest.raises(so.ShardingError, match="local tensor of shape"):
        so.run(body, 2)


def test_from_local_uneven_with_shape():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        local = torch.ones(3, 2) if mesh.get_rank() == 0 else torch.ones(2, 2)
        return so.DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 2)).full_tensor().shape

    assert so.run(body, 2) == [torch.Size([5, 2])] * 2


def _no_strategy():
    mesh = so.init_device_mesh("cpu", (2,))
    x = so.distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
    index = so.distribute_tensor(torch.tensor([4, 0, 1]), mesh, [Replicate()])
    return torch.ops.aten.take.default(x, index).full_tensor().tolist()


def test_fallback_warns_with_bytes_and_is_exact():
    # NOTE: an op with no strategy (roll was the example until ops/indexing.py gave it one)
    with pytest.warns(so.FallbackWarning, match=r"aten.take.default has no sharded strategy.*bytes moved"):
        out = so.run(_no_strategy, 2)
    assert out[0] == [4.0, 0.0, 1.0]


def test_strict_mode_raises_on_op_without_strategy(strict):
    with pytest.raises(so.ShardingError, match="no sharded strategy.*strict"):
        so.run(_no_strategy, 2)


def test_redistribute_backward_returns_gradient_to_source_layout():
    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        full = torch.randn(8, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        x = so.distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        y = x.redistribute(placements=[Shard(1)])
        (y * y).full_tensor().sum().backward()
        return x.grad.placements, torch.allclose(x.grad.full_tensor(), 2 * full)

    placements, ok = so.run(body, 4)[0]
    assert placements == (Shard(0),) and ok


def test_distribute_tensor_takes_source_rank_data():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        mine = torch.full((4,), float(mesh.get_rank()))
        return so.distribute_tensor(
            mine, mesh, [Shard(0)], src_data_rank=1
        ).full_tensor().tolist(), so.distribute_tensor(
            mine, mesh, [Replicate()], src_data_rank=None
        ).to_local().tolist()

    out = so.run(body, 2)
    assert out[0][0] == out[1][0] == [1.0] * 4
    assert out[0][1] == [0.0] * 4 and out[1][1] == [1.0] * 4


def test_a_dtensor_never_wraps_a_dtensor():
    """Nested wrapping is refused where every DTensor is made (the whole suite runs with this check)."""

    def main():
        mesh = so.init_device_mesh("cpu", (2,))
        dt = so.distribute_tensor(torch.ones(4), mesh, [so.Shard(0)])
        with pytest.raises(so.ShardingError, match="would wrap another DTensor"):
            so.DTensor._make(dt, dt._spec)

    so.run(main, 2)
