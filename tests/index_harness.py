"""Shared by test_indexing / test_complex / test_compat: run `fn` on DTensors laid out as asked, in strict
mode, and compare values and gradients with single-device torch; report bytes per rank (forward, backward).

The backward is `y.backward(g)` with `g` laid out like `y`, so the bytes counted are the op's backward alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

import shardops as so
from shardops import Replicate, Shard
from shardops.experimental import implicit_replication

GRAD_SEED = 99


def _grad_like(y: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(GRAD_SEED)
    if y.is_complex():
        return torch.randn(y.shape, generator=g, dtype=y.dtype)
    return torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)


def reference(
    fn: Callable, tensors: Sequence[torch.Tensor], wants_grad=None
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    wants_grad = wants_grad or [True] * len(tensors)
    leaves = [t.clone().requires_grad_(_differentiable(t) and w) for t, w in zip(tensors, wants_grad)]
    y = fn(*leaves)
    grads: list[torch.Tensor | None] = [None] * len(leaves)
    if y.requires_grad:
        y.backward(_grad_like(y))
        grads = [t.grad for t in leaves]
    return y.detach(), grads


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def run_sharded(
    fn: Callable,
    tensors: Sequence[torch.Tensor],
    mesh_shape: Sequence[int],
    placements: Sequence[Sequence[Any] | None],
    *,
    strict: bool = True,
    grad: bool = True,
    wants_grad: Sequence[bool] | None = None,
) -> dict:
    """placements[k] None: tensor k (an index, a mask) is passed as a Replicate DTensor without grad, as
    torch asks of a tensor beside DTensors. `fn` runs inside implicit_replication(): the cases close over
    constant index tensors, the same on every rank."""

    def body():
        so.set_strict(strict)
        try:
            mesh = so.init_device_mesh("cpu", mesh_shape)
            args = []
            for t, pl, w in zip(tensors, placements, wants_grad or [True] * len(tensors)):
                if pl is None:
                    args.append(so.distribute_tensor(t, mesh, [Replicate()] * mesh.ndim))
                    continue
                d = so.distribute_tensor(t, mesh, list(pl))
                if grad and w and _differentiable(t):
                    d.requires_grad_()
                args.append(d)
            with so.CommDebugMode() as fwd, implicit_replication():
                y = fn(*args)
            out = dict(
                layout=tuple(y.placements),
                value=y.full_tensor().detach(),
                fwd=fwd.get_total_bytes(),
                fwd_counts=fwd.get_comm_counts(),
            )
            if grad and y.requires_grad:
                g = so.distribute_tensor(
                    _grad_like(y), mesh, [Replicate() if p.is_partial() else p for p in y.placements]
                )
                with so.CommDebugMode() as bwd, implicit_replication():  # the backward reads the saved indices
                    y.backward(g)
                out["bwd"] = bwd.get_total_bytes()
                out["grads"] = [
                    a.grad.full_tensor() if isinstance(a, so.DTensor) and a.grad is not None else None for a in args
                ]
                out["grad_layouts"] = [
                    tuple(a.grad.placements) if isinstance(a, so.DTensor) and a.grad is not None else None for a in args
                ]
            return out
        finally:
            so.set_strict(False)

    results = so.run(body, math.prod(mesh_shape))
    out = results[0]
    out["fwd"] = max(r["fwd"] for r in results)
    if "bwd" in out:
        out["bwd"] = max(r["bwd"] for r in results)
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if want.is_floating_point() or want.is_complex():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


def check(
    fn: Callable,
    tensors: Sequence[torch.Tensor],
    mesh_shape,
    placements,
    *,
    fwd_bytes=None,
    bwd_bytes=None,
    strict=True,
    grad=True,
    wants_grad=None,
) -> dict:
    """Values and gradients equal torch's; bytes per rank as asked (None: not asserted). Returns the run's record.

    wants_grad[k] False: input k is a constant (a buffer): no gradient asked for it.
    """
    want, want_grads = reference(fn, tensors, wants_grad)
    got = run_sharded(fn, tensors, mesh_shape, placements, strict=strict, grad=grad, wants_grad=wants_grad)
    assert_close(got["value"], want, "value")
    if grad and "grads" in got:
        for k, (g, w) in enumerate(zip(got["grads"], want_grads)):
            if placements[k] is not None and w is not None:
                assert g is not None, f"input {k}: no gradient"
                assert_close(g, w, f"gradient of input {k}")
    if fwd_bytes is not None:
        assert got["fwd"] == fwd_bytes, (
            f"forward moved {got['fwd']} bytes per rank, expected {fwd_bytes} ({got['fwd_counts']})"
        )
    if bwd_bytes is not None:
        assert got.get("bwd", 0) == bwd_bytes, f"backward moved {got.get('bwd')} bytes per rank, expected {bwd_bytes}"
    return got


S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
