"""Ops the design says move nothing, measured: 0 bytes in so.CommDebugMode (strict mode on),
values equal to single-device torch (issue 21, item 5)."""

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from parallel_harness import strict
from shardops import Partial, Replicate, Shard


def zero_bytes_on_every_rank(setup, op, mesh_shape=(4,)):
    """On each rank (strict mode): args = setup(mesh) outside the count, then op(*args) inside
    CommDebugMode, asserted 0 B; returns each rank's full_tensor() of the outputs."""

    def main():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        with strict():
            args = setup(mesh)
            with so.CommDebugMode() as comm:
                out = op(*args)
            assert comm.get_total_bytes() == 0 and comm.get_comm_counts() == {}, comm.get_comm_counts()
            outs = out if isinstance(out, tuple) else (out,)
            return [o.full_tensor() if isinstance(o, so.DTensor) else o for o in outs]

    return so.run(main, int(torch.tensor(mesh_shape).prod()))


# ------------------------------------------------------------------ (a) overwriting a pending self


@pytest.mark.parametrize("p", [0.5, 0.0])
def test_dropout_on_a_partial_tensor_moves_nothing(p):
    """CPU F.dropout = empty_like(x).bernoulli_(): the Partial empty_like is overwritten, never all-reduced."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(41))

    def drop(xp, xr):
        torch.manual_seed(5)
        out = F.dropout(xp, p)
        assert out.placements == (Partial(),)
        torch.manual_seed(5)
        return out, F.dropout(xr, p)  # layout-invariant draws: the same mask as on a Replicate copy

    setup = lambda mesh: (so.distribute_tensor(x, mesh, [Partial()]), so.distribute_tensor(x, mesh, [Replicate()]))  # noqa: E731
    for out, ref in zero_bytes_on_every_rank(setup, drop):
        torch.testing.assert_close(out, ref)
        kept = out != 0
        torch.testing.assert_close(out[kept], x[kept] / (1 - p))  # each element dropped or scaled, as torch
        if p == 0.0:
            torch.testing.assert_close(out, x)


@pytest.mark.parametrize("fill", ["zero_", "fill_", "uniform_", "normal_", "bernoulli_", "random_", "exponential_"])
def test_fills_never_resolve_a_pending_self(fill):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(42))
    ops = {
        "zero_": lambda t: torch.ops.aten.zero_(t),
        "fill_": lambda t: torch.ops.aten.fill_.Scalar(t, 3.0),
        "uniform_": lambda t: torch.ops.aten.uniform_(t),
        "normal_": lambda t: torch.ops.aten.normal_(t),
        "bernoulli_": lambda t: torch.ops.aten.bernoulli_.float(t, 0.3),
        "random_": lambda t: torch.ops.aten.random_.to(t, 7),
        "exponential_": lambda t: torch.ops.aten.exponential_(t),
    }

    def main():
        mesh = so.init_device_mesh("cpu", (4,))
        with strict():
            t = so.distribute_tensor(x, mesh, [Partial()])
            torch.manual_seed(6)
            with so.CommDebugMode() as comm:
                ops[fill](t)
            assert comm.get_total_bytes() == 0, comm.get_comm_counts()
            r = so.distribute_tensor(x, mesh, [Replicate()])
            torch.manual_seed(6)
            ops[fill](r)
            return t.placements, t.full_tensor(), r.full_tensor()

    for placements, got, ref in so.run(main, 4):
        assert placements == (Replicate(),)
        torch.testing.assert_close(got, ref)
    if fill == "fill_":
        torch.testing.assert_close(got, torch.full_like(x, 3.0))
    if fill == "zero_":
        torch.testing.assert_close(got, torch.zeros_like(x))


# ------------------------------------------------------------------ (b) linear on unevenly sharded leading dims

X3, W3, B3 = (
    torch.randn(*s, generator=torch.Generator().manual_seed(43 + i))
    for i, s in enumerate([(3, 10, 66), (20, 66), (20,)])
)

LINEAR_LAYOUTS = {  # mesh shape, input, weight, bias placements
    "batch_over_4_weight_replicated": ((4,), [Shard(0)], [Replicate()], [Replicate()]),
    "batch_over_4_weight_colwise": ((4, 2), [Shard(0), Replicate()], [Replicate(), Shard(0)], [Replicate(), Shard(0)]),
    "sequence_over_4": ((4,), [Shard(1)], [Replicate()], [Replicate()]),
}


@pytest.mark.parametrize("form", ["linear", "matmul"])
@pytest.mark.parametrize("layout", list(LINEAR_LAYOUTS))
def test_linear_on_uneven_leading_dims_moves_nothing(layout, form):
    """[3,10,66] with 3 (or 10) rows over 4 ranks: forward and backward 0 B, output sharded alike, values exact."""
    mesh_shape, xp, wp, bp = LINEAR_LAYOUTS[layout]
    x, w, b = (t.clone().requires_grad_() for t in (X3, W3, B3))
    ref = F.linear(x, w, b) if form == "linear" else x @ w.t()
    ref.square().sum().backward()

    def setup(mesh):
        return tuple(so.distribute_tensor(t, mesh, p).requires_grad_() for t, p in ((X3, xp), (W3, wp), (B3, bp)))

    def step(xd, wd, bd):
        out = F.linear(xd, wd, bd) if form == "linear" else xd @ wd.t()
        assert out.placements[0] == xp[0] and isinstance(out._local_tensor, torch.Tensor)
        out.square().sum().backward()
        return out, xd.grad, wd.grad, (bd.grad if form == "linear" else torch.zeros(()))

    for out, gx, gw, gb in zero_bytes_on_every_rank(setup, step, mesh_shape):
        torch.testing.assert_close(out, ref.detach(), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(gx, x.grad, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(gw, w.grad, atol=1e-3, rtol=1e-5)
        if form == "linear":
            torch.testing.assert_close(gb, b.grad, atol=1e-3, rtol=1e-5)


# ----------------------------------------------------------------- (c) embedding max_norm on a vocabulary-sharded table


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_embedding_max_norm_on_a_vocabulary_sharded_table(norm_type):
    """embedding_renorm_ is row-local: each rank renorms the rows it owns (10 rows over 4 ranks: 3,3,3,1)."""
    g = torch.Generator().manual_seed(44)
    table, ids = torch.randn(10, 4, generator=g) * 2, torch.tensor([[1, 9, 3, 3], [0, 7, 9, 2]])
    ref_table = table.clone().requires_grad_()
    coef = torch.randn(2, 4, 4, generator=g)  # a linear loss: the lookup's P(sum) output stays pending
    ref = F.embedding(ids, ref_table, max_norm=1.0, norm_type=norm_type)
    (ref * coef).sum().backward()

    def setup(mesh):
        table_ = so.distribute_tensor(table, mesh, [Shard(0)]).requires_grad_()
        return table_, so.distribute_tensor(ids, mesh, [Replicate()]), so.distribute_tensor(coef, mesh, [Replicate()])

    def lookup(t, i, c):
        out = F.embedding(i, t, max_norm=1.0, norm_type=norm_type)
        (out * c).sum().backward()
        return out, t.detach(), t.grad

    for out, renormed, grad in zero_bytes_on_every_rank(setup, lookup):
        torch.testing.assert_close(out, ref.detach())
        torch.testing.assert_close(renormed, ref_table.detach())
        torch.testing.assert_close(grad, ref_table.grad)


# ------------------------------------------------------------------ (d) GQA with aligned, non-divisible heads


@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa_with_aligned_uneven_heads_moves_nothing(is_causal):
    """q 6 heads, K/V 3 over 4 ranks: q heads 2,2,2,0 and K/V 1,1,1,0 line up, so each rank attends locally."""
    g = torch.Generator().manual_seed(45)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g).requires_grad_() for h in (6, 3, 3))
    coef = torch.randn(2, 6, 5, 8, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    (ref * coef).sum().backward()

    def setup(mesh):
        return tuple(so.distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in (q, k, v))

    def attend(qd, kd, vd):
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=is_causal, enable_gqa=True)
        assert out.placements == (Shard(1),)
        (out * so.distribute_tensor(coef, out.device_mesh, [Shard(1)], src_data_rank=None)).sum().backward()
        return out, qd.grad, kd.grad, vd.grad

    for out, gq, gk, gv in zero_bytes_on_every_rank(setup, attend):
        torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
        for got, want in ((gq, q.grad), (gk, k.grad), (gv, v.grad)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
