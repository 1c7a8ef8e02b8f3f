"""Comparing a sharded result with torch's: within tolerance for floats, exact for everything else."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..notation import tensor_text
from ..placements import NormPartial, Partial, Placement

# NOTE: errors are |got - ref| / (1 + |ref|): relative for large values, absolute near 0.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}
MAX_SPLIT_SCALE = 8.0  # pieces mostly of grid noise (a value near 0 everywhere) loosen the tolerance no further


def split_scale(value: torch.Tensor, pieces: Sequence[torch.Tensor], p: Placement) -> float:
    """How much larger the pending pieces of `value` are than the value: sum_k |piece_k| / |value| (L1, >= 1).

    A rank's local result rounds on its own piece, and a P(sum) value reaches the ranks as signed pieces
    (samples.split_pending) whose magnitudes add up to a few times the value's: the rounding error of
    the reduced result grows with that total, not with |value|. P(avg) averages its pieces; the other
    kinds hold the value or exact powers of two on some rank, so they round as the value does.
    """
    floats = value.is_floating_point() or value.is_complex()
    if not floats or not isinstance(p, Partial) or isinstance(p, NormPartial) or p.reduce_op not in ("sum", "avg"):
        return 1.0
    kind = p.reduce_op
    total = float(sum(q.double().abs().sum() for q in pieces)) / (len(pieces) if kind == "avg" else 1)
    size = float(value.double().abs().sum())
    return min(max(total / size, 1.0), MAX_SPLIT_SCALE) if size > 0 else MAX_SPLIT_SCALE if total > 0 else 1.0


def compare(got: Any, ref: Any, tol: float) -> tuple[float, str | None]:
    """(error, problem or None). Floats: max |got-ref|/(1+|ref|), NaN/inf where torch has them; others exact."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return math.inf, f"expected a tensor, got {type(got).__name__}"
        if tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
            return math.inf, f"got {tensor_text(got)}, torch gives {tensor_text(ref)}"
        if ref.numel() == 0:
            return 0.0, None
        if not (ref.is_floating_point() or ref.is_complex()):
            bad = int((got != ref).sum())
            return (
                (0.0, None)
                if bad == 0
                else (math.inf, f"{bad} of {ref.numel()} elements differ (exact for {ref.dtype})")
            )
        return _float_error(got.detach(), ref.detach(), tol)
    if isinstance(ref, (bool, int, float, complex)):
        return (
            compare(torch.tensor(got), torch.tensor(ref), tol)
            if isinstance(got, (bool, int, float, complex))
            else (math.inf, f"got {got!r}")
        )
    return (0.0, None) if got == ref else (math.inf, f"got {got!r}, torch gives {ref!r}")


def _float_error(got: torch.Tensor, ref: torch.Tensor, tol: float) -> tuple[float, str | None]:
    wide = torch.complex128 if ref.is_complex() else torch.float64
    a, b = got.to(wide), ref.to(wide)
    if not torch.equal(a.isnan(), b.isnan()):
        return math.inf, "NaN where torch has none (or the reverse)"
    inf = b.isinf()
    if not torch.equal(a[inf], b[inf]) or bool(a[~inf].isinf().any()):
        return math.inf, "infinities differ"
    finite = ~(b.isnan() | inf)
    if not bool(finite.any()):
        return 0.0, None
    err = float(((a - b).abs() / (1 + b.abs()))[finite].max())
    return err, (None if err <= tol else f"max error {err:.2e} > tolerance {tol:.0e}")


def tie_aware(got: list[Any], ref: list[Any], inputs: list[torch.Tensor], dim: int, which: Sequence[int]) -> list[Any]:
    """sort/topk & co may order equal values differently: compare index outputs by the values they pick."""
    x = inputs[0]
    out = []
    for k, (gv, rv) in enumerate(zip(got, ref)):
        if k in which and isinstance(gv, torch.Tensor) and gv.shape == rv.shape and gv.dtype == rv.dtype and x.ndim:
            d = dim % x.ndim
            pick = lambda idx: x.take_along_dim(idx if idx.ndim == x.ndim else idx.unsqueeze(d), d)  # noqa: E731, B023 - called within this iteration
            in_range = bool(((gv >= 0) & (gv < max(x.shape[d], 1))).all())
            out.append((pick(gv) if in_range else gv, pick(rv)))
        else:
            out.append((gv, rv))
    return out


def worst_of(pairs, tol: float, what: str) -> tuple[float, str | None]:
    worst, problem = 0.0, None
    if not pairs and what:
        return 0.0, None
    for k, (got, ref) in enumerate(pairs):
        if isinstance(got, list):
            return math.inf, f"{what}: {len(got)} results, torch gives {len(ref)}"
        err, p = compare(got, ref, tol)
        worst = max(worst, err)
        if p and problem is None:
            problem = f"{what} {k}: {p}"
    return worst, problem
