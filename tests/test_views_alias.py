"""A view aliases its input, or raises (issue 42, item 4).

Each case runs a view on a DTensor (uneven shards, 1-D and 2-D meshes) and on one
device. Where the input's shards are whole shards of the output, the view moves
nothing, shares the input's storage on every rank, and in-place ops through it
(`add_`, `v[...] =`, `copy_`) change the input exactly as on one device. Where they
are not, the view raises a ShardingError before any collective (torch's DTensor raises
for the same views: `test_dtensor_view_op_uneven` asserts 0 collectives for its case,
and its strict view rule refuses uneven flattens and unflattens), and `reshape`, which
may copy, still gives torch's values. Gradients flow through views, also when a
gradient reaches a view's backward in a layout it cannot alias (autograd's reshape of a
fresh gradient may copy). The same cases run beside torch's DTensor under gloo.
"""

from __future__ import annotations

import math

import pytest
import torch

import shardops as so
from mp import run_gloo
from shardops import Partial, Replicate, Shard, ShardingError, StridedShard
from shardops.ops._view_layout import view_layout

R = Replicate()
S = Shard

# (name, global shape, mesh shape, placements, view, torch's DTensor aliases it)
CASES = [
    ("issue: split uneven rows", (10, 3), (4,), (S(0),), lambda x: x.view(5, 2, 3), False),
    ("issue: flatten uneven rows", (10, 3), (4,), (S(0),), lambda x: x.view(30), False),
    ("flatten() uneven", (10, 3), (4,), (S(0),), lambda x: x.flatten(), False),
    ("ravel uneven", (10, 3), (4,), (S(0),), torch.ravel, False),
    ("split rows 10 -> 2x5", (10, 3), (4,), (S(0),), lambda x: x.view(2, 5, 3), False),
    ("trailing size-1 dim", (10, 3), (4,), (S(0),), lambda x: x.view(10, 3, 1), True),
    ("unflatten unsharded dim", (10, 6), (4,), (S(0),), lambda x: x.unflatten(1, (3, 2)), True),
    ("torch: dim0 = world + 1", (5, 2, 2, 2), (4,), (S(0),), lambda x: x.view(5, 2, 4), True),
    ("torch: dim0 = 1", (1, 2, 2, 2), (4,), (S(0),), lambda x: x.view(1, 2, 4), True),
    ("flatten(0, 1), sequence sharded", (3, 10, 8), (4,), (S(1),), lambda x: x.flatten(0, 1), True),
    ("merge a sharded uneven dim first", (4, 10, 8), (4,), (S(1),), lambda x: x.view(4, 80), False),
    ("heads out of hidden", (2, 5, 16), (4,), (S(2),), lambda x: x.view(2, 5, -1, 4), True),
    ("3 heads on 4 ranks", (2, 5, 12), (4,), (S(2),), lambda x: x.view(2, 5, 3, 4), False),
    ("view_as", (10, 3), (4,), (S(0),), lambda x: x.view_as(torch.empty(10, 3, 1)), True),
    ("squeeze an unsharded dim", (6, 1, 4), (4,), (S(0),), lambda x: x.squeeze(1), True),
    ("squeeze the sharded dim", (1, 6), (4,), (S(0),), lambda x: x.squeeze(0), False),
    ("squeeze() all", (1, 6), (4,), (S(1),), torch.squeeze, True),
    ("unsqueeze", (10, 3), (4,), (S(0),), lambda x: x.unsqueeze(0), True),
    ("transpose .T", (10, 3), (4,), (S(0),), lambda x: x.T, True),
    ("pending sum passes", (10, 3), (4,), (Partial("sum"),), lambda x: x.view(30), True),
    ("2-D: batch and sequence", (4, 10, 8), (2, 2), (S(0), S(1)), lambda x: x.flatten(0, 1), True),
    ("2-D: uneven first dim", (5, 4), (2, 2), (S(0), S(1)), lambda x: x.view(20), False),
    ("2-D: nested shards", (6, 4, 2), (2, 2), (S(0), S(0)), lambda x: x.view(6, 8), True),
    ("2-D: matmul-style fold", (3, 2, 5, 6), (2, 2), (S(0), S(2)), lambda x: x.view(6, 5, 6), False),
    ("2-D: back from strided", (40, 8), (2, 2), (S(0), StridedShard(0, 2)), lambda x: x.view(4, 10, 8), True),
    ("2-D: replicate and uneven", (7, 3), (2, 2), (R, S(0)), lambda x: x.view(21), False),
]
IDS = [c[0] for c in CASES]


# in-place ops through the view: each must change the input as on one device
MUTATIONS = (lambda t: t.add_(100), lambda t: t.__setitem__(..., -1.5), lambda t: t.copy_(t * 2 + 1))


def _full(shape) -> torch.Tensor:
    return torch.arange(float(math.prod(shape))).reshape(shape) / 7


def _distribute(full, mesh, placements):
    if any(p.is_partial() for p in placements):  # rank r holds (r + 1) / sum * full: sums to full
        n = mesh.size()
        local = full * (mesh.get_rank() + 1) / (n * (n + 1) / 2)
        return so.DTensor.from_local(local, mesh, list(placements))
    return so.distribute_tensor(full, mesh, list(placements))


def _local_storage(t) -> int:
    return t.to_local().untyped_storage().data_ptr()


def _run_case(shape, mesh_shape, placements, view):
    """On every rank: ('raised', message, collectives, input unchanged) or ('alias', ...)."""
    mesh = so.init_device_mesh("cpu", mesh_shape)
    full = _full(shape)
    x = _distribute(full, mesh, placements)
    with so.CommDebugMode() as comm:
        try:
            v = view(x)
        except ShardingError as e:
            return "raised", str(e), comm.get_total_counts(), torch.equal(x.full_tensor(), full)
    shares = v.to_local().numel() == 0 or _local_storage(v) == _local_storage(x)
    viewed = v.full_tensor()
    mutated = []
    for mutate in MUTATIONS if not any(p.is_partial() for p in placements) else ():
        mutate(v)
        mutated.append(x.full_tensor())
    return "alias", comm.get_total_counts(), shares, viewed, mutated


def _single_device(shape, view):
    x = _full(shape)
    v = view(x)
    mutated = []
    for mutate in MUTATIONS:
        mutate(v)
        mutated.append(x.clone())
    return view(_full(shape)), mutated


@pytest.mark.parametrize("name,shape,mesh_shape,placements,view,torch_aliases", CASES, ids=IDS)
def test_view_aliases_or_raises(name, shape, mesh_shape, placements, view, torch_aliases):
    results = so.run(_run_case, math.prod(mesh_shape), shape, mesh_shape, placements, view)
    kinds = {r[0] for r in results}
    assert len(kinds) == 1, results  # every rank takes the same way
    if torch_aliases:  # where torch's DTensor aliases, shardops does too
        assert kinds == {"alias"}, results[0]
    if kinds == {"raised"}:
        for _, message, collectives, unchanged in results:
            assert collectives == 0 and unchanged
            assert "view must alias its input" in message and "redistribute" in message.lower()
        return
    want_view, want_mutated = _single_device(shape, view)
    for _, collectives, shares, viewed, mutated in results:
        assert collectives == 0
        assert shares  # the rank's shard of the view is its shard of the input
        torch.testing.assert_close(viewed, want_view)
        for got, want in zip(mutated, want_mutated):  # each in-place op through the view reached the input
            torch.testing.assert_close(got, want)


def test_issue_example_add_through_view_reaches_the_input():
    """The report's case: x.view(5, 2, 3) all-to-alled into a copy and v.add_(100) left x[0, 0] at 0.0."""

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(torch.arange(30.0).reshape(10, 3), mesh, [Shard(0)])
        with (
            so.CommDebugMode() as comm,
            pytest.raises(ShardingError, match=r"torch.Tensor.view: .*S\(0\).*\[5, 2, 3\]"),
        ):
            x.view(5, 2, 3)
        raised_collectives = comm.get_total_counts()
        v = x.view(10, 3, 1)
        v.add_(100)
        return raised_collectives, x.full_tensor()

    want = torch.arange(30.0).reshape(10, 3)
    want.view(10, 3, 1).add_(100)
    for collectives, got in so.run(body, 4):
        assert collectives == 0
        assert got[0, 0].item() == 100.0
        torch.testing.assert_close(got, want)


def test_a_strided_local_shard_no_view_reaches_raises_and_reshape_copies():
    """The layout aliases, but this rank's local tensor (a transposed block) has strides no view reaches."""

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        local = (torch.arange(12.0).reshape(3, 4) + 12 * mesh.get_rank()).t()  # [4, 3], strides (1, 4)
        x = so.DTensor.from_local(local, mesh, [Shard(0)])
        with pytest.raises(ShardingError, match=r"strides \[1, 4\].*reshape"):
            x.view(48)
        return x.reshape(48).full_tensor(), x.full_tensor()

    for flat, full in so.run(body, 4):
        torch.testing.assert_close(flat, full.reshape(48))


# ------------------------------------------------------------------ reshape may copy


@pytest.mark.parametrize(
    "shape,mesh_shape,placements,size",
    [
        ((10, 3), (4,), (S(0),), (5, 2, 3)),
        ((10, 3), (4,), (S(0),), (30,)),
        ((3, 2, 5, 6), (2, 2), (S(0), S(2)), (6, 5, 6)),
        ((2, 5, 12), (4,), (S(2),), (2, 5, 3, 4)),
        ((4, 10, 8), (2, 2), (S(0), S(1)), (40, 8)),
    ],
)
def test_reshape_copies_where_a_view_cannot_alias(shape, mesh_shape, placements, size):
    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(_full(shape), mesh, list(placements)).requires_grad_()
        y = x.reshape(size)
        w = _full(size) + 1
        (y * so.distribute_tensor(w, mesh, [R] * len(mesh_shape))).sum().backward()
        aliases = y.to_local().untyped_storage().data_ptr() == x.to_local().untyped_storage().data_ptr()
        return y.full_tensor(), x.grad.full_tensor(), aliases

    want = _full(shape).reshape(size)
    want_grad = (_full(size) + 1).reshape(shape)
    for got, grad, _ in so.run(body, math.prod(mesh_shape)):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(grad, want_grad)


def test_reshape_that_can_alias_is_a_view_as_on_one_device():
    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        x = so.distribute_tensor(_full((4, 10, 8)), mesh, [S(0), S(1)])
        with so.CommDebugMode() as comm:
            y = x.reshape(40, 8)
        y.mul_(-1)
        return comm.get_total_counts(), y.placements, x.full_tensor()

    for collectives, placements, got in so.run(body, 4):
        assert collectives == 0 and placements == (S(0), StridedShard(0, 2))
        torch.testing.assert_close(got, -_full((4, 10, 8)))


# ------------------------------------------------------------------ gradients through views


def test_gradients_flow_through_aliasing_views_and_in_place_ops_on_them():
    """view/flatten/unflatten/squeeze/transpose, an in-place op through a view of a non-leaf, then backward."""
    w = torch.randn(8, generator=torch.Generator().manual_seed(3))

    def fn(x, wt):
        y = x * 2  # a non-leaf base: in-place ops through its views rebase autograd's graph
        v = y.flatten(0, 1)
        v.mul_(3)
        z = (v * wt).unflatten(0, (4, 10)).unsqueeze(1).squeeze(1).transpose(1, 2)
        return (z * z).sum() + y.sum()

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        x = so.distribute_tensor(_full((4, 10, 8)), mesh, [S(0), S(1)]).requires_grad_()
        loss = fn(x, so.distribute_tensor(w, mesh, [R, R]))
        loss.backward()
        return loss.full_tensor(), x.grad.full_tensor(), x.grad.placements

    xs = _full((4, 10, 8)).requires_grad_()
    want = fn(xs, w)
    want.backward()
    for loss, grad, placements in so.run(body, 4):
        torch.testing.assert_close(loss, want.detach())
        torch.testing.assert_close(grad, xs.grad)
        assert placements == (S(0), S(1))


class _GradientIn(torch.autograd.Function):
    """Identity whose backward hands on the gradient in another layout (as another op's backward may)."""

    @staticmethod
    def forward(ctx, t, placements):
        ctx.placements = placements
        return t * 1

    @staticmethod
    def backward(ctx, g):
        return g.redistribute(placements=ctx.placements), None


@pytest.mark.parametrize(
    "shape,mesh_shape,placements,size,grad_placements",
    [
        ((2, 6), (4,), (S(1),), (12,), (S(0),)),  # the view is _S(0,2); a gradient in S(0) aliases no layout of [2, 6]
        ((3, 10, 8), (2, 2), (S(1), S(1)), (30, 8), (S(0), S(0))),  # _S(0,3) twice; the gradient comes cut evenly
    ],
)
def test_gradient_in_a_layout_the_view_cannot_alias_still_flows(shape, mesh_shape, placements, size, grad_placements):
    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(_full(shape), mesh, list(placements)).requires_grad_()
        v = x.view(size)
        moved = _GradientIn.apply(v, list(grad_placements))
        (moved * moved).sum().backward()
        return x.grad.full_tensor(), x.grad.placements

    assert view_layout(size, shape, mesh_shape, grad_placements) is None  # the backward's reshape must copy
    for grad, _ in so.run(body, math.prod(mesh_shape)):
        torch.testing.assert_close(grad, 2 * _full(shape))


# ------------------------------------------------------------------ beside torch's DTensor, under gloo

GLOO_CASES = [
    i
    for i, c in enumerate(CASES)
    if c[2] in ((4,), (2, 2)) and c[3][0] != Partial("sum") and not any(isinstance(p, StridedShard) for p in c[3])
]


def _gloo_program():
    """Each case on shardops and on torch's DTensor, in 4 processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    out = []
    for i in GLOO_CASES:
        _, shape, mesh_shape, placements, view, _ = CASES[i]
        ours = _run_case(shape, mesh_shape, placements, view)
        tmesh = init_device_mesh("cpu", mesh_shape)
        tx = distribute_tensor(_full(shape), tmesh, [TS(p.dim) if p.is_shard() else TR() for p in placements])
        with CommDebugMode() as comm:
            try:
                tv = view(tx)
                theirs = ("alias", comm.get_total_counts(), tv.full_tensor())
            except Exception as e:  # noqa: BLE001 - torch's strict view refusal (RuntimeError)
                theirs = ("raised", type(e).__name__)
        out.append((i, ours, theirs))
    return out


def test_views_under_gloo_beside_torch_dtensor():
    per_rank = run_gloo(_gloo_program, 4, timeout=240)
    for results in per_rank:
        for i, ours, theirs in results:
            name, shape, _, _, view, torch_aliases = CASES[i]
            assert (theirs[0] == "alias") == torch_aliases, (name, theirs)  # the table says what torch does
            if theirs[0] == "alias":
                assert ours[0] == "alias" and ours[1] == 0 and theirs[1] == 0, (name, ours[:2])
                torch.testing.assert_close(ours[3], theirs[2])
            if ours[0] == "raised":
                assert ours[2] == 0 and ours[3], name
            else:
                assert ours[2], name  # shares storage in a process too
                for got, want in zip(ours[4], _single_device(shape, view)[1]):
                    torch.testing.assert_close(got, want)
