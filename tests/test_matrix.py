"""Matrix products (ops/matrix.py) against single-device torch: values, gradients, layouts and
bytes (forward and backward), all in strict mode.

Bytes are asserted on mesh (4,) for the layouts of Megatron-style tensor parallelism; a grid
over operand layouts x matmul ranks 1-D..4-D is sampled by default and exhaustive with -m slow.
"""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from matrix_harness import check, make, strict_mode
from shardops import Partial, Replicate, Shard

R = Replicate()
S = Shard
SUM = Partial("sum")

# Uneven on 4 ranks: 10 output features (3,3,3,1), hidden 66 (17,17,17,15), sequence 5 (2,2,1,0).
B, SEQ, HID, OUT = 2, 5, 66, 10


def linear(x, w, b=None):
    return F.linear(x, w, b)


# ------------------------------------------------------------------ Megatron layouts, bytes asserted


@pytest.mark.parametrize("bias", [True, False])
def test_column_parallel_linear_moves_nothing(bias):
    fulls = [make((B, SEQ, HID), 0), make((OUT, HID), 1)] + ([make((OUT,), 2)] if bias else [])
    layouts = [(R,), (S(0),)] + ([(S(0),)] if bias else [])
    r = check(linear, fulls, (4,), layouts)
    assert r.nbytes == 0, r.counts
    assert r.out_layout == (S(2),)
    assert r.grad_layouts[1] == (S(0),)
    if bias:
        assert r.grad_layouts[2] == (S(0),)


@pytest.mark.parametrize("bias", [True, False])
def test_row_parallel_linear_moves_nothing(bias):
    fulls = [make((B, SEQ, HID), 0), make((OUT, HID), 1)] + ([make((OUT,), 2)] if bias else [])
    layouts = [(S(2),), (S(1),)] + ([(R,)] if bias else [])
    r = check(linear, fulls, (4,), layouts)
    assert r.nbytes == 0, r.counts
    assert r.out_layout == (SUM,)
    assert r.grad_layouts[0] == (S(2),)
    assert r.grad_layouts[1] == (S(1),)


def _mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _mlp_data():
    return [make((B, SEQ, 16), 0), make((OUT, 16), 1), make((OUT,), 2), make((16, OUT), 3), make((16,), 4)]


MLP_LAYOUTS = [(R,), (S(0),), (S(0),), (S(1),), (R,)]


def test_megatron_mlp_materialised_output_is_one_all_reduce():
    fulls = _mlp_data()
    want = _mlp(*fulls)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        xs = [so.distribute_tensor(t, mesh, list(pl)) for t, pl in zip(fulls, MLP_LAYOUTS)]
        with so.CommDebugMode() as comm:
            y = _mlp(*xs).full_tensor()
        return dict(comm.get_comm_counts()), comm.get_total_bytes(), y

    with strict_mode():
        results = so.run(body, world_size=4)
    for counts, nbytes, y in results:
        assert {k: v for k, v in counts.items() if v} == {"all_reduce": 1}
        assert nbytes == want.numel() * 4
        torch.testing.assert_close(y, want, rtol=2e-5, atol=2e-5)


def test_megatron_mlp_forward_backward_moves_nothing():
    r = check(_mlp, _mlp_data(), (4,), MLP_LAYOUTS, grads=[False, True, True, True, True])
    assert r.nbytes == 0, r.counts
    assert r.out_layout == (SUM,)
    assert r.grad_layouts[1:4] == [(S(0),), (S(0),), (S(1),)]


@pytest.mark.parametrize("form", ["bmm", "matmul", "einsum"])
def test_heads_sharded_attention_scores_move_nothing(form):
    fns = {
        "bmm": lambda q, k: torch.bmm(q, k.transpose(1, 2)),
        "matmul": lambda q, k: q @ k.transpose(-1, -2),
        "einsum": lambda q, k: torch.einsum("bhsd,bhtd->bhst", q, k),
    }
    heads = 6  # uneven on 4 ranks: 2,2,2,0
    shapes = [(heads * B, SEQ, 8), (heads * B, 7, 8)] if form == "bmm" else [(B, heads, SEQ, 8), (B, heads, 7, 8)]
    d = 0 if form == "bmm" else 1
    r = check(fns[form], [make(shapes[0], 0), make(shapes[1], 1)], (4,), [(S(d),), (S(d),)])
    assert r.nbytes == 0, r.counts
    assert r.out_layout == (S(d),)
    assert r.grad_layouts == [(S(d),), (S(d),)]


@pytest.mark.parametrize("mesh_shape,layout", [((4,), (S(1),)), ((2, 2), (S(0), S(1))), ((2, 2), (S(1), S(1)))])
def test_sequence_parallel_linear_after_merging_batch_and_sequence_moves_nothing(mesh_shape, layout):
    """[b, s, h] with s sharded -> [b*s, h] is StridedShard(0, b) (with batches sharded on dp too:
    (S(0), StridedShard(0, b/dp))): the product and the view back keep it."""
    r = check(
        linear,
        [make((4, 10, 8), 0), make((OUT, 8), 1), make((OUT,), 2)],
        mesh_shape,
        [layout, (R,) * len(mesh_shape), (R,) * len(mesh_shape)],
    )
    assert r.nbytes == 0, r.counts
    assert r.out_layout == layout
    assert r.grad_layouts[0] == layout


# ------------------------------------------------------------------ each op, bias handling, partial inputs


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1)])
@pytest.mark.parametrize(
    "layouts",
    [[(R,), (S(1),), (S(0),)], [(S(0),), (R,), (S(1),)], [(S(1),), (S(0),), (R,)], [(R,), (S(0),), (R,)]],
    ids=["row", "col", "rowbias", "m1"],
)
def test_addmm_bias_added_once(beta, alpha, layouts):
    fn = lambda bias, a, b: torch.addmm(bias, a, b, beta=beta, alpha=alpha)  # noqa: E731
    fulls = [make((OUT,), 0), make((SEQ, HID), 1), make((HID, OUT), 2)]
    if layouts[0] == (S(1),):
        fulls[0] = make((SEQ, OUT), 0)
    check(fn, fulls, (4,), layouts)


@pytest.mark.parametrize("bias_shape", [(7,), (1, 7), (5, 1), (3, 5, 7)])
@pytest.mark.parametrize("d", [0, 1, 2, "k"])
def test_baddbmm(bias_shape, d):
    a, b = make((3, 5, 6), 1), make((3, 6, 7), 2)
    la, lb = ((S(2),), (S(1),)) if d == "k" else ((S(d),), (R,)) if d in (0, 1) else ((R,), (S(2),))
    if d == 0:
        lb = (S(0),)
    fn = lambda bias, x, y: torch.baddbmm(bias, x, y, beta=0.5, alpha=1.5)  # noqa: E731
    check(fn, [make(bias_shape, 0), a, b], (4,), [(R,), la, lb])


@pytest.mark.parametrize("layouts", [[(S(0),), (R,)], [(S(1),), (S(0),)], [(R,), (S(0),)]])
def test_mv_and_addmv(layouts):
    m, v = make((OUT, HID), 1), make((HID,), 2)
    check(torch.mv, [m, v], (4,), layouts)
    check(lambda b, x, y: torch.addmv(b, x, y, beta=2.0), [make((OUT,), 0), m, v], (4,), [(R,)] + layouts)


@pytest.mark.parametrize("layouts", [[(S(0),), (S(0),)], [(S(0),), (R,)]])
def test_dot_and_outer(layouts):
    r = check(torch.dot, [make((HID,), 1), make((HID,), 2)], (4,), layouts)
    if layouts[1] == (S(0),):
        assert r.nbytes == 0
    check(torch.outer, [make((OUT,), 1), make((HID,), 2)], (4,), layouts)


def test_partial_times_replicate_stays_pending():
    a, b = make((SEQ, HID), 1), make((HID, OUT), 2)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        rank = mesh.get_rank()
        part = so.DTensor.from_local(a * (rank + 1) / 10, mesh, [SUM])  # the parts sum to a
        w = so.distribute_tensor(b, mesh, [R])
        with so.CommDebugMode() as comm:
            y = torch.mm(part, w)
            z = torch.mm(w.t(), part.t())
        return y.placements, z.placements, comm.get_total_bytes(), y.full_tensor(), z.full_tensor()

    with strict_mode():
        results = so.run(body, world_size=4)
    for yp, zp, nbytes, y, z in results:
        assert (yp, zp, nbytes) == ((SUM,), (SUM,), 0)
        torch.testing.assert_close(y, a @ b, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(z, (a @ b).t(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "mesh_shape,layouts",
    [
        ((4,), [(R,), (S(0),), (S(0),)]),
        ((4,), [(S(2),), (S(1),), (R,)]),
        ((2, 2), [(S(0), R), (R, S(0)), (R, S(0))]),
        ((2, 2), [(S(1), S(2)), (R, S(1)), (R, R)]),
    ],
)
def test_linear_bfloat16(mesh_shape, layouts):
    fulls = [
        make((4, SEQ, HID), 0, torch.bfloat16),
        make((OUT, HID), 1, torch.bfloat16),
        make((OUT,), 2, torch.bfloat16),
    ]
    check(linear, fulls, mesh_shape, layouts)


def test_2d_mesh_data_and_tensor_parallel_mlp_moves_nothing():
    fulls = [make((4, SEQ, 16), 0), make((12, 16), 1), make((12,), 2), make((16, 12), 3), make((16,), 4)]
    layouts = [(S(0), R), (R, S(0)), (R, S(0)), (R, S(1)), (R, R)]
    r = check(_mlp, fulls, (2, 2), layouts, grads=[False, True, True, True, True])
    assert r.nbytes == 0, r.counts
    assert r.out_layout == (S(0), SUM)


# ------------------------------------------------------------------ grid: layouts x matmul ranks


def _matmul_shapes(na: int, nb: int) -> tuple[tuple, tuple]:
    """Operand shapes for torch.matmul of ranks na, nb: batch (3, 2), m 5, k 6 (uneven on 4), n 7."""
    m, k, n = 5, 6, 7
    a = (k,) if na == 1 else (3, 2, m, k)[4 - na :]
    b = (k,) if nb == 1 else (3, 2, k, n)[4 - nb :]
    if na >= 3 and nb >= 3 and na != nb:  # broadcast one batch dim
        b = b[:-3] + (1,) + b[-2:] if nb == 4 else b
    return a, b


def _layouts(ndim: int, mesh_ndim: int) -> list[tuple]:
    one = [R] + [S(d) for d in range(ndim)]
    return list(itertools.product(one, repeat=mesh_ndim))


GRID = [
    (mesh, na, nb, la, lb)
    for mesh in [(4,), (2, 2)]
    for na in range(1, 5)
    for nb in range(1, 5)
    for la in _layouts(na, len(mesh))
    for lb in _layouts(nb, len(mesh))
]
SAMPLED = random.Random(12).sample(GRID, 24)


def check_grid_case(mesh, na, nb, la, lb, dtype=torch.float32):
    """matmul on the layouts: values and gradients against torch (asserted by matrix_harness.check)."""
    sa, sb = _matmul_shapes(na, nb)
    check(torch.matmul, [make(sa, 0, dtype), make(sb, 1, dtype)], mesh, [la, lb])


def _grid_id(case) -> str:
    mesh, na, nb, la, lb = case
    return f"{'x'.join(map(str, mesh))}-{na}d@{nb}d-{''.join(map(repr, la))}-{''.join(map(repr, lb))}"


@pytest.mark.parametrize("case", SAMPLED, ids=_grid_id)
def test_matmul_grid_sampled(case):
    check_grid_case(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_matmul_grid_exhaustive(case):
    check_grid_case(*case)
    check_grid_case(*case, dtype=torch.bfloat16)


# ------------------------------------------------------------------ explain answers for products


def test_explain_matmul_on_8x8():
    from shardops.explain import explain

    e = explain("matmul(x, w)", mesh=(8, 8), x="f32[1024,4096]:S(0),R", w="f32[4096,4096]:R,S(1)")
    step = e.steps[0]
    assert step.op == "aten.mm.default" and not step.fallback
    assert e.bytes == 0 and "S(0),S(1)" in str(e)
    e = explain("F.linear(x, w)", mesh=(8, 8), x="f32[64,256,4096]:S(0),S(2)", w="f32[1024,4096]:R,S(1)")
    assert e.bytes == 0 and not any(s.fallback for s in e.steps)


def test_explain_cli_matmul(capsys):
    from shardops import cli

    code = cli.main(
        ["explain", "matmul(x, w)", "--mesh", "8x8", "--x", "f32[1024,4096]:S(0),R", "--w", "f32[4096,4096]:R,S(1)"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "aten.mm.default" in out and "no sharded strategy" not in out
