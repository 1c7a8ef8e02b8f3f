"""Plain torch.Tensors meeting DTensors in one op (issue 42 item 1): torch's rule.

A plain tensor of more than one element next to a DTensor raises, naming the op (it
may hold different values on each rank: taking it as Replicate gave silently wrong
results); 0-d tensors and Python scalars are implicit Replicate; inside
`shardops.experimental.implicit_replication()` the caller vouches for equal copies.
Every result is compared with single-device torch computed here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardops as so
from shardops import Replicate, Shard
from shardops.experimental import implicit_replication
from shardops.fsdp import fully_shard, replicate
from shardops.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

MIXED = "got mixed torch.Tensor and DTensor"


def test_rank_varying_plain_tensor_at_replicate_dtensor_raises_naming_the_op():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        w = so.distribute_tensor(torch.ones(3, 3), mesh, [Replicate()])
        x = torch.full((2, 3), float(mesh.get_rank()))  # a different tensor on each rank
        return x @ w

    with pytest.raises(so.ShardingError, match=rf"aten.mm.default: {MIXED}.*DTensor.from_local") as info:
        so.run(body, 2)
    assert isinstance(info.value, RuntimeError)  # torch raises RuntimeError here


def test_a_one_rank_mesh_raises_too_as_torch_does():
    def body():
        mesh = so.init_device_mesh("cpu", (1,))
        return so.distribute_tensor(torch.ones(3), mesh, [Shard(0)]) + torch.ones(3)

    with pytest.raises(so.ShardingError, match=rf"aten.add.Tensor: {MIXED}"):
        so.run(body, 1)


def test_scalars_zero_dim_tensors_and_the_opt_in_stay_replicate():
    full = torch.arange(8.0)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(full, mesh, [Shard(0)])
        a = x * 2.0 + torch.tensor(3.0)  # a Python scalar, a 0-d tensor
        with pytest.warns(UserWarning, match="one element and ndim=1"):
            b = x + torch.tensor([1.0])  # one element, 1-d: taken as Replicate with torch's warning
        with implicit_replication():
            c = x + torch.ones(8)  # the same on every rank, vouched for
        return [t.full_tensor() for t in (a, b, c)], [t.placements for t in (a, b, c)]

    for (a, b, c), placements in so.run(body, 4):
        torch.testing.assert_close(a, full * 2 + 3)
        torch.testing.assert_close(b, full + 1)
        torch.testing.assert_close(c, full + 1)
        assert placements == [(Shard(0),)] * 3
    with implicit_replication():  # a block around so.run reaches every rank thread (a copy of the context)
        out = so.run(
            lambda: (
                so.distribute_tensor(full, so.init_device_mesh("cpu", (2,)), [Shard(0)]) + torch.ones(8)
            ).full_tensor(),
            2,
        )
    torch.testing.assert_close(out[0], full + 1)


# ------------------------------------------------------------------ the model: MHA outside the plan


class MHABlock(nn.Module):
    """An MLP (tensor-parallel in the plan) feeding nn.MultiheadAttention (outside the plan: it reads
    self.out_proj.weight itself, never calling out_proj)."""

    def __init__(self, dim: int = 8, heads: int = 2):
        super().__init__()
        torch.manual_seed(5)
        self.w1 = nn.Linear(dim, 16)
        self.w2 = nn.Linear(16, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x):
        h = self.w2(F.gelu(self.w1(x)))
        out, _ = self.attn(h, h, h, need_weights=False)
        return out


@pytest.mark.parametrize("mode", ["shard", "replicate"])
def test_multihead_attention_outside_the_plan_under_fully_shard_and_replicate_is_exact(mode):
    """Issue 40's case: MLP tensor-parallel on mesh["tp"], an nn.MultiheadAttention outside the plan
    (it reads out_proj.weight directly), then torch-style data parallelism on mesh["dp"]. Only the
    parameters are distributed: MHA gets its plain weights (gathered by fully_shard) and the local
    batch, nothing is mixed, and the dp ranks' mean loss and every gradient are single-device's."""
    g = torch.Generator().manual_seed(6)
    x, target = torch.randn(4, 5, 8, generator=g), torch.randn(4, 5, 8, generator=g)
    ref = MHABlock()
    want = F.mse_loss(ref(x), target)
    want.backward()

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = MHABlock()
        parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        if mode == "shard":
            fully_shard(model, mesh=mesh["dp"])
        else:
            replicate(model, device_mesh=mesh["dp"])
        dp = mesh.get_coordinate()[0]
        loss = F.mse_loss(model(x.chunk(2)[dp]), target.chunk(2)[dp])  # this dp rank's batch mean
        loss.backward()
        grads = {
            n: p.grad.full_tensor() if isinstance(p.grad, so.DTensor) else p.grad for n, p in model.named_parameters()
        }
        return loss.item(), grads

    so.set_strict(True)
    try:
        results = so.run(body, 4)
    finally:
        so.set_strict(False)
    assert sum(v for v, _ in results) / 4 == pytest.approx(want.item(), abs=1e-6)
    for _, grads in results:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ property: exact or a raise


def _binary(op):
    return lambda a, b: op(a, b)


OPS = {
    "add": _binary(torch.add),
    "mul": _binary(torch.mul),
    "sub": _binary(torch.sub),
    "maximum": _binary(torch.maximum),
    "where": lambda a, b: torch.where(a > 0, a, b),
    "matmul": lambda a, b: a @ b.transpose(-1, -2) if b.ndim >= 2 else a @ b,
    "cat": lambda a, b: torch.cat([a, b * torch.ones_like(a)], dim=-1),
}
MESHES = [(2,), (4,), (2, 2)]


@st.composite
def mixed_cases(draw):
    mesh = draw(st.sampled_from(MESHES))
    op = draw(st.sampled_from(sorted(OPS)))
    shape = (draw(st.integers(1, 5)), draw(st.integers(1, 4)))
    placements = tuple(draw(st.sampled_from([Replicate(), Shard(0), Shard(1)])) for _ in mesh)
    # the plain operand: 0-d, one element, or of the DTensor's shape; the same on every rank or not (a
    # one-element one that differs per rank is torch's hole too: set_debug(True) catches it, test_debug_checks)
    plain_shape = draw(st.sampled_from([(), (1,), shape, shape[1:]]))
    varies = draw(st.booleans()) and math.prod(plain_shape) != 1
    opt_in = draw(st.booleans())
    swap = draw(st.booleans()) and op not in ("matmul", "cat", "where")
    return mesh, op, shape, placements, plain_shape, varies, opt_in, swap, draw(st.integers(0, 2**16))


def _mixed_body(mesh_shape, op, shape, placements, plain_shape, varies, opt_in, swap, seed):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g, dtype=torch.float64)
    plain = torch.randn(plain_shape, generator=g, dtype=torch.float64)
    if varies:
        plain = plain + mesh.get_rank()  # rank r's own tensor: no global tensor to take it as
    x = so.distribute_tensor(full, mesh, list(placements))
    args = (plain, x) if swap else (x, plain)
    try:
        if opt_in and not varies:
            with implicit_replication():
                out = OPS[op](*args)
        else:
            out = OPS[op](*args)
    except so.ShardingError as e:
        return "raised", str(e)
    except RuntimeError as e:  # torch's own refusal of the shapes (e.g. a matmul that does not line up)
        return "torch refused", str(e)
    return "ran", out.full_tensor(), out.placements


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_cases())
def test_mixed_plain_and_dtensor_operands_are_exact_or_raise(case):
    mesh, op, shape, placements, plain_shape, varies, opt_in, swap, seed = case
    results = so.run(_mixed_body, math.prod(mesh), *case, timeout=60)
    kinds = {r[0] for r in results}
    assert len(kinds) == 1, results  # every rank decides alike
    kind = kinds.pop()
    one_element = math.prod(plain_shape) == 1
    if kind == "raised":
        assert all(MIXED in r[1] or "different" in r[1] for r in results), results[0][1]
        assert not one_element and not (opt_in and not varies), f"refused a case torch takes: {results[0][1]}"
        return
    if kind == "torch refused":
        return
    # it ran: only where the plain operand may be taken as Replicate, and then exactly torch's answer
    assert one_element or (opt_in and not varies), f"a plain operand of {plain_shape} met {placements} silently"
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g, dtype=torch.float64)
    plain = torch.randn(plain_shape, generator=g, dtype=torch.float64)
    want = OPS[op](*((plain, full) if swap else (full, plain)))
    for _, got, _ in results:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_autograds_own_constant_tensors_in_a_backward_pass_are_taken_as_replicate():
    """torch's derivative formulas build plain constants from saved shapes (index_put's zeros for values
    that need no gradient, prod's ones): they meet DTensor gradients inside backward and must pass;
    the gradients equal single-device torch's."""
    g = torch.Generator().manual_seed(3)
    full, values = (
        torch.randn(8, 6, generator=g, dtype=torch.float64),
        torch.randn(3, 6, generator=g, dtype=torch.float64),
    )
    rows = torch.tensor([1, 4, 6])
    ref = full.clone().requires_grad_()
    (ref.index_put((rows,), values).sum() + ref.prod(1).sum()).backward()

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
        index, v = (so.distribute_tensor(t, mesh, [Replicate()]) for t in (rows, values))
        (x.index_put((index,), v).sum() + x.prod(1).sum()).backward()
        return x.grad.full_tensor()

    for grad in so.run(body, 4):
        torch.testing.assert_close(grad, ref.grad)
