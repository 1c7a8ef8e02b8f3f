"""Softmax family over any dim: _softmax, _log_softmax, _safe_softmax and their backwards.

Rows for one mesh dim (the implicit all-Replicate row competes with all of them):

    forward  (self)                       output
      S(d)  all_gather (max, sum exp)     S(d)   1 round: each rank's per-row (max, sum exp(x - max))
                                                 pair, packed in one tensor, merged locally
      S(d)  all_reduce max, all_reduce sum S(d)  2 rounds of half the bytes (wins at large meshes)
      S(e)  local, e != d                 S(e)
    backward (grad_output, output)        grad_input
      S(d), S(d)  all_reduce row sums     S(d)   sum(grad * y) (softmax) or sum(grad) (log_softmax)
      S(e), S(e)  local                   S(e)
      P(sum), R   local                   P(sum) the backward is linear in grad_output

StridedShard placements of the input get the same rows as Shard (softmax does not
care in which order a rank holds its part of a row).

Numerics: a rank whose part of a row is empty or all -inf sends the neutral pair
(max=-inf, sum=0); every exp uses a max with -inf replaced by 0, so neutral pairs
never make NaN. A row that is -inf everywhere gives NaN like torch (0 for
_safe_softmax), a row with a max of 1e4 loses nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..placements import Partial, Replicate
from ..planner.rows import Row, row
from ..spec import TensorSpec
from .common import all_gather_stacked, all_reduce, mesh_dims_sharding, opmath_dtype, shard_placements

aten = torch.ops.aten
R = Replicate()
NEG_INF = -math.inf

LABEL_GATHER = "sharded softmax: all_gather (max, sum exp) pairs, 1 round"
LABEL_TWO_REDUCES = "sharded softmax: all_reduce max, then all_reduce sum exp, 2 rounds"
LABEL_BACKWARD = "sharded softmax backward: all_reduce row sums, 1 round"


# ------------------------------------------------------------------ numerics shared with losses


def finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """The max to subtract: -inf (empty or all -inf part of a row) becomes 0, so exp(x - m) is 0, not NaN."""
    return torch.where(m == NEG_INF, torch.zeros((), dtype=m.dtype, device=m.device), m)


def local_max_sumexp(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-row (max, sum exp(x - max)), keepdim; neutral (-inf, 0) for an empty part."""
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return x.new_full(shape, NEG_INF), x.new_zeros(shape)
    m = x.amax(dim, keepdim=True)
    return m, torch.exp(x - finite_or_zero(m)).sum(dim, keepdim=True)


def merge_max_sumexp(maxes: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-rank pairs stacked on dim 0 into the row max and the row sum exp(x - max)."""
    m = maxes.amax(0)
    return m, (sums * torch.exp(maxes - finite_or_zero(m))).sum(0)


def row_max_sumexp(
    x: torch.Tensor, dim: int, spec: TensorSpec, mesh_dims: Sequence[int], two_reduces: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global per-row (max, sum exp(x - max)) over the ranks along `mesh_dims`, keepdim."""
    if two_reduces:
        m = all_reduce(
            x.amax(dim, keepdim=True) if x.shape[dim] else local_max_sumexp(x, dim)[0], spec, mesh_dims, "max"
        )
        s = torch.exp(x - finite_or_zero(m)).sum(dim, keepdim=True)
        return m, all_reduce(s, spec, mesh_dims, "sum")
    m, s = local_max_sumexp(x, dim)
    if not mesh_dims:
        return m, s
    pairs = all_gather_stacked(torch.stack([m, s]), spec, mesh_dims)  # one collective: (G, 2, *rows)
    return merge_max_sumexp(pairs[:, 0], pairs[:, 1])


def stats_numel(spec: TensorSpec, dim: int) -> int:
    """Per-row statistics one rank holds: its local shape without `dim` (coordinate 0, the largest shard).

    NOTE: a rule's rows serve every mesh dim and every combination, so the figure
    assumes the other dims keep their current sharding, which is the usual choice.
    """
    shape = list(spec.local_shape([0] * spec.mesh.ndim))
    shape[dim] = 1
    return math.prod(shape)


# ------------------------------------------------------------------ forward


def _softmax_sharded(ctx, x: torch.Tensor, *args, two_reduces: bool, kind: str, **kwargs) -> torch.Tensor:
    schema = ctx.schema
    spec = ctx.in_specs[0]
    dim = schema.dim("dim")
    out_dtype = ctx.out_specs[0].dtype
    if kind == "softmax" and schema.arg("half_to_float") and x.device.type == "cpu":
        return ctx.func(x, *args, **kwargs)  # torch's own error: no half-to-float softmax on CPU
    xo = x.to(opmath_dtype(out_dtype))
    m, s = row_max_sumexp(xo, dim, spec, mesh_dims_sharding(spec, dim), two_reduces)
    shifted = xo - finite_or_zero(m)
    if kind == "log_softmax":
        y = shifted - torch.log(s)
    else:
        y = torch.exp(shifted) / s
        if kind == "safe_softmax":  # rows that are -inf everywhere give 0, not NaN
            y = torch.where(m == NEG_INF, torch.zeros((), dtype=y.dtype, device=y.device), y)
    return y.to(out_dtype)


def _softmax_rule(kind: str):
    gather = functools.partial(_softmax_sharded, two_reduces=False, kind=kind)
    reduces = functools.partial(_softmax_sharded, two_reduces=True, kind=kind)

    def rule(schema: OpSchema) -> list[Row]:
        spec = schema.self_spec
        if spec.ndim == 0:
            return []
        dim = schema.dim("dim")
        stat_bytes = stats_numel(spec, dim) * opmath_dtype(spec.dtype).itemsize
        rows = []
        for p in shard_placements(spec):
            if p.dim != dim:
                rows.append(row(p, p))
                continue
            rows.append(row(p, p, gather, comm=[("all_gather", 2 * stat_bytes)], label=LABEL_GATHER))
            rows.append(row(p, p, reduces, comm=[("all_reduce", stat_bytes)] * 2, label=LABEL_TWO_REDUCES))
        return rows

    return rule


# ------------------------------------------------------------------ backward


def _softmax_backward_sharded(ctx, grad: torch.Tensor, y: torch.Tensor, *args, log: bool, **kwargs) -> torch.Tensor:
    spec = ctx.in_specs[0]
    dim = ctx.schema.dim("dim", ndim=spec.ndim)
    out_dtype = ctx.out_specs[0].dtype
    op_dtype = opmath_dtype(out_dtype if out_dtype.is_floating_point else grad.dtype)
    g, yo = grad.to(op_dtype), y.to(op_dtype)
    local = g.sum(dim, keepdim=True) if log else (g * yo).sum(dim, keepdim=True)
    total = all_reduce(local, spec, mesh_dims_sharding(spec, dim), "sum")
    gi = g - torch.exp(yo) * total if log else yo * (g - total)
    return gi.to(out_dtype)


def _softmax_backward_rule(log: bool):
    algorithm = functools.partial(_softmax_backward_sharded, log=log)

    def rule(schema: OpSchema) -> list[Row]:
        grad, out = schema.tensor_specs
        if out.ndim == 0:
            return []
        dim = schema.dim("dim", ndim=out.ndim)
        row_bytes = stats_numel(out, dim) * opmath_dtype(grad.dtype).itemsize
        rows = []
        for p in dict.fromkeys(shard_placements(grad) + shard_placements(out)):
            if p.dim == dim:
                rows.append(row(p, [p, p], algorithm, comm=[("all_reduce", row_bytes)], label=LABEL_BACKWARD))
            else:
                rows.append(row(p, [p, p]))
        # grad_input is linear in grad_output: a pending sum passes through
        rows.append(row(Partial("sum"), [Partial("sum"), R]))
        return rows

    return rule


# one rule per kind (the algorithm objects differ by kind: rows combine only with their own kind's)
FORWARD_ALGORITHMS = [LABEL_GATHER, LABEL_TWO_REDUCES]
strategy(aten._softmax.default, algorithms=FORWARD_ALGORITHMS)(_softmax_rule("softmax"))
strategy(aten._log_softmax.default, algorithms=FORWARD_ALGORITHMS)(_softmax_rule("log_softmax"))
strategy(aten._safe_softmax.default, algorithms=FORWARD_ALGORITHMS)(_softmax_rule("safe_softmax"))
strategy(aten._softmax_backward_data.default, algorithms=[LABEL_BACKWARD])(_softmax_backward_rule(log=False))
strategy(aten._log_softmax_backward_data.default, algorithms=[LABEL_BACKWARD])(_softmax_backward_rule(log=True))
