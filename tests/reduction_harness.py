"""Shared by test_reductions / test_order_stats / test_histogram: cases, layouts, and the check.

A case = (op, mesh, layout, shape). `check_case` runs the op on a DTensor laid out that way
and the same op on the full tensor with plain torch, then compares values (bitwise for
integers, bools and indices), output dtypes, gradients, and the gradient's layout (the input's,
a pending input getting Replicate).

Pending inputs are built unevenly: each rank of a Partial(sum) mesh dim holds the value plus
integer-valued noise that cancels over the mesh dim, so a rule that forgot to resolve it
cannot pass by chance.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import shardops as so
from shardops import Partial, Replicate, Shard

MESHES = {"4": (4,), "2x2": (2, 2)}
# even: every shard equal; uneven: 10 = 3+3+3+1 and 6 = 2+2+2+0 (an empty shard); tiny: 3 = 1+1+1+0, 5 = 2+2+1+0
SHAPES = {"even": (8, 4), "uneven": (10, 6), "tiny": (3, 5)}
P = Partial("sum")


@dataclass(frozen=True)
class Op:
    name: str
    fn: Callable[[Any], Any]
    data: str = "randn"  # randn | ties | nan | int | bool | pos | edges | const
    grad: bool = False
    dtype: torch.dtype = torch.float64
    partial_ok: bool = True  # Partial(sum) inputs make sense for this data
    shapes: tuple[str, ...] = tuple(SHAPES)


def layouts(mesh_shape: Sequence[int], ndim: int, partial: bool) -> list[tuple]:
    """Every layout with one placement per mesh dim from {R, S(d) for each d, P(sum)}."""
    kinds = [Replicate()] + [Shard(d) for d in range(ndim)] + ([P] if partial else [])
    out: list[tuple] = [()]
    for _ in mesh_shape:
        out = [pl + (k,) for pl in out for k in kinds]
    return out


def layout_id(pl: Sequence) -> str:
    return ",".join(map(repr, pl))


def make_data(op: Op, shape: Sequence[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if op.data == "bool":
        return torch.rand(shape, generator=g) < 0.6
    if op.data == "int":
        return torch.randint(-3, 4, shape, generator=g, dtype=op.dtype)
    if op.data in ("ties", "edges"):
        return torch.randint(-3, 4, shape, generator=g).to(op.dtype)
    if op.data == "const":
        return torch.full(shape, 2.5, dtype=op.dtype)
    if op.data == "pos":  # products stay near 1: no underflow, and a zero now and then
        x = (0.5 + torch.rand(shape, generator=g, dtype=torch.float64)).to(op.dtype)
        if x.numel() > 6:
            x.view(-1)[5] = 0
        return x
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(op.dtype)
    if op.data == "nan" and x.numel():
        mask = torch.rand(shape, generator=g) < 0.2
        x[mask] = float("nan")
    return x


def distribute(full: torch.Tensor, mesh, placements: Sequence, seed: int):
    """`full` laid out as `placements`; a Partial(sum) mesh dim splits values unevenly over its ranks."""
    base = [Replicate() if p.is_partial() else p for p in placements]
    local = so.distribute_tensor(full, mesh, base)._local_tensor.clone()
    coord = mesh.get_coordinate()
    for i, p in enumerate(placements):
        if p.is_partial():
            g = torch.Generator().manual_seed(seed + 17 * (i + 1))
            noise_full = torch.randint(-2, 3, tuple(full.shape), generator=g).to(full.dtype)
            noise = so.distribute_tensor(noise_full, mesh, base)._local_tensor
            share = local if coord[i] == 0 else torch.zeros_like(local)
            local = share + noise * (mesh.shape[i] - 1 if coord[i] == 0 else -1)
    return so.DTensor.from_local(local, mesh, list(placements), shape=tuple(full.shape))


def _outputs(out) -> list:
    return list(out) if isinstance(out, tuple) else [out]


def _loss_weights(outs: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) if o.is_floating_point() else None for o in outs]


def run_sharded(op: Op, full: torch.Tensor, mesh_shape, placements, seed: int, weights):
    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = distribute(full, mesh, placements, seed)
        if op.grad:
            x.requires_grad_()
        outs = _outputs(op.fn(x))
        fulls = [o.full_tensor() for o in outs]
        result = {"out": [f.detach() for f in fulls]}
        if op.grad:
            loss = sum((f * w).sum() for f, w in zip(fulls, weights) if w is not None)
            (grad,) = torch.autograd.grad(loss, x)  # what the op's backward returns, before AccumulateGrad's detach
            result["grad"] = grad.full_tensor()
            result["grad_layout"] = tuple(grad.placements)
        return result

    return so.run(body, len(_ranks(mesh_shape)))[0]


def _ranks(mesh_shape):
    n = 1
    for s in mesh_shape:
        n *= s
    return range(n)


def expected(op: Op, full: torch.Tensor):
    x = full.clone().requires_grad_(op.grad)
    outs = _outputs(op.fn(x))
    weights = _loss_weights(outs, 0)
    grad = None
    if op.grad:
        sum((o * w).sum() for o, w in zip(outs, weights) if w is not None).backward()
        grad = x.grad
    return [o.detach() for o in outs], weights, grad


def assert_same(actual: torch.Tensor, want: torch.Tensor, what: str, exact64: bool = True) -> None:
    """float64 to 1e-10 (when the input was float64 too), other floats to 1e-5, the rest bitwise."""
    assert actual.dtype == want.dtype, f"{what}: dtype {actual.dtype} != torch's {want.dtype}"
    assert actual.shape == want.shape, f"{what}: shape {tuple(actual.shape)} != torch's {tuple(want.shape)}"
    if want.dtype == torch.float64 and exact64:
        torch.testing.assert_close(actual, want, rtol=1e-10, atol=1e-10, equal_nan=True, msg=lambda m: f"{what}: {m}")
    elif want.is_floating_point():
        torch.testing.assert_close(actual, want, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, want), f"{what}: {actual} != torch's {want}"


def check_case(op: Op, mesh_shape, placements, shape_name: str | tuple[int, ...], seed: int = 0) -> None:
    full = make_data(op, SHAPES[shape_name] if isinstance(shape_name, str) else shape_name, seed)
    outs, weights, grad = expected(op, full)
    got = run_sharded(op, full, mesh_shape, placements, seed, weights)
    assert len(got["out"]) == len(outs)
    for k, (a, w) in enumerate(zip(got["out"], outs)):
        assert_same(a, w, f"{op.name} output {k}", exact64=full.dtype == torch.float64)
    if op.grad:
        assert_same(got["grad"], grad, f"{op.name} gradient", exact64=full.dtype == torch.float64)
        want_layout = tuple(Replicate() if p.is_partial() else p for p in placements)
        assert got["grad_layout"] == want_layout, (
            f"{op.name}: gradient layout {got['grad_layout']} != input's {want_layout}"
        )


@dataclass
class Grid:
    """Every (op, mesh, layout, shape) case, and a seeded sample of it that covers every op and layout."""

    ops: Sequence[Op]
    cases: list = field(default_factory=list)

    def __post_init__(self) -> None:
        for op in self.ops:
            for mesh_name, mesh_shape in MESHES.items():
                for shape_name in op.shapes:
                    ndim = len(SHAPES[shape_name])
                    for pl in layouts(mesh_shape, ndim, op.partial_ok):
                        self.cases.append((op, mesh_name, pl, shape_name))

    def all(self) -> list:
        return [pytest.param(*c, id=_case_id(*c)) for c in self.cases]

    def sample(self, per_op: int, seed: int = 0) -> list:
        rng = random.Random(seed)
        chosen: list = []
        for op in self.ops:
            mine = [c for c in self.cases if c[0] is op]
            chosen += rng.sample(mine, min(per_op, len(mine)))
        covered = {(c[1], layout_id(c[2])) for c in chosen}
        for c in self.cases:  # every layout on every mesh at least once
            key = (c[1], layout_id(c[2]))
            if key not in covered:
                covered.add(key)
                chosen.append(rng.choice([d for d in self.cases if (d[1], layout_id(d[2])) == key]))
        return [pytest.param(*c, id=_case_id(*c)) for c in chosen]

    def tests(self, prefix: str, *, per_op: int, seed: int) -> tuple[Callable, Callable]:
        """A family's two tests: `{prefix}_sample` (the seeded sample, in the default suite) and
        `{prefix}_grid` (every case, slow), each `check_case` on its case."""
        params = "op,mesh,layout,shape"
        sample = pytest.mark.parametrize(params, self.sample(per_op, seed))(_case_test(f"{prefix}_sample"))
        grid = pytest.mark.parametrize(params, self.all())(_case_test(f"{prefix}_grid"))
        return sample, pytest.mark.slow(grid)


def _case_test(name: str) -> Callable:
    def test(op, mesh, layout, shape):
        check_case(op, MESHES[mesh], layout, shape)

    test.__name__ = test.__qualname__ = name
    return test


def _case_id(op: Op, mesh_name: str, pl, shape_name: str) -> str:
    return f"{op.name}-mesh{mesh_name}-[{layout_id(pl)}]-{shape_name}"


def check_bad_dim_refused(call: Callable[[Any], Any], match: str) -> None:
    """`call` on a (4, 8) tensor sharded on dim 1 over 4 ranks raises a ShardingError matching
    `match` on every rank, before any collective."""

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)])
        with so.CommDebugMode() as comm:
            with pytest.raises(so.ShardingError, match=match):
                call(x)
        return comm.get_total_counts()

    assert so.run(body, 4) == [0] * 4
