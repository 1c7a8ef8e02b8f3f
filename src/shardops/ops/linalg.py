"""Linear algebra: decompositions replicate on purpose; triangles and diagonals stay sharded.

_linalg_svd, linalg_qr, _linalg_eigh, linalg_solve_triangular (qr's backward), diag
and diag_embed run replicated ON PURPOSE (registry.replicate_on_purpose: no warning,
listed as such by explain): a sharded decomposition is a different algorithm
(communication-heavy, iterative), and these ops are rare on large sharded operands.

Real rules, none of which communicates:

    tril / triu / tril_ / triu_ (self)          out
      S(b), b a batch dim        local              S(b)
      S(r) or S(c), the matrix   local mask by      same   keep (i, j) iff j - i <= diagonal
           dims                  GLOBAL (i, j)             (tril; >= for triu): exact on any shard
      P(any), NormP              local              same   zeros stay zeros under every reduction
    diagonal / diagonal_copy (self)              out
      S(b), b not dim1/dim2      local              S(b') b' = b's place among the kept dims
      P(any), NormP              local              same   a view moves values, never combines them
    diagonal_backward (grad)                     grad_input
      S(b')                      local              S(b)   zeros of this rank's shape, diagonal filled
      P(sum)                     local              P(sum) linear in grad
A matrix dim sharded under diagonal takes the implicit Replicate row: a rank's part
of the diagonal is not a torch.chunk piece of it, so it has no placement.
"""

from __future__ import annotations

import torch

from ..dispatch.registry import replicate_on_purpose, strategy
from ..dispatch.schema import OpSchema, normalize_dim
from ..placements import NormPartial, Partial, Placement, Shard, StridedShard
from ..planner.rows import Row, row
from ..spec import TensorSpec
from .common import global_index_tensor, shard_placements

aten = torch.ops.aten
PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"))
LABEL_TRIANGLE = "sharded tril/triu: mask by global row/column indices, no communication"

# decompositions (and diag, diag_embed): replicated on purpose, see the module docstring
replicate_on_purpose(
    aten._linalg_svd.default,
    aten.linalg_qr.default,
    aten._linalg_eigh.default,
    aten.linalg_solve_triangular.default,
    aten.diag.default,
    aten.diag_embed.default,
)


def _moved(p: Placement, dim: int) -> Placement:
    return StridedShard(dim, p.split_factor) if isinstance(p, StridedShard) else Shard(dim)


def _pending_rows(spec: TensorSpec, partials=PARTIALS) -> list[Row]:
    norms = sorted({p for p in spec.placements if isinstance(p, NormPartial)}, key=repr)
    return [row(p, p) for p in tuple(partials) + tuple(norms)]


# ------------------------------------------------------------------ tril / triu


def _triangle_keep(ctx, x: torch.Tensor) -> torch.Tensor:
    """Which local elements tril/triu keep, from their global row and column indices."""
    spec = ctx.in_specs[0]
    rows = global_index_tensor(spec, spec.ndim - 2, x.device)
    cols = global_index_tensor(spec, spec.ndim - 1, x.device)
    offset = cols.unsqueeze(0) - rows.unsqueeze(1)
    diagonal = ctx.schema.arg("diagonal", 0)
    return offset <= diagonal if ctx.schema.op._schema.name.startswith("aten::tril") else offset >= diagonal


def _triangle_sharded(ctx, x, *args, **kwargs):
    drop = ~_triangle_keep(ctx, x)
    return x.masked_fill_(drop, 0) if ctx.schema.is_inplace() else x.masked_fill(drop, 0)


@strategy(aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default, algorithms=[LABEL_TRIANGLE])
def _triangle_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    if spec.ndim < 2:
        return []  # torch's own error, raised by the local kernel
    rows = []
    for p in shard_placements(spec):
        if p.dim < spec.ndim - 2:
            rows.append(row(p, p))
        else:
            rows.append(row(p, p, _triangle_sharded, label=LABEL_TRIANGLE))
    return rows + _pending_rows(spec)


# ------------------------------------------------------------------ diagonal


def _diagonal_dims(schema: OpSchema, ndim: int) -> tuple[int, int]:
    d1, d2 = (
        normalize_dim(schema.arg("dim1", 0), ndim, schema.name),
        normalize_dim(schema.arg("dim2", 1), ndim, schema.name),
    )
    return d1, d2


def _kept_dims(ndim: int, d1: int, d2: int) -> list[int]:
    """Input dims that survive diagonal(), in output order (the diagonal comes last)."""
    return [d for d in range(ndim) if d not in (d1, d2)]


@strategy(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    if spec.ndim < 2:
        return []
    kept = _kept_dims(spec.ndim, *_diagonal_dims(schema, spec.ndim))
    rows = [row(_moved(p, kept.index(p.dim)), p) for p in shard_placements(spec) if p.dim in kept]
    return rows + _pending_rows(spec)


def _diagonal_backward_local(ctx, grad, input_sizes, offset, dim1, dim2):
    """diagonal_backward with this rank's input shape (the op takes the global sizes)."""
    return ctx.func(grad, list(ctx.out_specs[0].local_shape()), offset, dim1, dim2)


@strategy(aten.diagonal_backward.default)
def _diagonal_backward_rule(schema: OpSchema) -> list[Row]:
    grad = schema.tensor_specs[0]
    ndim = len(schema.arg("input_sizes"))
    kept = _kept_dims(ndim, *_diagonal_dims(schema, ndim))
    rows = []
    for p in shard_placements(grad):
        if p.dim < len(kept):
            rows.append(row(_moved(p, kept[p.dim]), p, _diagonal_backward_local))
    rows.append(row(Partial("sum"), Partial("sum"), _diagonal_backward_local))
    return rows
