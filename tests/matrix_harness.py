"""Shared by test_matrix / test_embedding / test_views_matrix: run a function of several
DTensors laid out as given, forward and backward, in strict mode; compare values and
gradients with single-device torch; report layouts and the bytes this rank moved.

Backward form: `y.backward(g)` with `g` laid out like `y` (a pending partial's gradient is
Replicate), sliced on each rank without a collective, so every byte counted is the
op's own, forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import shardops as so
from parallel_harness import strict
from shardops import Replicate

# strict mode for a whole so.run (set once, outside the rank threads, which share it)
strict_mode = strict


@dataclass
class Result:
    out_layout: tuple
    grad_layouts: list  # per input (None where no gradient)
    nbytes: int  # bytes this rank put into collectives, forward and backward
    counts: dict


def tolerance(dtype: torch.dtype) -> dict:
    if dtype == torch.bfloat16:
        return dict(rtol=2e-2, atol=4e-2)
    if dtype == torch.float16:
        return dict(rtol=5e-3, atol=1e-2)
    return dict(rtol=2e-5, atol=2e-5)


def make(shape: Sequence[int], seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def check(
    fn: Callable[..., torch.Tensor],
    fulls: Sequence[torch.Tensor],
    mesh_shape: Sequence[int],
    layouts: Sequence[Sequence[Any]],
    grads: Sequence[bool] | None = None,
    strict: bool = True,
    seed: int = 99,
) -> Result:
    grads = [t.is_floating_point() for t in fulls] if grads is None else list(grads)
    refs = [t.clone().requires_grad_(g) for t, g in zip(fulls, grads)]
    want = fn(*refs)
    upstream = make(want.shape, seed, torch.float64).to(want.dtype)
    if any(grads):
        want.backward(upstream)

    def body():
        mesh = so.init_device_mesh("cpu", tuple(mesh_shape))
        xs = [so.distribute_tensor(t, mesh, list(pl)) for t, pl in zip(fulls, layouts)]
        xs = [x.requires_grad_() if g else x for x, g in zip(xs, grads)]
        with so.CommDebugMode() as comm:
            y = fn(*xs)
            if any(grads):
                g_layout = [Replicate() if p.is_partial() else p for p in y.placements]
                y.backward(so.distribute_tensor(upstream, mesh, g_layout, src_data_rank=None))
        with torch.no_grad():
            got = [x.grad.full_tensor() if g and x.grad is not None else None for x, g in zip(xs, grads)]
            return (
                Result(
                    y.placements,
                    [x.grad.placements if g and x.grad is not None else None for x, g in zip(xs, grads)],
                    comm.get_total_bytes(),
                    dict(comm.get_comm_counts()),
                ),
                y.full_tensor(),
                got,
            )

    with strict_mode(strict):
        results = so.run(body, world_size=int(torch.tensor(mesh_shape).prod()))
    tol = tolerance(want.dtype)
    for rank, (_, out, got) in enumerate(results):
        torch.testing.assert_close(out, want.detach(), **tol, msg=lambda m: f"rank {rank} output: {m}")  # noqa: B023 - called within this iteration
        for k, (g, ref) in enumerate(zip(got, refs)):
            if ref.grad is not None:
                assert g is not None, f"rank {rank}: input {k} got no gradient"
                torch.testing.assert_close(g, ref.grad, **tol, msg=lambda m: f"rank {rank} grad of input {k}: {m}")  # noqa: B023 - called within this iteration
    return results[0][0]
