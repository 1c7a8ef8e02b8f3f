"""Vector norms (linalg_vector_norm, norm, dist, _foreach_norm) on every layout against single-device
torch, pending NormPartial outputs, the sharded backward, stack/cat of pending norms, and
clip_grad_norm_ over many sharded parameters with one collective per reducing mesh dim."""

from __future__ import annotations

import math

import pytest
import torch

import shardops as so
from algo_harness import bandwidth_only_links, run_case  # noqa: F401  (fixture)
from reduction_harness import Grid, Op, check_bad_dim_refused
from shardops import NormPartial, Partial, Replicate, Shard

f64, f32 = torch.float64, torch.float32
INF = math.inf
vector_norm = torch.linalg.vector_norm


def _const_like(x):
    """A constant operand like x: beside a DTensor a Replicate DTensor (a plain one would raise, as in torch)."""
    c = torch.full(tuple(x.shape), 0.25, dtype=x.dtype)
    return so.from_local(c, x.device_mesh, [so.Replicate()] * x.device_mesh.ndim) if isinstance(x, so.DTensor) else c


OPS = [
    Op("vnorm", lambda x: vector_norm(x), grad=True),
    Op("vnorm2_dim1", lambda x: vector_norm(x, 2, 1), grad=True),
    Op("vnorm1_dim0_keepdim", lambda x: vector_norm(x, 1, 0, keepdim=True), grad=True),
    Op("vnorm0_dim1", lambda x: vector_norm(x, 0, dim=1), data="ties"),  # torch gives no gradient
    Op("vnorm3_dims01", lambda x: vector_norm(x, 3, (0, 1)), grad=True),
    Op("vnorm0.5_zeros", lambda x: vector_norm(x, 0.5, -1), data="ties", grad=True),
    Op("vnorm1.5_dim0", lambda x: vector_norm(x, 1.5, 0), grad=True),
    Op("vnorm-1_dim1", lambda x: vector_norm(x, -1, 1), grad=True),
    Op("vnorm-2_zeros", lambda x: vector_norm(x, -2, 0), data="ties", grad=True),
    Op("vnorm_inf_dim1_ties", lambda x: vector_norm(x, INF, 1), data="ties", grad=True),
    Op("vnorm_inf_all_ties", lambda x: vector_norm(x, INF), data="ties", grad=True),
    Op("vnorm_-inf_dim0_keepdim", lambda x: vector_norm(x, -INF, 0, True), data="ties", grad=True),
    Op("vnorm_inf_nan", lambda x: vector_norm(x, INF, 0), data="nan", grad=True),
    Op("vnorm2_f32_dtype_f64", lambda x: vector_norm(x, 2, 1, dtype=torch.float64), dtype=f32, grad=True),
    Op("vnorm_f32", lambda x: vector_norm(x, 2, 0), dtype=f32, grad=True),
    Op("tensor_norm", lambda x: x.norm(), grad=True),
    Op("torch_norm_p3_dim1_keepdim", lambda x: torch.norm(x, p=3, dim=1, keepdim=True), grad=True),
    Op("tensor_norm_inf_dim0", lambda x: x.norm(p=INF, dim=0), data="ties", grad=True),
    Op("torch_norm_fro_dims", lambda x: torch.norm(x, "fro", dim=(0, 1)), grad=True),
    Op("aten_norm_ScalarOpt_dim", lambda x: torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1]), grad=True),
    Op("aten_norm_Scalar", lambda x: torch.ops.aten.norm.Scalar(x, 1), grad=True),
    Op("aten_norm_dim_dtype", lambda x: torch.ops.aten.norm.ScalarOpt_dim_dtype(x, 3, [0], True, dtype=f64), dtype=f32),
    Op("dist", lambda x: torch.dist(x, _const_like(x)), grad=True),
    Op("dist_p1", lambda x: x.dist(_const_like(x), 1), grad=True),
    Op("dist_inf", lambda x: torch.dist(x, _const_like(x), INF), data="ties", grad=True),
    Op("foreach_norm", lambda x: tuple(torch._foreach_norm([x, x * 2], 3))),
]
GRID = Grid(OPS)


test_norm_sample, test_norm_grid = GRID.tests("test_norm", per_op=2, seed=7)


# ------------------------------------------------------------------ pending outputs, empty shards, nested meshes

ALGO_CASES = [
    # (id, mesh, layout, shape, ord, dims): 9 = 3+3+3+0, 3 = (1+1)+(1+0)
    ("mesh4-empty-2", (4,), [Shard(1)], (3, 9), 2.0, (1,)),
    ("mesh4-empty-inf", (4,), [Shard(1)], (3, 9), INF, (1,)),
    ("mesh4-empty--inf", (4,), [Shard(1)], (3, 9), -INF, (1,)),
    ("mesh4-empty--1", (4,), [Shard(0)], (9, 2), -1.0, (0,)),
    ("nested-empty-inf", (2, 2), [Shard(0), Shard(0)], (3, 4), INF, None),
    ("nested-empty-3", (2, 2), [Shard(0), Shard(0)], (3, 4), 3.0, None),
    ("both-dims-1.5", (2, 2), [Shard(0), Shard(1)], (5, 7), 1.5, None),
]


@pytest.mark.parametrize("case,mesh_shape,placements,shape,p,dims", ALGO_CASES, ids=[c[0] for c in ALGO_CASES])
@pytest.mark.usefixtures("bandwidth_only_links")
def test_norm_over_sharded_dims_is_pending(case, mesh_shape, placements, shape, p, dims):
    full = torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(2)).to(f64)
    got = run_case(lambda x: vector_norm(x, p, dims), full, mesh_shape, placements)
    reducing = [i for i, q in enumerate(placements) if q.is_shard() and (dims is None or q.dim in dims)]
    assert got.layouts == [tuple(NormPartial(p) if i in reducing else q for i, q in enumerate(placements))]
    assert got.counts == {}  # nothing moves until someone needs the value
    assert got.grad_layout == tuple(placements)


def _pending(fn, full, placements, mesh_shape=(4,)):
    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(full, mesh, placements)
        with so.CommDebugMode() as comm:
            y = fn(x)
        ys = y if isinstance(y, (list, tuple)) else [y]
        return [tuple(t.placements) for t in ys], comm.get_total_counts(), [t.full_tensor() for t in ys]

    return so.run(body, math.prod(mesh_shape))[0]


def test_norm_of_pending_norms_stays_pending():
    full = torch.randn(6, 40, generator=torch.Generator().manual_seed(4), dtype=f64)
    layouts, counts, got = _pending(lambda x: vector_norm(vector_norm(x, 3, 1), 3), full, [Shard(1)])
    assert (layouts, counts) == ([(NormPartial(3),)], 0)
    torch.testing.assert_close(got[0], vector_norm(vector_norm(full, 3, 1), 3))


def test_zero_norm_of_pending_counts_is_resolved_first():
    # NormP(0) holds counts: their 0-"norm" would count ranks, not elements, so the counts are
    # resolved (all-reduced or reduce-scattered) before the outer norm
    full = torch.randint(-1, 2, (6, 40), generator=torch.Generator().manual_seed(4)).to(f64)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        inner = vector_norm(so.distribute_tensor(full, mesh, [Shard(1)]), 0, 1)
        with so.CommDebugMode() as comm:
            outer = vector_norm(inner, 0)
        return tuple(inner.placements), comm.get_total_counts(), outer.full_tensor()

    inner_layout, counts, got = so.run(body, 4)[0]
    assert inner_layout == (NormPartial(0),) and counts >= 1
    torch.testing.assert_close(got, vector_norm(vector_norm(full, 0, 1), 0))


@pytest.mark.usefixtures("bandwidth_only_links")
def test_foreach_norm_is_pending_per_tensor():
    full = torch.randn(6, 40, generator=torch.Generator().manual_seed(5), dtype=f64)
    layouts, counts, got = _pending(lambda x: torch._foreach_norm([x, x.cumsum(1), x * 3], INF), full, [Shard(1)])
    assert (layouts, counts) == ([(NormPartial(INF),)] * 3, 1)  # the one collective is cumsum's shard totals
    for g, w in zip(got, torch._foreach_norm([full, full.cumsum(1), full * 3], INF)):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("op", ["stack", "cat"])
@pytest.mark.usefixtures("bandwidth_only_links")
def test_stack_keeps_pending_norms_together(op):
    """Norms pending on different mesh dims, and a replicated one, stack into one pending tensor."""
    g = torch.Generator().manual_seed(6)
    a, b, c = (torch.randn(8, 30, generator=g, dtype=f64) for _ in range(3))

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        xs = [
            so.distribute_tensor(a, mesh, [Shard(1), Replicate()]),
            so.distribute_tensor(b, mesh, [Replicate(), Shard(0)]),
            so.distribute_tensor(c, mesh, [Replicate(), Replicate()]),
        ]
        norms = [vector_norm(x, 2.5) for x in xs]
        with so.CommDebugMode() as comm:
            joined = torch.stack(norms) if op == "stack" else torch.cat([n.reshape(1) for n in norms])
            total = vector_norm(joined, 2.5)
        return (
            [tuple(n.placements) for n in norms],
            tuple(total.placements),
            comm.get_total_counts(),
            total.full_tensor(),
        )

    norms_layouts, total_layout, counts, got = so.run(body, 4)[0]
    P = NormPartial(2.5)
    assert norms_layouts == [(P, Replicate()), (Replicate(), P), (Replicate(), Replicate())]
    assert (total_layout, counts) == ((P, P), 0)
    want = vector_norm(torch.stack([vector_norm(t, 2.5) for t in (a, b, c)]), 2.5)
    torch.testing.assert_close(got, want)


def test_cat_of_partial_sums_passes_and_shards_pass():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(6, 10, generator=g, dtype=f64), torch.randn(6, 4, generator=g, dtype=f64)
    for fn, placements, want_layout in [
        (lambda x, y: torch.cat([x, y], 1), [Shard(0)], (Shard(0),)),
        (lambda x, y: torch.stack([y.exp(), y], 2), [Shard(1)], (Shard(1),)),
        (lambda x, y: torch.cat([x.sum(1, keepdim=True), y.sum(1, keepdim=True)], 0), [Partial()], (Partial(),)),
    ]:

        def body():
            mesh = so.init_device_mesh("cpu", (4,))
            x, y = (so.distribute_tensor(t, mesh, placements) for t in (a, b))  # noqa: B023 - called within this iteration
            with so.CommDebugMode() as comm:
                z = fn(x, y)  # noqa: B023 - called within this iteration
            return tuple(z.placements), comm.get_total_counts(), z.full_tensor()

        layout, counts, got = so.run(body, 4)[0]
        assert (layout, counts) == (want_layout, 0)
        torch.testing.assert_close(got, fn(a, b))


# ------------------------------------------------------------------ bytes (mesh (4,), x = f32[8, 4096] on S(1))

ROWS, COLS, RANKS = 8, 4096, 4
F32, I64 = 4, 8


@pytest.fixture(scope="module")
def wide():
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("p", [2.0, 1.0, INF, -INF, 3.0, 0.0])
def test_bytes_of_norm_over_sharded_dim(wide, p):
    def body():
        mesh = so.init_device_mesh("cpu", (RANKS,))
        x = so.distribute_tensor(wide, mesh, [Shard(1)])
        with so.CommDebugMode() as op_only:
            y = vector_norm(x, p, 1)
        with so.CommDebugMode() as with_full:
            full = vector_norm(x, p, 1).full_tensor()
        return (
            op_only.get_total_counts(),
            tuple(y.placements),
            with_full.get_total_bytes(),
            with_full.get_comm_counts(),
            full,
        )

    counts, layout, nbytes, kinds, got = so.run(body, RANKS)[0]
    # the local norm is pending; full_tensor() all-reduces one f32 per row
    assert (counts, layout, nbytes, kinds) == (0, (NormPartial(p),), ROWS * F32, {"all_reduce": 1})
    torch.testing.assert_close(got, vector_norm(wide, p, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "p,kinds,per_row",
    [
        (2.0, {"all_reduce": 1}, F32),  # the norm, resolved once
        (3.0, {"all_reduce": 1}, F32),
        (INF, {"all_gather": 1}, F32 + I64),  # (max |x|, count of maxima): the norm and the tie count in one round
    ],
)
def test_backward_of_norm_resolves_once(wide, p, kinds, per_row):
    def body():
        mesh = so.init_device_mesh("cpu", (RANKS,))
        x = so.distribute_tensor(wide, mesh, [Shard(1)]).requires_grad_()
        y = vector_norm(x, p, 1)
        g = so.distribute_tensor(torch.linspace(-1, 1, ROWS), mesh, [Replicate()])
        with so.CommDebugMode() as comm:
            y.backward(g)
        return comm.get_comm_counts(), comm.get_total_bytes(), tuple(x.grad.placements), x.grad.full_tensor()

    counts, nbytes, layout, got = so.run(body, RANKS)[0]
    x = wide.clone().requires_grad_()
    vector_norm(x, p, 1).backward(torch.linspace(-1, 1, ROWS))
    torch.testing.assert_close(got, x.grad)
    assert (counts, nbytes, layout) == (kinds, ROWS * per_row, (Shard(1),))


# ------------------------------------------------------------------ clip_grad_norm_ over 16 parameters on a (2,2) mesh

# Layouts reduce over mesh dim 0, mesh dim 1, both, or none; shapes shard unevenly.
CLIP_LAYOUTS = [
    [Shard(0), Replicate()],
    [Replicate(), Shard(1)],
    [Shard(0), Shard(1)],
    [Replicate(), Replicate()],
    [Shard(1), Shard(0)],
    [Shard(0), Shard(0)],
    [Shard(1), Replicate()],
    [Replicate(), Shard(0)],
]
CLIP_SHAPES = [(64, 30), (26, 72), (48, 47), (33, 64)]


def _clip_params():
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randn(CLIP_SHAPES[i % 4], generator=g),
            torch.randn(CLIP_SHAPES[i % 4], generator=g),
            CLIP_LAYOUTS[i % 8],
        )
        for i in range(16)
    ]


def _reducing_groups(layouts) -> set[tuple[int, ...]]:
    return {tuple(i for i, q in enumerate(pl) if q.is_shard()) for pl in layouts} - {()}


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per-tensor"])
@pytest.mark.parametrize("p", [2.0, INF], ids=["p2", "pinf"])
def test_clip_grad_norm_one_collective_per_reducing_mesh_dim(foreach, p):
    params = _clip_params()

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        dparams = []
        for w, grad, pl in params:
            prm = so.distribute_tensor(w, mesh, pl).requires_grad_()
            prm.grad = so.distribute_tensor(grad, mesh, pl)
            dparams.append(prm)
        with so.CommDebugMode() as comm:
            total = torch.nn.utils.clip_grad_norm_(dparams, max_norm=1.0, norm_type=p, foreach=foreach)
        return (
            comm.get_comm_counts(),
            comm.get_total_bytes(),
            total.full_tensor(),
            [q.grad.full_tensor() for q in dparams],
        )

    counts, nbytes, total, grads = so.run(body, 4)[0]
    ref = [torch.nn.Parameter(w.clone()) for w, _, _ in params]
    for q, (_, grad, _) in zip(ref, params):
        q.grad = grad.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=p, foreach=foreach)
    torch.testing.assert_close(total, want)
    for got, q in zip(grads, ref):
        torch.testing.assert_close(got, q.grad)
    # Every per-tensor norm is pending (no collective); stack + vector_norm keep them pending
    # together over both mesh dims; the one resolution is ONE all-reduce of one f32 over the
    # group spanning both mesh dims: not one per reduction group ({0}, {1}, {0,1}), nor per
    # mesh dim, nor per tensor.
    groups = _reducing_groups(pl for _, _, pl in params)
    mesh_dims = set().union(*groups)
    assert len(groups) == 3 and len(mesh_dims) == 2
    assert counts == {"all_reduce": 1}
    assert nbytes == F32


# ------------------------------------------------------------------ errors and other dtypes


@pytest.mark.parametrize(
    "call", [lambda x: vector_norm(x, 2, 3), lambda x: x.norm(dim=(0, 4)), lambda x: torch.norm(x, 3, -3)]
)
def test_bad_dim_is_a_sharding_error(call):
    check_bad_dim_refused(call, r"dim .* out of range")


def test_norm_of_complex_is_pending_and_real():
    full = torch.randn(3, 40, generator=torch.Generator().manual_seed(2), dtype=torch.complex128)
    layouts, counts, got = _pending(lambda x: vector_norm(x, 3, 1), full, [Shard(1)])
    assert (layouts, counts) == ([(NormPartial(3),)], 0)
    torch.testing.assert_close(got[0], vector_norm(full, 3, 1))
