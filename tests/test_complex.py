"""Complex views, lazy conjugate/negative bits and complex arithmetic (ops/complex.py) against torch.

The rotary position embedding of LLaMA-style models (torch.polar frequencies, view_as_complex,
a complex product, view_as_real, flatten) runs exact and moves nothing on heads- and
sequence-sharded inputs, forward and backward, in strict mode. The lazy conjugate bit that
`_conj` sets is never dropped: conj(f) * f is |f|^2 on every layout.
"""

from __future__ import annotations

import pytest
import torch

import shardops as so
from index_harness import S0, S1, S2, R, check
from shardops import Replicate, Shard

GEN = torch.Generator().manual_seed(0)


def _angles(seq: int, dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)


def llama_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); angles: (seq, head_dim // 2)."""
    freqs = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs.view(1, x.shape[1], 1, x.shape[-1] // 2)
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


ROTARY_LAYOUTS = {
    "heads": ((4,), [[S2], [R]]),
    "sequence": ((4,), [[S1], [S0]]),
    "batch_heads": ((2, 2), [[S0, S2], [R, R]]),
    "sequence_heads": ((2, 2), [[S1, S2], [S0, R]]),
    "head_dim_pairs": ((4,), [[Shard(3)], [S1]]),  # 4 pairs on 4 ranks: every shard splits on whole pairs
}


@pytest.mark.parametrize("heads,seq", [(8, 12), (6, 10)], ids=["even", "uneven"])
@pytest.mark.parametrize("layout", sorted(ROTARY_LAYOUTS))
def test_llama_rotary_embedding_is_exact_and_local(layout, heads, seq):
    mesh_shape, placements = ROTARY_LAYOUTS[layout]
    x = torch.randn(2, seq, heads, 8, generator=GEN)
    got = check(
        llama_rotary, [x, _angles(seq, 8)], mesh_shape, placements, wants_grad=[True, False], fwd_bytes=0, bwd_bytes=0
    )
    assert got["layout"] == tuple(placements[0]), got["layout"]
    assert got["grad_layouts"][0] == tuple(placements[0])


@pytest.mark.parametrize("layout", ["heads", "sequence", "sequence_heads"])
def test_llama_rotary_gradient_of_the_angles(layout):
    """Learned angles: their gradient is exact too (torch.polar's backward); a replicated angle table may
    get a pending-sum gradient (as torch's DTensor gives a Partial gradient to a replicated weight)."""
    mesh_shape, placements = ROTARY_LAYOUTS[layout]
    x = torch.randn(2, 6, 4, 8, generator=GEN)
    got = check(llama_rotary, [x, _angles(6, 8)], mesh_shape, placements, fwd_bytes=0)
    assert got["grad_layouts"][0] == tuple(placements[0])


def test_rotary_with_head_dim_sharded_off_pairs_gathers_and_stays_exact():
    """head_dim 12 = 6 pairs on 4 ranks: shards of 3 real values split a pair, so the pair dim is gathered
    first (never a wrong value)."""
    x = torch.randn(2, 5, 3, 12, generator=GEN)
    check(llama_rotary, [x, _angles(5, 12)], (4,), [[Shard(3)], [R]], wants_grad=[True, False])


def test_torch_dtensor_conj_test():
    """PyTorch's DTensor test_conj_complex_dtensor: conj of a replicated complex tensor plus 1, no collective."""
    freqs = torch.randn(1, 1, dtype=torch.complex64, generator=GEN)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        d = so.distribute_tensor(freqs, mesh, [Replicate()])
        with so.CommDebugMode() as comm:
            out = d.conj() + 1
        return comm.get_total_counts(), out.full_tensor()

    for counts, value in so.run(body, 4):
        assert counts == 0
        assert torch.equal(value, freqs.conj() + 1)


def test_torch_dtensor_rotary_embedding_complex_ops_test():
    """PyTorch's DTensor test_rotary_embedding_complex_ops: forward and backward, no collective, torch's gradient."""
    xq = torch.randn(1, 1, 2, generator=GEN)
    freqs = torch.randn(1, 1, dtype=torch.complex64, generator=GEN)

    def apply(q, f):
        return torch.view_as_real(torch.view_as_complex(q) * f)

    ref = xq.clone().requires_grad_()
    apply(ref, freqs).sum().backward()

    def body():
        so.set_strict(True)
        try:
            mesh = so.init_device_mesh("cpu", (4,))
            q = so.distribute_tensor(xq, mesh, [Replicate()]).requires_grad_()
            f = so.distribute_tensor(freqs, mesh, [Replicate()])
            with so.CommDebugMode() as comm:
                apply(q, f).sum().backward()
            return comm.get_total_counts(), q.grad.full_tensor()
        finally:
            so.set_strict(False)

    for counts, grad in so.run(body, 4):
        assert counts == 0
        assert torch.equal(grad, ref.grad)


@pytest.mark.parametrize("mesh_shape,placements", [((4,), [S0]), ((4,), [R]), ((2, 2), [S0, S1]), ((2, 2), [R, S0])])
def test_conj_product_is_the_squared_modulus(mesh_shape, placements):
    """The replicate fallback used to drop the lazy conjugate bit: conj(f) * f came out as f * f."""
    f = torch.randn(7, 5, dtype=torch.complex128, generator=GEN)
    check(lambda t: t.conj() * t, [f], mesh_shape, [placements], fwd_bytes=0, bwd_bytes=0)
    check(lambda t: torch.conj(t) * 3 - t, [f], mesh_shape, [placements])


LAZY_BIT_PATHS = {
    "conj_imag": lambda t: t.conj().imag,  # _conj then _neg_view
    "conj_real": lambda t: t.conj().real,
    "resolve_conj": lambda t: t.conj().resolve_conj(),
    "resolve_neg": lambda t: t.conj().imag.resolve_neg(),
    "conj_conj": lambda t: t.conj().conj() * 1,
    "conj_clone": lambda t: t.conj().clone(),
    "conj_view_as_real_of_resolved": lambda t: torch.view_as_real(t.conj().resolve_conj()),
    "conj_slice": lambda t: t.conj()[:, 1:4] * 2,
    "conj_transpose": lambda t: t.conj().t() + 0,
    "conj_abs_angle": lambda t: t.conj().abs() + t.conj().angle(),
    "conj_physical": lambda t: torch.conj_physical(t),
    "neg_of_imag_times": lambda t: t.conj().imag * t.imag,
    "conj_sum": lambda t: t.conj().sum(0),
    # the planner moves a local that still carries the bit (views and mm pass it through torch's fallback)
    # (reshape: flattening 9 rows over 4 moves data, which a view refuses; reshape reaches aten.view all the same)
    "conj_flatten": lambda t: t.conj().reshape(-1) * 1,
    "imag_of_conj_flatten": lambda t: t.conj().imag.reshape(-1) * 1,
    "conj_flip": lambda t: t.conj().flip(1) * 1,
    "conj_index_select": lambda t: t.conj().index_select(1, torch.tensor([4, 0, 2])) * 1,
    "conj_reshape_pairs": lambda t: torch.view_as_real(t.conj().resolve_conj()).reshape(9, -1) * 1,
}


@pytest.mark.parametrize("mesh_shape,placements", [((4,), [S0]), ((4,), [S1]), ((2, 2), [S0, R])])
@pytest.mark.parametrize("name", sorted(LAZY_BIT_PATHS))
def test_lazy_bit_paths(name, mesh_shape, placements):
    f = torch.randn(9, 6, dtype=torch.complex128, generator=GEN)
    # flattening 9 rows sharded over 4 (3,3,3,0) is no Shard of the merged dim: the view gathers on
    # purpose here (the move of a conjugated local is what these paths test), allowed explicitly
    with so.allow_replicate("view"):
        check(LAZY_BIT_PATHS[name], [f], mesh_shape, [placements])


@pytest.mark.parametrize("mesh_shape,placements", [((4,), [S0]), ((4,), [S1]), ((2, 2), [S0, R])])
def test_conj_matmul_through_any_path(mesh_shape, placements):
    """mm understands the conjugate bit, so the conjugated local reaches dispatch as it is; whether mm is
    sharded or replicated (not strict: the fallback's gather is exactly a move of such a local), the
    values are torch's."""
    f = torch.randn(9, 6, dtype=torch.complex128, generator=GEN)
    check(lambda t: t.conj() @ t.t(), [f], mesh_shape, [placements], strict=False)


def test_view_as_real_of_an_unresolved_conjugate_is_refused_like_torch():
    f = torch.randn(4, 3, dtype=torch.complex64, generator=GEN)
    with pytest.raises(RuntimeError, match="conjugated"):
        torch.view_as_real(f.conj())

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        d = so.distribute_tensor(f, mesh, [Shard(0)])
        try:
            torch.view_as_real(d.conj())
        except RuntimeError as e:
            return str(e)
        return "accepted"

    for message in so.run(body, 4):
        assert "conjugated" in message


COMPLEX_POINTWISE = {
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b + 3),
    "exp_abs": lambda a, b: torch.exp(a).abs() + b.abs(),
    "sgn_mul_conj": lambda a, b: torch.sgn(a) * b.conj(),
    "real_imag_mix": lambda a, b: torch.complex(a.real * b.imag, a.imag),
}


@pytest.mark.parametrize("mesh_shape,placements", [((4,), [S0]), ((4,), [S1]), ((2, 2), [S1, S0])])
@pytest.mark.parametrize("name", sorted(COMPLEX_POINTWISE))
def test_complex_pointwise_backward(name, mesh_shape, placements):
    a = torch.randn(10, 7, dtype=torch.complex128, generator=GEN)
    b = torch.randn(10, 7, dtype=torch.complex128, generator=GEN)
    check(COMPLEX_POINTWISE[name], [a, b], mesh_shape, [placements, placements], fwd_bytes=0, bwd_bytes=0)


def test_view_as_complex_keeps_batch_shards_and_partial_sums():
    x = torch.randn(6, 5, 2, generator=GEN, dtype=torch.float64)
    got = check(torch.view_as_complex, [x], (2, 2), [[S0, S1]], fwd_bytes=0, bwd_bytes=0)
    assert got["layout"] == (S0, S1)

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        part = so.DTensor.from_local(x * (mesh.get_rank() + 1), mesh, [so.Partial("sum")], shape=x.shape)
        with so.CommDebugMode() as comm:
            z = torch.view_as_complex(part)
        return comm.get_total_counts(), z.placements, z.full_tensor()

    for counts, placements, value in so.run(body, 2):
        assert counts == 0 and placements == (so.Partial("sum"),)
        torch.testing.assert_close(value, torch.view_as_complex(x * 3))
