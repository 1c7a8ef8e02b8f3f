"""torch.compile with dynamic shapes on DTensors: a ShardingError naming the op, the symbolic value
and what to do (dynamic=False), as docs/compile.md promises; never torch's internal tracer errors
(clip_grad_norm_ under dynamic=True raised `SymFloat ... is not tracked with proxy`, issue 42 item 8)."""

from __future__ import annotations

import pytest
import torch

import shardops as so
from shardops import Shard


def _sharding_error_in(e: BaseException) -> so.ShardingError | None:
    """Dynamo reports an error raised while it runs an op on fake tensors as the cause of its own."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, so.ShardingError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _compile_error(step_of) -> list[str]:
    """Each rank's ShardingError message from compiling `step_of(mesh)` with dynamic=True
    (or what went wrong instead)."""

    def rank():
        torch._dynamo.reset()
        mesh = so.init_device_mesh("cpu", (2,))
        step, inputs = step_of(mesh)
        try:
            torch.compile(step, dynamic=True, backend="aot_eager")(*inputs)
        except Exception as e:  # noqa: BLE001 - dynamo wraps the error in its own type
            found = _sharding_error_in(e)
            return str(found) if found is not None else f"not a ShardingError: {type(e).__name__}: {e}"
        return "compiled"

    try:
        return so.run(rank, 2)
    finally:
        torch._dynamo.reset()


def _clip_and_adamw(mesh):
    torch.manual_seed(0)
    w = so.distribute_tensor(torch.randn(6, 3), mesh, [Shard(0)]).requires_grad_()
    opt = torch.optim.AdamW([w], lr=1e-2)
    x = so.distribute_tensor(torch.randn(6, 3), mesh, [Shard(0)])

    def step(x):
        opt.zero_grad()
        ((w * x) ** 2).sum().backward()
        torch.nn.utils.clip_grad_norm_([w], 1.0)
        opt.step()

    return step, (x,)


def _scaled(mesh):
    x = so.distribute_tensor(torch.randn(6, 3), mesh, [Shard(0)])
    return (lambda t, s: t * s), (x, 0.5)


@pytest.mark.parametrize(
    "case, op",
    [(_clip_and_adamw, "linalg_vector_norm"), (_scaled, "aten.mul.Tensor")],
    ids=["clip_grad_norm_adamw", "mul_scalar"],
)
def test_dynamic_shapes_raise_a_sharding_error(case, op):
    for message in _compile_error(case):
        assert message.startswith(f"torch.compile: {op} got the symbolic float"), message
        assert "dynamic=False" in message
