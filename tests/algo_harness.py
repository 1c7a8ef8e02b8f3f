"""Shared by test_scans / test_moments / test_norms / test_logsumexp: run an op on one layout and
report what the sharded algorithm did (output layouts, collectives of the op alone) next to
single-device torch (values and gradients, compared with reduction_harness.assert_same).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import shardops as so
from reduction_harness import Op, assert_same, distribute, expected


def _with_links(link):
    so.set_links(link)
    yield
    so.set_links("threads")


@pytest.fixture
def latency_only_links():
    """A link model where bytes are free: every candidate costs its collectives' latency.

    On tiny shards (the ones that can be empty) moving the data costs about what moving the
    statistics does; with bytes free the tie goes to leaving the input in place, so a
    sharded algorithm that issues one collective runs on those shards.
    """
    yield from _with_links(so.Link(20e-6, 1e18))


@pytest.fixture
def bandwidth_only_links():
    """A link model where latency is free: a pending norm (a few bytes to resolve later) beats
    gathering even a tiny input, so norms stay pending on the shards that can be empty."""
    yield from _with_links(so.Link(1e-9, 1e6))


@dataclass
class Outcome:
    layouts: list[tuple]  # output placements
    nbytes: int  # bytes this rank put into collectives during the op (forward only)
    rounds: int
    counts: dict[str, int]
    grad_layout: tuple | None


def run_case(
    fn: Callable[[Any], Any],
    full: torch.Tensor,
    mesh_shape: Sequence[int],
    placements: Sequence,
    grad: bool = True,
    seed: int = 0,
) -> Outcome:
    """Run `fn` on `full` laid out as `placements`; assert values (and gradients) equal torch's."""
    op = Op("op", fn, grad=grad and full.is_floating_point())
    outs, weights, want_grad = expected(op, full)

    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = distribute(full, mesh, placements, seed)
        if op.grad:
            x.requires_grad_()
        with so.CommDebugMode() as comm:
            y = fn(x)
        ys = list(y) if isinstance(y, tuple) else [y]
        fulls = [t.full_tensor() for t in ys]
        result = dict(layouts=[tuple(t.placements) for t in ys], fulls=[f.detach() for f in fulls], comm=comm)
        if op.grad:
            sum((f * w).sum() for f, w in zip(fulls, weights) if w is not None).backward()
            result.update(grad=x.grad.full_tensor(), grad_layout=tuple(x.grad.placements))
        return result

    got = so.run(body, math.prod(mesh_shape))[0]
    exact64 = full.dtype == torch.float64
    for k, (a, w) in enumerate(zip(got["fulls"], outs)):
        assert_same(a, w, f"output {k}", exact64=exact64)
    if op.grad:
        assert_same(got["grad"], want_grad, "gradient", exact64=exact64)
    comm = got["comm"]
    return Outcome(
        got["layouts"], comm.get_total_bytes(), comm.get_rounds(), comm.get_comm_counts(), got.get("grad_layout")
    )
