"""Attention (ops/attention.py) against single-device torch: values, gradients, layouts, bytes.

Every case runs in strict mode (no fallback may serve it). The global q, k, v, mask and
output gradient are built once outside `so.run` and distributed; the reference is
torch's own F.scaled_dot_product_attention on the same tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from shardops import Partial, Replicate, Shard

aten = torch.ops.aten
R = Replicate()
PL = {"S0": Shard(0), "S1": Shard(1), "S2": Shard(2), "R": R}


@pytest.fixture(autouse=True)
def _strict_everywhere(strict):
    """Every test here runs strict (the fixture is in conftest.py)."""


def _inputs(q_shape, kv_heads=None, kv_len=None, dtype=torch.float32, mask=None, seed=0):
    """q, k, v, the output gradient and a mask (None, 'additive', 'bool', 'additive4d')."""
    g = torch.Generator().manual_seed(seed)
    b, h, length, d = q_shape
    kv_shape = (b, kv_heads or h, kv_len or length, d)
    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in (q_shape, kv_shape, kv_shape))
    grad = torch.randn(q_shape, generator=g).to(dtype)
    s = kv_shape[2]
    m = None
    if mask == "additive":
        m = torch.randn(length, s, generator=g).to(dtype)
        m[:, 1::3] = -math.inf
    elif mask == "bool":
        m = torch.rand(length, s, generator=g) > 0.4
        m[:, 0] = True  # every row sees a key (torch gives NaN-free 0 rows either way, but keep it ordinary)
        m[2] = False  # one row that sees nothing: torch's kernel gives 0 there
    elif mask == "additive4d":
        m = torch.randn(b, 1, length, s, generator=g).to(dtype)
        m[..., ::4] = -math.inf
    elif mask == "per_head":
        m = torch.randn(b, h, length, s, generator=g).to(dtype)
        m[:, ::2, :, 1::2] = -math.inf
    return q, k, v, grad, m


def _reference(q, k, v, grad, mask, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _sharded(mesh_shape, q_layout, kv_layout, q, k, v, grad, mask, mask_layout=None, **kw):
    """Per rank: (placements of out, dq, dk, dv), full tensors, fwd comm, bwd comm."""

    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        dq = so.distribute_tensor(q, mesh, [PL[p] for p in q_layout]).requires_grad_()
        dk, dv = (so.distribute_tensor(t, mesh, [PL[p] for p in kv_layout]).requires_grad_() for t in (k, v))
        m = mask
        if mask is not None and mask_layout is not None:
            m = so.distribute_tensor(mask, mesh, [PL[p] for p in mask_layout])
        with so.CommDebugMode() as fwd:
            out = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=m, **kw)
        g = so.distribute_tensor(grad, mesh, out.placements)
        with so.CommDebugMode() as bwd:
            out.backward(g)
        placements = tuple(t.placements for t in (out, dq.grad, dk.grad, dv.grad))
        with torch.no_grad():
            full = tuple(t.full_tensor() for t in (out, dq.grad, dk.grad, dv.grad))
        return placements, full, fwd, bwd

    return so.run(body, math.prod(mesh_shape))


def _check(
    mesh_shape,
    q_layout,
    kv_layout,
    q_shape,
    *,
    kv_heads=None,
    kv_len=None,
    dtype=torch.float32,
    mask=None,
    mask_layout=None,
    **kw,
):
    q, k, v, grad, m = _inputs(q_shape, kv_heads, kv_len, dtype, mask)
    ref = _reference(q, k, v, grad, m, **kw)
    results = _sharded(mesh_shape, q_layout, kv_layout, q, k, v, grad, m, mask_layout, **kw)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for placements, full, _, _ in results:
        assert placements[0] == placements[1] == tuple(PL[p] for p in q_layout), "output and dq keep q's layout"
        for name, got, want in zip(("out", "dq", "dk", "dv"), full, ref):
            torch.testing.assert_close(got, want, **tol, msg=lambda s: f"{name}: {s}")  # noqa: B023 - called within this iteration
    return results


# ------------------------------------------------------------------ values and gradients

SHAPE = (2, 8, 32, 16)
UNEVEN = (3, 6, 30, 8)  # on 4 ranks: batch 1,1,1,0 heads 2,2,2,0 seq 8,8,8,6; on 2x2 seq 8,7,8,7


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [SHAPE, UNEVEN], ids=["even", "uneven"])
@pytest.mark.parametrize(
    "mesh_shape,q_layout,kv_layout",
    [
        ((4,), ("S0",), ("S0",)),
        ((4,), ("S1",), ("S1",)),
        ((4,), ("S2",), ("S2",)),
        ((4,), ("S2",), ("R",)),
        ((2, 2), ("S0", "S2"), ("S0", "S2")),
        ((2, 2), ("S1", "S2"), ("S1", "S2")),
        ((2, 2), ("S2", "S2"), ("S2", "S2")),
        ((2, 2), ("S2", "S1"), ("S2", "S1")),
    ],
    ids=lambda x: ".".join(x) if isinstance(x, tuple) and isinstance(x[0], str) else None,
)
def test_matches_torch(mesh_shape, q_layout, kv_layout, shape, causal):
    results = _check(mesh_shape, q_layout, kv_layout, shape, is_causal=causal)
    for placements, _, _, _ in results:
        out_pl, dq_pl, dk_pl, dv_pl = placements
        assert out_pl == dq_pl == tuple(PL[p] for p in q_layout), "output and dq keep q's layout"
        for got, mine in zip(dk_pl, kv_layout):
            assert got == PL[mine] or (mine == "R" and got == Partial("sum")), (
                f"dk/dv come back as k/v are laid out: {dk_pl}"
            )
        assert dk_pl == dv_pl


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask", ["additive", "bool", "additive4d"])
@pytest.mark.parametrize(
    "mesh_shape,layout,mask_layout",
    [
        ((4,), "S2", None),  # a plain mask: taken as Replicate, each rank uses its rows
        ((4,), "S2", "R"),
        ((4,), "S1", "R"),
        ((4,), "S0", "R"),
        ((2, 2), "S0.S2", None),
    ],
)
def test_masks(mesh_shape, layout, mask, mask_layout, causal):
    layout = tuple(layout.split("."))
    if mask_layout is not None and mask == "additive4d":
        mask_layout = ("S0",) if layout == ("S0",) else (mask_layout,)
    _check(mesh_shape, layout, layout, UNEVEN, mask=mask, mask_layout=mask_layout, is_causal=causal)


@pytest.mark.parametrize("layout", ["S0", "S1", "S2"])
def test_per_head_mask_sharded_like_the_scores_moves_nothing_but_kv(layout):
    results = _check((4,), (layout,), (layout,), UNEVEN, mask="per_head", mask_layout=(layout,), is_causal=True)
    for _, _, fwd, _bwd in results:
        expected = {"all_gather": 1} if layout == "S2" else {}
        assert fwd.get_comm_counts() == expected, "the mask, sharded like the scores, stays where it is"


def test_mask_sharded_like_the_scores():
    """A mask sharded on its query rows, as the scores are, moves nothing."""
    results = _check((4,), ("S2",), ("S2",), UNEVEN, mask="additive", mask_layout=("S0",), is_causal=True)
    for _, _, fwd, _ in results:
        assert fwd.get_comm_counts() == {"all_gather": 1}, "only K and V travel"


@pytest.mark.parametrize(
    "mesh_shape,layout,kv_heads",
    [
        ((4,), "S1", 4),  # 8 q heads, 4 K/V heads: split evenly and aligned -> K/V stay sharded
        ((4,), "S1", 2),  # 2 K/V heads on 4 ranks: K/V replicated, each rank picks its group's heads
        ((2, 2), "S1.S2", 2),
        ((4,), "S2", 2),
        ((4,), "S0", 2),
    ],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(mesh_shape, layout, kv_heads, causal):
    layout = tuple(layout.split("."))
    kv_layout = layout
    if kv_heads == 2 and mesh_shape == (4,) and layout == ("S1",):
        kv_layout = ("R",)
    results = _check(mesh_shape, layout, kv_layout, (2, 8, 12, 8), kv_heads=kv_heads, enable_gqa=True, is_causal=causal)
    if kv_layout == ("R",):
        for placements, _, fwd, bwd in results:
            assert fwd.get_total_bytes() == 0 and bwd.get_total_bytes() == 0
            assert placements[2] == (Partial("sum"),), "replicated K/V get a pending gradient"


def test_gqa_aligned_heads_move_nothing():
    results = _check((4,), ("S1",), ("S1",), (2, 8, 12, 8), kv_heads=4, enable_gqa=True, is_causal=True)
    for placements, _, fwd, bwd in results:
        assert fwd.get_total_bytes() == bwd.get_total_bytes() == 0
        assert placements == ((Shard(1),),) * 4


@pytest.mark.parametrize("layout", ["S1", "S2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bfloat16(layout, causal):
    _check((4,), (layout,), (layout,), UNEVEN, dtype=torch.bfloat16, is_causal=causal)


def test_scale_and_cross_attention_lengths():
    """Queries and keys of different lengths (causal is top-left aligned in torch), a custom scale."""
    _check((4,), ("S2",), ("S2",), (2, 4, 10, 8), kv_len=14, is_causal=True, scale=0.3)
    _check((4,), ("S2",), ("S2",), (2, 4, 14, 8), kv_len=10, is_causal=True, scale=0.3)


def test_no_grad_forward():
    q, k, v, _, _ = _inputs(UNEVEN)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        dq, dk, dv = (so.distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v))
        with torch.no_grad():
            return F.scaled_dot_product_attention(dq, dk, dv, is_causal=True).full_tensor()

    for got in so.run(body, 4):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ bytes (mesh (4,), q/k/v f32[2, 8, 32, 16])


@pytest.mark.parametrize("layout", ["S0", "S1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batch_or_heads_move_nothing(layout, causal):
    results = _check((4,), (layout,), (layout,), SHAPE, is_causal=causal)
    for placements, _, fwd, bwd in results:
        assert fwd.get_total_counts() == bwd.get_total_counts() == 0
        assert fwd.get_total_bytes() == bwd.get_total_bytes() == 0
        assert placements == ((PL[layout],),) * 4, "output and gradients sharded like the inputs"


def test_context_parallel_bytes():
    """q, k, v Shard(2), causal: forward one all_gather of K and V (each rank's own shards:
    2 tensors x 2*8*8*16*4 B), backward one reduce_scatter of dK and dV (its whole input: this
    rank's contributions to every key, 2 x 2*8*32*16*4 B); no gather of Q or the output."""
    results = _check((4,), ("S2",), ("S2",), SHAPE, is_causal=True)
    own_kv = 2 * (2 * 8 * 8 * 16 * 4)
    for placements, _, fwd, bwd in results:
        assert fwd.get_comm_counts() == {"all_gather": 1} and fwd.get_total_bytes() == own_kv == 16384
        assert fwd.get_rounds() == 1
        assert bwd.get_comm_counts() == {"reduce_scatter": 1} and bwd.get_total_bytes() == 4 * own_kv
        assert bwd.get_rounds() == 1
        assert placements == ((Shard(2),),) * 4, "output and all three gradients stay Shard(2)"


def test_queries_along_sequence_with_replicated_keys_move_nothing_forward():
    results = _check((4,), ("S2",), ("R",), SHAPE, is_causal=True)
    for placements, _, fwd, bwd in results:
        assert fwd.get_total_bytes() == 0 and bwd.get_total_bytes() == 0
        assert placements[1] == (Shard(2),) and placements[2] == placements[3] == (Partial("sum"),)


# ------------------------------------------------------------------ the aten ops themselves


@pytest.mark.parametrize("layout", ["S0", "S1", "S2"])
def test_aten_flash_ops_direct(layout):
    """The forward and backward aten ops called directly (as a decomposition or a verify run would)."""
    q, k, v, grad, _ = _inputs(UNEVEN)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    want = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        d = lambda t: so.distribute_tensor(t, mesh, [PL[layout]])  # noqa: E731
        o, o_lse = aten._scaled_dot_product_flash_attention_for_cpu(d(q), d(k), d(v), 0.0, True)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d(grad), d(q), d(k), d(v), o, o_lse, 0.0, True
        )
        return (
            o.placements,
            o.full_tensor(),
            o_lse.full_tensor(),
            [t.full_tensor() for t in grads],
            [t.placements for t in grads],
        )

    for o_pl, o, got_lse, grads, pls in so.run(body, 4):
        assert o_pl == (PL[layout],) and pls == [(PL[layout],)] * 3
        torch.testing.assert_close(o, out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_lse, lse, rtol=1e-5, atol=1e-5)
        for got, w in zip(grads, want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)


def test_bad_input_raises_sharding_error():
    q, k, v, _, _ = _inputs((2, 8, 12, 8), kv_heads=3)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        dq, dk, dv = (so.distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v))
        F.scaled_dot_product_attention(dq, dk, dv, enable_gqa=True)  # 8 heads over 3 K/V heads

    with pytest.raises(so.ShardingError, match="scaled_dot_product_attention"):
        so.run(body, 4)


# ------------------------------------------------------------------ explicit attention (matrix rows)


def test_explicit_attention_heads_sharded_moves_nothing():
    q, k, v, grad, m = _inputs((2, 8, 12, 8), mask="additive")
    torch_mask = m

    def explicit(q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask
        return torch.softmax(scores, -1) @ v

    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    want = explicit(ref_q, ref_k, ref_v, torch_mask)
    want.backward(grad)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        dq, dk, dv = (so.distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (q, k, v))
        mask = so.from_local(torch_mask, mesh, [R])  # the same on every rank, said so (torch's rule for mixing)
        with so.CommDebugMode() as fwd:
            out = explicit(dq, dk, dv, mask)
        g = so.distribute_tensor(grad, mesh, out.placements)
        with so.CommDebugMode() as bwd:
            out.backward(g)
        return (
            fwd.get_total_bytes() + bwd.get_total_bytes(),
            out.placements,
            out.full_tensor(),
            [t.grad.full_tensor() for t in (dq, dk, dv)],
        )

    for nbytes, placements, out, grads in so.run(body, 4):
        assert nbytes == 0 and placements == (Shard(1),)
        torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
        for got, w in zip(grads, (ref_q.grad, ref_k.grad, ref_v.grad)):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)


def test_long_sequence_stays_context_parallel():
    """The query's layout is the caller's parallelism: at this size the cost model alone would
    all_to_all q, k and v onto the batch of 1 (3 idle ranks); attention keeps q and the output
    on the sequence and moves only K and V."""
    q, k, v, _, _ = _inputs((1, 4, 1024, 64))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        dq, dk, dv = (so.distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v))
        with so.CommDebugMode() as comm:
            out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        return comm.get_comm_counts(), comm.get_total_bytes(), out.placements, out.full_tensor()

    for counts, nbytes, placements, got in so.run(body, 4):
        assert counts == {"all_gather": 1} and nbytes == 2 * 4 * 256 * 64 * 4
        assert placements == (Shard(2),)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_frozen_keys_and_values_send_no_gradient():
    """Only q needs a gradient: the backward issues no reduce_scatter."""
    q, k, v, grad, _ = _inputs(SHAPE)
    ref_q = q.clone().requires_grad_()
    F.scaled_dot_product_attention(ref_q, k, v, is_causal=True).backward(grad)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        dq = so.distribute_tensor(q, mesh, [Shard(2)]).requires_grad_()
        dk, dv = (so.distribute_tensor(t, mesh, [Shard(2)]) for t in (k, v))
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        g = so.distribute_tensor(grad, mesh, out.placements)
        with so.CommDebugMode() as bwd:
            out.backward(g)
        return bwd.get_total_counts(), dq.grad.placements, dq.grad.full_tensor()

    for counts, placements, got in so.run(body, 4):
        assert counts == 0 and placements == (Shard(2),)
        torch.testing.assert_close(got, ref_q.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_layout", ["S2", "R"])
def test_empty_sequence_shards(kv_layout, causal):
    """3 positions on 4 ranks: the last rank holds no query and no key (the CPU kernel must never see it)."""
    _check((4,), ("S2",), (kv_layout,), (2, 2, 3, 4), is_causal=causal)
    _check((2, 2), ("S2", "S2"), (kv_layout, kv_layout), (1, 3, 3, 4), is_causal=causal)


def test_queries_keep_their_shards_on_a_large_planning_space():
    """On a 4-dim mesh the planner prunes its search (its cheapest here moves q onto the batch
    of 1); the q-keeping candidate is searched for itself."""
    from shardops.dispatch import core
    from shardops.ops.attention import FLASH, _keeping_queries
    from shardops.spec import TensorMeta, TensorSpec, contiguous_stride

    shape = (1, 8, 65536, 128)

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2, 2, 2))
        layout = (Shard(2), Shard(2), R, Shard(1))
        spec = TensorSpec(mesh, layout, TensorMeta(shape, contiguous_stride(shape), torch.float32))
        decision = core.plan_op(FLASH, (spec, spec, spec, 0.0, True))
        return decision.candidate.inputs[0], _keeping_queries(decision).inputs

    for _, (q_layout, k_layout, v_layout) in so.run(body, 16)[:1]:
        assert (q_layout[0], q_layout[1], q_layout[3]) == (Shard(2), Shard(2), Shard(1)), q_layout
        assert k_layout == v_layout


@pytest.mark.parametrize("layout", ["S0", "S1"])
def test_dropout_heads_or_batch_sharded_draws_what_replicated_draws(layout):
    """dropout_p > 0 decomposes (bmm, _safe_softmax, bernoulli_, ...): layout-invariant draws make
    the sharded result and gradients equal the replicated ones after the same seed, with no bytes.
    Even batch and heads: the decomposition merges them into bmm's batch dim ([B, H] -> [B*H]),
    which an uneven batch shard does not survive without moving data (views' business)."""
    q, k, v, grad, _ = _inputs((4, 4, 6, 8))

    def body(placement):
        mesh = so.init_device_mesh("cpu", (4,))
        dq, dk, dv = (so.distribute_tensor(t, mesh, [placement]).requires_grad_() for t in (q, k, v))
        g = so.distribute_tensor(grad, mesh, [placement])
        torch.manual_seed(7)
        with so.CommDebugMode() as comm:
            out = F.scaled_dot_product_attention(dq, dk, dv, dropout_p=0.3, is_causal=True)
            out.backward(g.redistribute(placements=out.placements) if out.placements != g.placements else g)
        return comm.get_total_bytes(), out.placements, [t.full_tensor() for t in (out, dq.grad, dk.grad, dv.grad)]

    (_, _, want), *_ = so.run(body, 4, R)
    for nbytes, placements, got in so.run(body, 4, PL[layout]):
        assert nbytes == 0 and placements == (PL[layout],)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want[0], F.scaled_dot_product_attention(q, k, v, is_causal=True)), "dropout did something"


@pytest.mark.parametrize("layout", ["S1", "S2"])
def test_transposed_inputs_as_models_build_them(layout):
    """q, k, v as a model makes them: [B, L, H, D] activations transposed to [B, H, L, D] views."""
    q, k, v, grad, _ = _inputs(UNEVEN)
    ref = _reference(q, k, v, grad, None, is_causal=True)
    blhd = {"S1": Shard(2), "S2": Shard(1)}[layout]  # the same tensor dim before the transpose

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        leaves = [
            so.distribute_tensor(t.transpose(1, 2).contiguous(), mesh, [blhd]).requires_grad_() for t in (q, k, v)
        ]
        dq, dk, dv = (t.transpose(1, 2) for t in leaves)
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        out.backward(so.distribute_tensor(grad, mesh, out.placements))
        return out.placements, [t.full_tensor() for t in [out] + [x.grad.transpose(1, 2) for x in leaves]]

    for placements, got in so.run(body, 4):
        assert placements == (PL[layout],)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _context_parallel_program():
    """One rank of a gloo world: context-parallel causal attention on an uneven sequence."""
    q, k, v, grad, _ = _inputs(UNEVEN)
    ref = _reference(q, k, v, grad, None, is_causal=True)
    mesh = so.init_device_mesh("cpu", (4,))
    dq, dk, dv = (so.distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v))
    g = so.distribute_tensor(grad, mesh, [Shard(2)])
    with so.CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        out.backward(g)
    got = [t.full_tensor() for t in (out, dq.grad, dk.grad, dv.grad)]
    return (
        comm.get_comm_counts(),
        comm.get_total_bytes(),
        [torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, ref)],
    )


@pytest.mark.slow
def test_context_parallel_under_gloo():
    """The same algorithm over torch.distributed (4 gloo processes): uneven all_gather and reduce_scatter."""
    from mp import run_gloo

    threads = so.run(_context_parallel_program, 4)
    for (counts, nbytes, ok), (t_counts, t_bytes, _) in zip(
        run_gloo(_context_parallel_program, 4, timeout=240), threads
    ):
        assert all(ok) and counts == t_counts == {"all_gather": 1, "reduce_scatter": 1} and nbytes == t_bytes


def test_operands_on_different_meshes_raise():
    q, k, v, _, _ = _inputs((2, 4, 8, 4))

    def body():
        mesh_a = so.init_device_mesh("cpu", (4,))
        mesh_b = so.init_device_mesh("cpu", (2, 2))
        dq = so.distribute_tensor(q, mesh_a, [Shard(1)])
        dk, dv = (so.distribute_tensor(t, mesh_b, [Shard(1), R]) for t in (k, v))
        F.scaled_dot_product_attention(dq, dk, dv)

    with pytest.raises(so.ShardingError, match="different meshes"):
        so.run(body, 4)


def test_gqa_heads_sharded_on_one_mesh_dim_move_nothing():
    """dp x tp with 2 K/V heads on tp=2: the groups stay aligned on tp (not on the whole mesh of 4)."""
    results = _check((2, 2), ("S0", "S1"), ("S0", "S1"), (2, 8, 12, 8), kv_heads=2, enable_gqa=True, is_causal=True)
    for placements, _, fwd, bwd in results:
        assert fwd.get_total_bytes() == bwd.get_total_bytes() == 0
        assert placements == ((Shard(0), Shard(1)),) * 4
