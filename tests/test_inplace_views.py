"""In-place ops through views never lose a write silently (issue 42's class).

A view op on a DTensor either aliases its input locally, and an in-place op through it
changes the input exactly as on one device, or it had to move data (slice/select along
a sharded dim), and then an in-place op on the result raises a ShardingError naming the
op, the view op and what to do, leaving the input unchanged. Views of a pending sum
(Partial) share its data: resolving one of them in place while another is still pending
raises too, instead of leaving the other with its P label over resolved values.
Each case is compared with the same code on one device; uneven shards, (4,) and (2, 2).
"""

from __future__ import annotations

import math

import pytest
import torch

import shardops as so
from shardops import Partial, Replicate, Shard, ShardingError

R = Replicate()
S = Shard


def _full(shape) -> torch.Tensor:
    return torch.arange(float(math.prod(shape))).reshape(shape)


def _set(index, value):
    def write(t):
        t[index] = value

    return write


def _copy_rows(t):
    t[2:5].copy_(
        torch.full((3, t.shape[1]), -2.0)
        if not isinstance(t, so.DTensor)
        else _replicated(t, torch.full((3, t.shape[1]), -2.0))
    )


def _replicated(like: so.DTensor, value: torch.Tensor) -> so.DTensor:
    return so.distribute_tensor(value, like.device_mesh, [R] * like.device_mesh.ndim)


# (name, global shape, mesh shape, placements, write, the view aliases locally so the write must land)
CASES = [
    ("setitem rows of sharded dim", (10, 3), (4,), (S(0),), _set(slice(2, 5), 7.0), False),
    ("narrow add_", (10, 3), (4,), (S(0),), lambda t: t.narrow(0, 2, 3).add_(1), False),
    ("select zero_", (10, 3), (4,), (S(0),), lambda t: t[3].zero_(), False),
    ("slice copy_", (10, 3), (4,), (S(0),), _copy_rows, False),
    ("select mul_", (10, 3), (4,), (S(0),), lambda t: t.select(0, 1).mul_(2), False),
    ("setitem column of sharded dim 1", (10, 3), (4,), (S(1),), _set((slice(None), 1), 5.0), False),
    ("view of a copy: slice then select", (10, 3), (4,), (S(0),), lambda t: t[2:5][0].fill_(1.0), False),
    ("view of a copy: slice then t", (10, 3), (4,), (S(0),), lambda t: t[2:5].t().add_(1), False),
    ("setitem column, rows sharded (local view)", (10, 3), (4,), (S(0),), _set((slice(None), 1), 5.0), True),
    ("slice unsharded dim add_ (local view)", (10, 6), (4,), (S(0),), lambda t: t[:, 1:4].add_(1), True),
    ("replicated setitem (local view)", (10, 3), (4,), (R,), _set(slice(2, 5), 7.0), True),
    ("2-D: setitem rows", (10, 6), (2, 2), (S(0), S(1)), _set(slice(2, 5), 7.0), False),
    ("2-D: slice columns add_", (10, 6), (2, 2), (S(0), S(1)), lambda t: t[:, 1:4].add_(1), False),
    ("2-D: select then slice zero_", (10, 6), (2, 2), (S(0), S(1)), lambda t: t[3, 2:5].zero_(), False),
    ("2-D: rows replicated, columns sharded (local view)", (10, 6), (2, 2), (R, S(1)), _set(slice(2, 5), 7.0), True),
]
IDS = [c[0] for c in CASES]


def _run_write(shape, mesh_shape, placements, write):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    full = _full(shape)
    x = so.distribute_tensor(full, mesh, list(placements))
    try:
        write(x)
    except ShardingError as e:
        return "raised", str(e), x.full_tensor()
    return "wrote", None, x.full_tensor()


@pytest.mark.parametrize("name,shape,mesh_shape,placements,write,aliases", CASES, ids=IDS)
def test_write_through_view_lands_or_raises(name, shape, mesh_shape, placements, write, aliases):
    expected = _full(shape)
    write(expected)
    results = so.run(_run_write, math.prod(mesh_shape), shape, mesh_shape, placements, write)
    assert len({r[0] for r in results}) == 1, results  # every rank takes the same way
    for kind, message, base in results:
        if kind == "wrote":
            torch.testing.assert_close(base, expected, rtol=0, atol=0)  # the write reached the base exactly
        else:
            assert not aliases, message  # a local view must never refuse
            torch.testing.assert_close(base, _full(shape), rtol=0, atol=0)  # refused: the base is unchanged
            assert "aten." in message and "copy, not a view" in message and ".clone()" in message


def test_a_write_through_a_copied_slice_names_the_view_op():
    """narrow/slice along a sharded dim builds new data: an in-place op on it raises, naming both ops."""
    results = so.run(_run_write, 4, (10, 3), (4,), (S(0),), lambda t: t.narrow(0, 2, 3).add_(1))
    kind, message, _ = results[0]
    assert kind == "raised" and "aten.add_" in message and "aten.slice.Tensor" in message and "S(0)" in message


# x[basic index] = value along sharded dims: each rank writes its part, exactly, no collective
SETITEMS = [
    ("rows", (10, 3), (4,), (S(0),), (slice(2, 5),), 7.0),
    ("stepped rows", (10, 3), (4,), (S(0),), (slice(1, None, 3),), -1.0),
    ("negative int row", (10, 3), (4,), (S(0),), (-2,), 4.0),
    ("int row and column", (10, 3), (4,), (S(0),), (7, 2), 9.0),
    ("ellipsis then column of sharded dim 1", (10, 3), (4,), (S(1),), (Ellipsis, 1), 5.0),
    ("0-d tensor value", (10, 3), (4,), (S(0),), (slice(0, 4),), torch.tensor(2.5)),
    ("row value broadcast (replicated DTensor)", (10, 3), (4,), (S(0),), (slice(2, 9),), "row"),
    ("sharded DTensor value", (10, 3), (4,), (S(0),), (slice(1, 8),), "sharded block"),
    ("2-D: block", (10, 6), (2, 2), (S(0), S(1)), (slice(2, 7), slice(1, 5)), 3.0),
    ("2-D: both mesh dims on rows", (10, 6), (2, 2), (S(0), S(0)), (slice(3, 9, 2),), -4.0),
    ("2-D: int row, stepped columns", (10, 6), (2, 2), (S(1), S(0)), (5, slice(None, None, 2)), 8.0),
]


def _value(value, shape, index, mesh):
    """The test's value on one device (mesh None) or as a DTensor."""
    if value == "row":
        v = torch.tensor([10.0, 20.0, 30.0])
        return v if mesh is None else so.distribute_tensor(v, mesh, [R] * mesh.ndim)
    if value == "sharded block":
        v = -_full(_full(shape)[index].shape) - 1
        return v if mesh is None else so.distribute_tensor(v, mesh, [S(0)] + [R] * (mesh.ndim - 1))
    return value


def _run_setitem(shape, mesh_shape, placements, index, value):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    x = so.distribute_tensor(_full(shape), mesh, list(placements))
    v = _value(value, shape, index, mesh)
    with so.CommDebugMode() as comm:
        x[index] = v
    return x.full_tensor(), comm.get_total_counts()


@pytest.mark.parametrize("name,shape,mesh_shape,placements,index,value", SETITEMS, ids=[c[0] for c in SETITEMS])
def test_setitem_on_sharded_dims_writes_each_rank_its_part(name, shape, mesh_shape, placements, index, value):
    expected = _full(shape)
    expected[index] = _value(value, shape, index, None)
    for base, collectives in so.run(_run_setitem, math.prod(mesh_shape), shape, mesh_shape, placements, index, value):
        torch.testing.assert_close(base, expected, rtol=0, atol=0)
        if not isinstance(value, str) or value == "row":
            assert collectives == 0  # a scalar or replicated value: every rank writes from what it holds


def test_setitem_through_a_copied_slice_still_raises():
    def write(t):
        t[2:5][0:2] = 1.0

    results = so.run(_run_write, 4, (10, 3), (4,), (S(0),), write)
    for kind, message, base in results:
        assert kind == "raised" and "copy, not a view" in message
        torch.testing.assert_close(base, _full((10, 3)), rtol=0, atol=0)


def _clone_then_write(shape, mesh_shape, placements):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    x = so.distribute_tensor(_full(shape), mesh, list(placements))
    c = x[2:5].clone()
    c.add_(1)  # a copy on purpose: the write is the copy's own
    return c.full_tensor(), x.full_tensor()


def test_clone_of_a_copied_view_takes_writes():
    copy, base = so.run(_clone_then_write, 4, (10, 3), (4,), (S(0),))[0]
    torch.testing.assert_close(copy, _full((10, 3))[2:5] + 1, rtol=0, atol=0)
    torch.testing.assert_close(base, _full((10, 3)), rtol=0, atol=0)


# -- views of a pending sum


def _pending(mesh) -> so.DTensor:
    return so.DTensor.from_local(torch.ones(2, 3), mesh, [Partial()] * mesh.ndim)


def _single_device_pending(world: int) -> torch.Tensor:
    return torch.ones(2, 3) * world


PENDING = [
    ("view add_", lambda x, v: v.add_(100), lambda x, v: v.add_(100)),
    ("base add_ while a view lives", lambda x, v: x.add_(100), lambda x, v: x.add_(100)),
    ("view fill_", lambda x, v: v.fill_(1.0), lambda x, v: v.fill_(1.0)),
    ("base zero_ while a view lives", lambda x, v: x.zero_(), lambda x, v: x.zero_()),
]


def _run_pending(mesh_shape, op):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    x = _pending(mesh)
    v = x.view(6)
    try:
        op(x, v)
    except ShardingError as e:
        return "raised", str(e), x.full_tensor(), v.full_tensor()
    return "wrote", None, x.full_tensor(), v.full_tensor()


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("name,op,single", PENDING, ids=[p[0] for p in PENDING])
def test_pending_views_never_give_a_wrong_base(name, op, single, mesh_shape):
    world = math.prod(mesh_shape)
    base = _single_device_pending(world)
    view = base.view(6)
    single(base, view)
    results = so.run(_run_pending, world, mesh_shape, op)
    assert len({r[0] for r in results}) == 1, results
    for kind, message, x_full, v_full in results:
        if kind == "wrote":
            torch.testing.assert_close(x_full, base, rtol=0, atol=0)
            torch.testing.assert_close(v_full, view, rtol=0, atol=0)
        else:
            torch.testing.assert_close(x_full, _single_device_pending(world), rtol=0, atol=0)
            assert "pending sum" in message and "redistribute(placements=[Replicate()]" in message


def _resolve_after_view_dies(mesh_shape):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    x = _pending(mesh)
    v = x.view(6)
    total = v.sum().full_tensor()  # a read through the view, then the view goes
    del v
    x.add_(1)  # no alias left: resolved in place as before
    r = _pending(mesh).redistribute(placements=[R] * mesh.ndim)
    w = r.view(6)
    w.add_(100)  # resolved first, then viewed: the write reaches the base
    return total, x.full_tensor(), r.full_tensor()


def test_pending_resolved_first_takes_writes():
    total, x_full, r_full = so.run(_resolve_after_view_dies, 4, (4,))[0]
    torch.testing.assert_close(total, torch.tensor(24.0), rtol=0, atol=0)
    torch.testing.assert_close(x_full, torch.ones(2, 3) * 4 + 1, rtol=0, atol=0)
    torch.testing.assert_close(r_full, torch.ones(2, 3) * 4 + 100, rtol=0, atol=0)
