"""Building one case in the main thread: each rank's local pieces and the reference they resolve to.

Pending (Partial) inputs are split so that a wrong rule cannot pass by luck:

    P(sum)      rank k holds x*w_k + noise_k (dyadic weights of both signs, noise summing to 0)
    P(avg)      rank k holds x + noise_k (noise summing to 0)
    P(max/min)  per element one rank holds x, the others strictly smaller/larger values
    P(product)  per element one rank holds x / (product of the others), the others hold +-2^e
    NormP(2)    rank k holds |x| * sqrt(w_k), w_k > 0 summing to 1

Sample values sit on a dyadic grid, so these splits are exact in every dtype and
the reference input is exactly the value the pieces resolve to. The case's float
tolerance grows with how much larger the P(sum)/P(avg) pieces are than their value
(compare.split_scale): each rank rounds on its piece.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..dispatch import registry
from ..mesh import DeviceMesh
from ..placements import dim_positions
from ..spec import TensorMeta, TensorSpec, contiguous_stride
from .compare import TOLERANCE, split_scale
from .layouts import Case
from .references import Prepared, reference, seed_key
from .samples import resolve_pending, split_pending
from .targets import Target


@dataclass
class Built:
    """Everything a case needs on the ranks, made once in the main thread."""

    case: Case
    target: Target
    prep: Prepared
    specs: list[TensorSpec]
    locals: dict[int, list[torch.Tensor]]  # rank -> local tensor per operand
    ref_inputs: list[torch.Tensor]  # what the operands resolve to (the reference's inputs)
    ref_out: list[Any]
    ref_grads: list[torch.Tensor | None] | None
    grad_case: bool
    tol: float


def _local_piece(full: torch.Tensor, pieces, placements, mesh: DeviceMesh, coord) -> torch.Tensor:
    pending = [i for i, p in enumerate(placements) if p.is_partial()]
    x = full
    if pending:
        flat = 0
        for i in pending:
            flat = flat * mesh.shape[i] + coord[i]
        x = pieces[flat]
    for d in range(full.ndim):
        pos = dim_positions(full.shape[d], d, mesh.shape, coord, placements)
        x = x.narrow(d, pos[0] if len(pos) else 0, len(pos))
    return x.contiguous().clone()


def build(target: Target, prep: Prepared, case: Case, mesh: DeviceMesh, seed: int) -> Built:
    g = torch.Generator().manual_seed(seed_key(target.name, mesh.shape, case.index, seed))
    specs, per_operand, ref_inputs = [], [], []
    scale = 1.0  # the tolerance's: the largest pending pieces relative to their value (compare.split_scale)
    for t, placements in zip(prep.tensors, case.layouts):
        pending = [p for p in placements if p.is_partial()]
        m = math.prod(n for n, p in zip(mesh.shape, placements) if p.is_partial())
        pieces = split_pending(t, pending[0], m, g) if pending else None
        ref_inputs.append(resolve_pending(pieces, pending[0]) if pieces is not None else t)
        if pieces is not None:
            scale = max(scale, split_scale(ref_inputs[-1], pieces, pending[0]))
        specs.append(
            TensorSpec(mesh, tuple(placements), TensorMeta(tuple(t.shape), contiguous_stride(t.shape), t.dtype))
        )
        per_operand.append((t, pieces, placements))
    ref_out, ref_grads = prep.ref_out, prep.ref_grads
    if any(p.is_partial() for pl in case.layouts for p in pl):
        # the reference sees exactly what the pieces resolve to (NormP gives |x|; a zero's sign may flip)
        leaves = replace_tensors(prep.leaves, ref_inputs)
        ref_out, _, ref_grads = reference(target, prep.tree, leaves, prep.grad_out, None)
        ref_grads = ref_grads if prep.ref_grads is not None else None
    locals_ = {}
    for rank in range(mesh.size()):
        coord = mesh.coordinate_of(rank)
        locals_[rank] = [_local_piece(t, pieces, pl, mesh, coord) for t, pieces, pl in per_operand]
    tol = TOLERANCE.get(prep.dtype, 1e-5) * scale
    return Built(
        case,
        target,
        prep,
        specs,
        locals_,
        ref_inputs,
        ref_out,
        ref_grads,
        _checks_gradients(target, prep, case, ref_inputs, ref_grads),
        tol,
    )


def _checks_gradients(
    target: Target, prep: Prepared, case: Case, ref_inputs: Sequence[torch.Tensor], ref_grads
) -> bool:
    if ref_grads is None:
        return False
    if case.force is not None and (target.kind == "torch_function" or target.fn in registry.TORCH_FUNCTIONS):
        # An entry intercepted at the torch-function level (torch.var, or aten.dist called directly)
        # takes its own differentiable path (var through var_mean, dist through sub and a norm), which
        # would bypass the forced algorithm; the unforced cases check the gradient.
        return False
    if prep.sample.tie_outputs and _has_ties(ref_inputs[0], prep.sample.tie_dim):
        return False  # equal values: torch and a sharded top-k may pick different ones, both right
    return True


def _has_ties(x: torch.Tensor, dim: int | None) -> bool:
    if x.ndim == 0 or dim is None:
        return False
    ordered = x.sort(dim % x.ndim).values
    return bool((ordered.diff(dim=dim % x.ndim) == 0).any())


def replace_tensors(leaves: list[Any], tensors: Sequence[Any]) -> list[Any]:
    it = iter(tensors)
    return [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
