"""Bad input: every misuse gives torch's result, torch's error or a ShardingError naming the problem,
and an op that fails leaves nothing half-done (an in-place op that fails leaves its input unchanged).

Covers: wrong dtypes, operands on different meshes, odd local tensors in from_local
(non-contiguous, expanded, wrongly shaped, uneven without shape=), requires_grad on integer
tensors, NaN/inf in reductions and norms (same values as torch), global indices past what
float32 can count (int64 everywhere), and a rank using a mesh it is not part of.

Tests marked xfail(strict=True) pin a check the runtime lacks today; each names the fix
in its docstring. When the fix lands the test passes, strict
xfail turns that into a failure, and the marker is to be removed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from shardops import Partial, Replicate, Shard
from shardops.experimental import implicit_replication
from shardops.mesh import DeviceMesh
from shardops.placements import chunk_size_and_offset, dim_positions, local_shape_and_offset
from test_properties import OPS, missing  # tests/ is not a package

aten = torch.ops.aten
nan, inf = math.nan, math.inf


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", value) or (exception type name, message)."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return type(e).__name__, str(e)


def assert_refused_like_torch(ours: tuple[str, Any], torch_fn: Callable[[], Any]) -> None:
    """torch raises for this input: shardops must raise too, ShardingError or torch's error type."""
    kind, _ = outcome(torch_fn)
    assert kind != "ok", "torch accepts this input; the test expects a refusal"
    assert ours[0] in ("ShardingError", kind), f"torch raised {kind}; shardops: {ours}"


# ------------------------------------------------------------------ wrong dtypes

INT_REFUSED = {
    "softmax": lambda x: torch.softmax(x, 1),
    "log_softmax": lambda x: F.log_softmax(x, 1),
    "mean": lambda x: x.mean(1),
    "var": lambda x: x.var(1),
    "layer_norm": lambda x: F.layer_norm(x, (x.shape[1],)),
}
# Integer inputs torch accepts, promoting the result: shardops must give the same dtype and values.
INT_ACCEPTED = {
    "logsumexp": ("lse.logsumexp", lambda x: torch.logsumexp(x, 1)),
    "sum int32": ("reduce.sum", lambda x: x.sum(1)),
    "cumsum int32": ("scan.cumsum", lambda x: x.cumsum(1)),
    "prod int32": ("reduce.prod", lambda x: x.prod(1)),
    "vector_norm": ("norm.vector_norm", lambda x: torch.linalg.vector_norm(x.float(), 2, 1)),
}


@pytest.mark.parametrize("name", sorted(INT_REFUSED))
def test_integer_input_refused_like_torch(name):
    fn = INT_REFUSED[name]
    full = torch.arange(12).reshape(3, 4)

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(full, mesh, [Shard(1)])
        return outcome(lambda: fn(x).full_tensor())

    for ours in so.run(body, 2):
        assert_refused_like_torch(ours, lambda: fn(full))


@pytest.mark.parametrize("name", sorted(INT_ACCEPTED))
def test_integer_input_promoted_like_torch(name):
    op_name, fn = INT_ACCEPTED[name]
    gaps = missing(OPS[op_name].needs)
    assert not gaps, f"not registered: {', '.join(gaps)}"
    full = torch.arange(-6, 6, dtype=torch.int32).reshape(3, 4)
    want = fn(full)

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        got = fn(so.distribute_tensor(full, mesh, [Shard(1)]))
        return got.dtype, got.full_tensor()

    for dtype, value in so.run(body, 2):
        assert dtype == want.dtype
        torch.testing.assert_close(value, want)


@pytest.mark.parametrize(
    "target_dtype",
    [
        torch.float32,
        torch.int32,  # regression: was accepted by the vocab-parallel algorithm (losses.py checks the dtype now)
    ],
    ids=["float", "int32"],
)
def test_cross_entropy_target_dtype_refused_like_torch(target_dtype):
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([0, 4, 2]).to(target_dtype)

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(logits, mesh, [Shard(1)])
        return outcome(lambda: F.cross_entropy(x, target).full_tensor())

    for ours in so.run(body, 2):
        assert_refused_like_torch(ours, lambda: F.cross_entropy(logits, target))


PROMOTIONS = {
    "int+float": (torch.arange(6).reshape(2, 3), torch.randn(2, 3, generator=torch.Generator().manual_seed(1))),
    "bool*float64": (torch.tensor([[True, False, True], [False, True, True]]), torch.randn(2, 3, dtype=torch.float64)),
    "int32+int64": (torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.arange(6).reshape(2, 3)),
    "float32+float64": (torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64)),
}


@pytest.mark.parametrize("name", sorted(PROMOTIONS))
@pytest.mark.parametrize("other_plain", [False, True], ids=["dtensor", "plain"])
def test_mixed_dtypes_promote_like_torch(name, other_plain):
    """A plain operand (every rank's same copy) is taken as Replicate only under implicit_replication(),
    as in torch; its dtype promotes as torch's does either way."""
    a, b = PROMOTIONS[name]
    want = a * b if a.dtype == torch.bool else a + b

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        da = so.distribute_tensor(a, mesh, [Shard(0)])
        db = b if other_plain else so.distribute_tensor(b, mesh, [Shard(1)])
        with implicit_replication():
            got = da * db if a.dtype == torch.bool else da + db
        return got.dtype, got.full_tensor()

    for dtype, full in so.run(body, 2):
        assert dtype == want.dtype
        torch.testing.assert_close(full, want)


def test_in_place_cast_refused_and_self_unchanged():
    ints = torch.arange(8).reshape(2, 4)
    floats = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(ints, mesh, [Shard(1)])
        y = so.distribute_tensor(floats, mesh, [Shard(1)])
        result = outcome(lambda: x.add_(y))
        return result, x.placements, x.full_tensor()

    for result, placements, full in so.run(body, 2):
        assert_refused_like_torch(result, lambda: ints.clone().add_(floats))
        assert placements == (Shard(1),) and torch.equal(full, ints)


def test_out_that_cannot_hold_the_result_refused_and_unchanged():
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        dx = so.distribute_tensor(x, mesh, [Shard(1)])
        out = so.distribute_tensor(torch.zeros(2, 4, dtype=torch.long), mesh, [Shard(1)])
        return outcome(lambda: torch.add(dx, dx, out=out)), out.full_tensor()

    for result, out_full in so.run(body, 2):
        assert_refused_like_torch(result, lambda: torch.add(x, x, out=torch.zeros(2, 4, dtype=torch.long)))
        assert torch.equal(out_full, torch.zeros(2, 4, dtype=torch.long))


def test_dtype_that_differs_between_ranks_is_caught():
    """from_local with float32 on one rank and float64 on the other: an error, never mixed garbage."""

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        dtype = torch.float32 if mesh.get_rank() == 0 else torch.float64
        x = so.DTensor.from_local(torch.ones(2, 3, dtype=dtype), mesh, [Shard(0)])
        return x.full_tensor()

    with pytest.raises(so.CollectiveError, match="mismatched collectives.*float32.*float64"):
        so.run(body, 2, timeout=10)


# ------------------------------------------------------------------ meshes


def _two_meshes():
    mesh = so.init_device_mesh("cpu", (4,))
    named = so.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))  # same ranks, another mesh
    grid = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh, named, grid


@pytest.mark.parametrize("other", ["named", "grid", "submesh"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
def test_operands_on_different_meshes_refused(other, in_place):
    full = torch.arange(8.0)

    def body():
        mesh, named, grid = _two_meshes()
        other_mesh = {"named": named, "grid": grid, "submesh": grid["tp"]}[other]
        x = so.distribute_tensor(full, mesh, [Shard(0)])
        y = so.distribute_tensor(full, other_mesh, [Replicate()] * other_mesh.ndim, src_data_rank=None)
        result = outcome(lambda: x.add_(y) if in_place else x + y)
        return result, x.placements, x.full_tensor()

    for (kind, message), placements, x_full in so.run(body, 4):
        assert kind == "ShardingError" and "different meshes" in message, (kind, message)
        assert placements == (Shard(0),) and torch.equal(x_full, full)


def test_redistribute_onto_another_mesh_refused():
    def body():
        mesh, named, _ = _two_meshes()
        x = so.distribute_tensor(torch.ones(4), mesh, [Shard(0)])
        return outcome(lambda: x.redistribute(named, [Replicate()]))

    for kind, message in so.run(body, 4):
        assert kind == "ShardingError" and "between meshes" in message


# ------------------------------------------------------------------ from_local


def _rank_local(rank: int) -> torch.Tensor:
    return torch.arange(12.0).reshape(3, 4) + 100 * rank


@pytest.mark.parametrize("make", ["transposed", "expanded", "strided_slice"])
def test_odd_local_tensors_give_right_results(make):
    """Non-contiguous and stride-0 locals: full_tensor and ops see the values, not the memory layout."""

    def local_of(rank: int) -> torch.Tensor:
        base = _rank_local(rank)
        return {
            "transposed": base.t(),
            "expanded": base[0].expand(4, 4),
            "strided_slice": base.repeat(1, 2)[:, ::2].t(),
        }[make]

    want = torch.cat([local_of(r) for r in range(2)])

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.DTensor.from_local(local_of(mesh.get_rank()), mesh, [Shard(0)])
        return x.full_tensor(), (x * 2 + 1).full_tensor(), torch.softmax(x, 0).full_tensor(), x.sum(0).full_tensor()

    for full, affine, softmax, total in so.run(body, 2):
        torch.testing.assert_close(full, want)
        torch.testing.assert_close(affine, want * 2 + 1)
        torch.testing.assert_close(softmax, torch.softmax(want, 0))
        torch.testing.assert_close(total, want.sum(0))


def test_in_place_on_expanded_local_refused_like_torch():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.DTensor.from_local(torch.arange(3.0).expand(4, 3), mesh, [Shard(0)])
        return outcome(lambda: x.add_(1))

    for ours in so.run(body, 2):
        assert_refused_like_torch(ours, lambda: torch.arange(3.0).expand(4, 3).add_(1))


def test_wrongly_shaped_local_refused():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        return outcome(lambda: so.DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)], shape=(4, 4)))

    for kind, message in so.run(body, 2):
        assert kind == "ShardingError"
        assert "holds a local tensor of shape (3, 4)" in message and "gives it (2, 4)" in message


def test_uneven_locals_without_shape_raise_not_garbage():
    """Each rank infers another global shape: the first collective sees the disagreement (threads world).

    Under torch.distributed (gloo) the same mistake reads padding as data or aborts a process:
    from_local(run_check=True) should compare the inferred shapes (one small all_gather, as check_same_everywhere does).
    """

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        local = torch.ones(3 if mesh.get_rank() == 0 else 2, 4)
        return so.DTensor.from_local(local, mesh, [Shard(0)]).full_tensor()

    with pytest.raises(so.CollectiveError, match="mismatched collectives"):
        so.run(body, 2, timeout=10)


BAD_PLACEMENTS = {
    "shard dim past ndim": ([Shard(2)], "shards dim 2, but the tensor has 2 dim"),
    "two placements, 1-d mesh": ([Shard(0), Replicate()], "got 2 placements"),
    "not a placement": (["S(0)"], "is not a placement"),
}


@pytest.mark.parametrize("name", sorted(BAD_PLACEMENTS))
def test_placements_that_do_not_fit_refused(name):
    placements, fragment = BAD_PLACEMENTS[name]

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        return outcome(lambda: so.DTensor.from_local(torch.ones(2, 3), mesh, placements))

    for kind, message in so.run(body, 2):
        assert kind == "ShardingError" and fragment in message, (kind, message)


def test_mixed_pending_reductions_refused():
    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        return outcome(lambda: so.DTensor.from_local(torch.ones(2), mesh, [Partial("sum"), Partial("max")]))

    for kind, message in so.run(body, 4):
        assert kind == "ShardingError" and "mixed pending reductions" in message


# ------------------------------------------------------------------ requires_grad and integer tensors


def test_integer_dtensor_cannot_require_grad_like_torch():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.arange(4), mesh, [Shard(0)])
        return outcome(lambda: x.requires_grad_())

    for ours in so.run(body, 2):
        assert_refused_like_torch(ours, lambda: torch.arange(4).requires_grad_())


INTEGER_OUTPUTS = {
    "argmax": ("reduce.argmax", lambda x: x.argmax(1)),
    "max.dim indices": ("reduce.max_dim", lambda x: x.max(1).indices),
    "topk indices": ("select.topk", lambda x: x.topk(2, 1).indices),
    "sort indices": ("select.sort", lambda x: x.sort(dim=1, stable=True).indices),
    "cummax indices": ("scan.cummax", lambda x: x.cummax(1).indices),
    "comparison": ("pointwise.gt", lambda x: x > 0),
    "cast to int": ("pointwise.gt", lambda x: x.long()),
}


@pytest.mark.parametrize("name", sorted(INTEGER_OUTPUTS))
def test_integer_outputs_of_a_grad_input_do_not_require_grad(name):
    op_name, fn = INTEGER_OUTPUTS[name]
    assert not missing(OPS[op_name].needs), f"{op_name} not registered"
    full = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    want = fn(full.clone().requires_grad_())

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
        got = fn(x)
        return got.requires_grad, got.dtype, got.full_tensor()

    for requires_grad, dtype, value in so.run(body, 2):
        assert requires_grad == want.requires_grad and dtype == want.dtype
        assert torch.equal(value, want)


# ------------------------------------------------------------------ NaN and inf: the same values as torch

SPECIAL_OPS = {
    "sum": ("reduce.sum", lambda x: x.sum(1)),
    "nansum": ("reduce.nansum", lambda x: x.nansum(1)),
    "mean": ("reduce.mean", lambda x: x.mean(1)),
    "prod": ("reduce.prod", lambda x: x.prod(1)),
    "amax": ("reduce.amax", lambda x: x.amax(1)),
    "amin": ("reduce.amin", lambda x: x.amin(1)),
    "argmax": ("reduce.argmax", lambda x: x.argmax(1)),
    "argmin": ("reduce.argmin", lambda x: x.argmin(1)),
    "max.dim": ("reduce.max_dim", lambda x: x.max(1)),
    "argmax flat": ("reduce.argmax", lambda x: x.argmax()),
    "cumsum": ("scan.cumsum", lambda x: x.cumsum(1)),
    "cummax": ("scan.cummax", lambda x: x.cummax(1)),
    "logcumsumexp": ("scan.logcumsumexp", lambda x: x.logcumsumexp(1)),
    "var": ("moment.var", lambda x: x.var(1)),
    "std_mean": ("moment.std_mean", lambda x: torch.std_mean(x, 1)),
    "norm 2": ("norm.vector_norm", lambda x: torch.linalg.vector_norm(x, 2, 1)),
    "norm 1": ("norm.vector_norm", lambda x: torch.linalg.vector_norm(x, 1, 1)),
    "norm inf": ("norm.vector_norm", lambda x: torch.linalg.vector_norm(x, inf, 1)),
    "norm -inf": ("norm.vector_norm", lambda x: torch.linalg.vector_norm(x, -inf, 1)),
    "norm 0": ("norm.vector_norm", lambda x: torch.linalg.vector_norm(x, 0, 1)),
    "norm 0.5": ("norm.vector_norm", lambda x: torch.linalg.vector_norm(x, 0.5, 1)),
    "norm all dims": ("norm.vector_norm", lambda x: torch.linalg.vector_norm(x)),
    "logsumexp": ("lse.logsumexp", lambda x: torch.logsumexp(x, 1)),
    "softmax": ("softmax.softmax", lambda x: torch.softmax(x, 1)),
    "log_softmax": ("softmax.log_softmax", lambda x: F.log_softmax(x, 1)),
    "layer_norm": ("normalize.layer_norm", lambda x: F.layer_norm(x, (x.shape[1],))),
    "rms_norm": ("normalize.rms_norm", lambda x: F.rms_norm(x, (x.shape[1],))),
    "topk": ("select.topk", lambda x: x.topk(3, 1)),
    "sort": ("select.sort", lambda x: x.sort(dim=1, stable=True)),
}


def special_rows() -> dict[str, torch.Tensor]:
    """Rows of 10 over 4 ranks (3, 3, 3, 1 per rank): the special values sit on different ranks."""
    base = torch.randn(10, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def row(**at: float) -> torch.Tensor:
        r = base.clone()
        for i, v in at.items():
            r[int(i[1:])] = v
        return r

    return {
        "nan on one rank": row(i4=nan),
        "nan on two ranks": row(i1=nan, i9=nan),
        "+inf": row(i7=inf),
        "+inf and -inf": row(i2=inf, i8=-inf),
        "-inf everywhere": torch.full((10,), -inf, dtype=torch.float64),
        "+inf everywhere": torch.full((10,), inf, dtype=torch.float64),
        "nan and inf": row(i0=inf, i5=nan),
        "ties": torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 1.0, 3.0, 0.0, 3.0], dtype=torch.float64),
    }


SPECIAL_INPUT = torch.stack(list(special_rows().values()))


# Differences from torch found here, pinned until fixed (strict: a fix makes the test fail until the entry goes).
SPECIAL_KNOWN: dict[tuple[str, str], str] = {}  # (op, layout) -> why it still differs from torch (none today)


@pytest.mark.parametrize("layout", ["S1", "S0S1", "S1S1"])
@pytest.mark.parametrize("name", sorted(SPECIAL_OPS))
def test_nan_and_inf_give_torchs_values(name, layout, request):
    mesh_shape, placements = {
        "S1": ((4,), [Shard(1)]),
        "S0S1": ((2, 2), [Shard(0), Shard(1)]),
        "S1S1": ((2, 2), [Shard(1), Shard(1)]),
    }[layout]
    if (name, layout) in SPECIAL_KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=SPECIAL_KNOWN[name, layout]))
    op_name, fn = SPECIAL_OPS[name]
    gaps = missing(OPS[op_name].needs)
    assert not gaps, f"not registered: {', '.join(gaps)}"
    want = fn(SPECIAL_INPUT)
    wants = list(want) if isinstance(want, tuple) else [want]

    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(SPECIAL_INPUT, mesh, placements)
        got = fn(x)
        return [g.full_tensor() for g in (got if isinstance(got, tuple) else [got])]

    for gots in so.run(body, 4):
        for got, w in zip(gots, wants):
            assert got.dtype == w.dtype
            tol = dict(rtol=0, atol=0) if not w.is_floating_point() else dict(rtol=1e-9, atol=1e-9)
            rows = list(special_rows())
            torch.testing.assert_close(got, w, equal_nan=True, **tol, msg=lambda m: f"{name} on rows {rows}: {m}")  # noqa: B023 - called within this iteration


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_with_masked_vocab_entries(reduction):
    """-inf logits (a masked vocabulary) on some ranks' classes: the loss and gradient of torch."""
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    logits[:, 3:6] = -inf
    logits[2, :] = -inf
    logits[2, 7] = 0.5  # a row where one class survives
    target = torch.tensor([0, 9, 7, 1])
    ref = logits.clone().requires_grad_()
    want = F.cross_entropy(ref, target, reduction=reduction)
    (want.sum()).backward()

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
        loss = F.cross_entropy(x, so.distribute_tensor(target, mesh, [Replicate()]), reduction=reduction)
        loss.full_tensor().sum().backward()
        return loss.full_tensor(), x.grad.full_tensor()

    for loss, grad in so.run(body, 4):
        torch.testing.assert_close(loss, want.detach(), equal_nan=True)
        torch.testing.assert_close(grad, ref.grad, equal_nan=True)


# ------------------------------------------------------------------ global indices: int64 everywhere


@pytest.mark.parametrize(
    "length,mesh_shape,coord,placements",
    [
        (2**40 + 3, (4,), (3,), [Shard(0)]),
        (2**53 + 1, (3,), (2,), [Shard(0)]),
        (2**62, (2, 4), (1, 3), [Shard(0), Shard(0)]),
    ],
    ids=["2^40+3 over 4", "2^53+1 over 3", "2^62 over 2x4"],
)
def test_layout_math_is_exact_for_huge_dims(length, mesh_shape, coord, placements):
    """Offsets and sizes are Python ints (no float, no int32): exact past 2^53."""
    shape, offset = local_shape_and_offset((length, 2), mesh_shape, coord, placements)
    n = math.prod(mesh_shape)
    chunk = -(-length // n)
    flat = sum(c * math.prod(mesh_shape[i + 1 :]) for i, c in enumerate(coord))
    assert offset[0] == min(flat * chunk, length)
    assert shape[0] == max(0, min(chunk, length - flat * chunk))
    positions = dim_positions(length, 0, mesh_shape, coord, placements)
    assert positions.start == offset[0] and len(positions) == shape[0]
    size, start = chunk_size_and_offset(length, n, n - 1)
    assert start + size == length


# f32 holds every integer up to 2^24 only: an index computed in float32 is off past it.
BIG = 2**24 + 8
BIG_AT = 2**24 + 5


@pytest.fixture(scope="module")
def big_vector() -> torch.Tensor:
    x = torch.zeros(BIG, dtype=torch.float32)
    x[BIG_AT] = 7.0
    return x


def test_argmax_past_float32_integer_range(big_vector):
    want_index = int(torch.argmax(big_vector))
    assert want_index == BIG_AT

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(big_vector, mesh, [Shard(0)])
        values, indices = x.max(0)
        return int(x.argmax().full_tensor()), int(indices.full_tensor()), indices.dtype

    for flat, along_dim, dtype in so.run(body, 2):
        assert flat == along_dim == want_index and dtype == torch.int64


def test_topk_indices_past_float32_integer_range(big_vector):
    want = torch.topk(big_vector, 1)

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        got = torch.topk(so.distribute_tensor(big_vector, mesh, [Shard(0)]), 1)
        return got.indices.full_tensor(), got.indices.dtype

    for indices, dtype in so.run(body, 2):
        assert torch.equal(indices, want.indices) and dtype == torch.int64


def test_vocab_parallel_cross_entropy_with_class_ids_past_float32_range(big_vector):
    logits = big_vector.unsqueeze(0)
    target = torch.tensor([BIG_AT])
    # float64: torch's own float32 log-sum-exp over 2^24 classes is off in the 4th digit here
    want = F.cross_entropy(logits.double(), target).float()
    near = F.cross_entropy(logits.double(), target + 1).float()  # what a float32 class id would pick instead
    assert not torch.allclose(want, near)

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(logits, mesh, [Shard(1)])
        return F.cross_entropy(x, target).full_tensor()

    for loss in so.run(body, 2):
        torch.testing.assert_close(loss, want)


# ------------------------------------------------------------------ a mesh this rank is not part of


def _half_mesh(size: int) -> DeviceMesh:
    return DeviceMesh("cpu", list(range(size)))  # ranks 0..size-1 of a world of 4


@pytest.mark.parametrize("mesh_size", [2, 1], ids=["2 of 4", "1 of 4"])
def test_distribute_on_a_mesh_without_this_rank_refused(mesh_size):
    def body():
        mesh = _half_mesh(mesh_size)
        rank = so.init_device_mesh("cpu", (4,)).get_rank()
        if rank < mesh_size:
            return "member"
        return outcome(
            lambda: so.distribute_tensor(torch.ones(4), mesh, [Shard(0)], src_data_rank=None if mesh_size == 1 else 0)
        )

    for rank, result in enumerate(so.run(body, 4, timeout=10)):
        if rank >= mesh_size:
            kind, message = result
            assert kind == "ShardingError" and f"rank {rank} is not part of" in message, result


def test_from_local_on_a_mesh_without_this_rank_refused():
    def body():
        mesh = _half_mesh(2)
        rank = so.init_device_mesh("cpu", (4,)).get_rank()
        if rank < 2:
            return "member"
        return outcome(lambda: so.DTensor.from_local(torch.ones(2), mesh, [Shard(0)]))

    for rank, result in enumerate(so.run(body, 4, timeout=10)):
        if rank >= 2:
            assert result[0] == "ShardingError" and f"rank {rank} is not part of" in result[1], result


def test_collective_on_a_tensor_of_a_mesh_without_this_rank_refused() -> None:
    """A rank handed another mesh's DTensor (threads world: a shared object) cannot join its collectives.

    (An op that needs no collective runs on the shard it was handed: dispatch checks membership
    only where a group is formed.)
    """
    shared: dict = {}

    def body():
        world = so.init_device_mesh("cpu", (4,))
        mesh = _half_mesh(2)
        if world.get_rank() == 0:
            shared["x"] = so.DTensor.from_local(torch.ones(2), mesh, [Shard(0)])
        world.comm.barrier(world.group(0))
        if world.get_rank() < 2:
            return "member"
        return outcome(lambda: shared["x"].full_tensor())

    for rank, result in enumerate(so.run(body, 4, timeout=10)):
        if rank >= 2:
            assert result[0] == "ShardingError" and f"rank {rank} is not part of" in result[1], result


@pytest.mark.parametrize("name", ["mul_", "fill_", "zero_"])
def test_in_place_op_on_a_tensor_sharded_along_a_size_one_dim(name):
    call = {"mul_": lambda x: x.mul_(2), "fill_": lambda x: x.fill_(3.0), "zero_": lambda x: x.zero_()}[name]
    want = call(torch.ones(1, 4))

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.ones(1, 4), mesh, [Shard(0)])
        call(x)
        return x.placements, x.full_tensor()

    for placements, value in so.run(body, 2):
        assert placements == (Shard(0),) and torch.equal(value, want)


# ------------------------------------------------------------------ failing in-place ops change nothing

IN_PLACE_FAILURES = {  # (dtype of self, the failing in-place call)
    "broadcast into self": (
        torch.float64,
        lambda x, mesh: x.add_(so.distribute_tensor(torch.ones(8, 3, dtype=x.dtype), mesh, [Shard(0)])),
    ),
    "no strategy, sharded self": (torch.float64, lambda x, mesh: x.index_fill_(0, torch.tensor([1, 5]), -1.0)),
    "shape mismatch": (torch.float64, lambda x, mesh: x.mul_(torch.ones(5, 1, dtype=x.dtype))),
    "float into int": (torch.int64, lambda x, mesh: x.add_(torch.full((8, 1), 0.5))),
}


# a replicated or pending self needs no layout change for the op without a strategy: it runs
IN_PLACE_FAILURE_CASES = [
    (name, layout)
    for name in sorted(IN_PLACE_FAILURES)
    for layout in ("S0", "R", "P")
    if name != "no strategy, sharded self" or layout == "S0"
]


@pytest.mark.parametrize("name, layout", IN_PLACE_FAILURE_CASES)
def test_failing_in_place_op_leaves_self_unchanged(name, layout):
    dtype, fn = IN_PLACE_FAILURES[name]
    full = torch.arange(8).reshape(8, 1).to(dtype)

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        rank = mesh.get_rank()
        if layout == "P":  # a pending sum: rank 0 holds the value, rank 1 zeros
            x = so.DTensor.from_local(full.clone() if rank == 0 else torch.zeros_like(full), mesh, [Partial()])
        else:
            x = so.distribute_tensor(full, mesh, [Shard(0) if layout == "S0" else Replicate()])
        before = x.placements
        result = outcome(lambda: fn(x, mesh))
        return result, before, x.placements, tuple(x.to_local().shape), x._spec.local_shape(), x.full_tensor()

    for result, before, after, local_shape, spec_shape, value in so.run(body, 2):
        assert result[0] != "ok", result
        assert result[0] in ("ShardingError", "NoShardingStrategyError", "RuntimeError", "IndexError"), result
        assert torch.equal(value, full), value
        assert local_shape == spec_shape
        # A pending partial may be resolved in place before the op fails: the same value, every alias right.
        assert after == before or (before == (Partial(),) and after == (Replicate(),)), (before, after)
