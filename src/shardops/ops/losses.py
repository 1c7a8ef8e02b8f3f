"""Losses: nll_loss / nll_loss2d forward and backward on any layout, vocabulary parallel included.

F.cross_entropy is `_log_softmax` (ops/softmax.py: sharded over the class dim, output
S(1)) followed by these ops, so together they give vocabulary-parallel cross-entropy:
log-sum-exp statistics in one round, target picks local, loss pending as P(sum).

Rows for one mesh dim; c = class dim (1, or 0 for a 1-d input), b a batch dim of
self and b' the matching target dim. Forward inputs (self, target[, weight]):

    S(c), R, R      vocabulary parallel: a rank picks the targets whose class it owns,
                    others add 0 -> loss P(sum); total weight from the whole target
    S(c), R, S(0)   same, weight sliced like the classes -> total weight partial
    S(b), S(b'), R  batch parallel -> loss S(b') (none) or P(sum); total weight partial
    S(b), R, R      batch parallel, target sliced locally; total weight from the whole target

    loss (mean) = sum of picks / total weight: where the total weight is partial it
    is all-reduced inside (one scalar, 1 round); sum/none leave it P(sum).

Backward inputs (grad_output, self, target[, weight], total_weight): the same rows with
grad_input laid out like self; scattering -weight[t] * grad / total into the rank that
owns class t is local. A P(sum) grad_output passes through (the op is linear in it).

Rows are per mesh dim; where the runtime's crossing of them nests self's dim over several
mesh dims in a way the target or weight does not follow, the algorithm gathers that small
operand itself (see covering_placements).

Targets are checked: a value outside [0, C) that is not ignore_index raises
ShardingError naming the op (torch raises IndexError; a vocabulary-parallel rank would
otherwise silently find no owner).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.traceable import is_traced_tensor
from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..errors import ShardingError
from ..placements import Partial, Replicate, Shard
from ..planner.rows import Row, row
from ..redistribute import redistribute_local
from ..spec import TensorSpec
from .common import all_reduce, global_positions, global_range, opmath_dtype

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")
NONE, MEAN, SUM = 0, 1, 2  # torch's reduction enum

LABEL_VOCAB = "vocab-parallel nll: local target picks"
LABEL_VOCAB_WEIGHT = "vocab-parallel nll, weight sliced like the classes"
LABEL_BATCH = "batch-parallel nll"
LABEL_BATCH_REPLICATED_TARGET = "batch-parallel nll, target replicated and sliced locally"


def class_dim(ndim: int) -> int:
    return 1 if ndim >= 2 else 0


def target_dim(self_dim: int, cdim: int) -> int:
    return self_dim if self_dim < cdim else self_dim - 1


# ------------------------------------------------------------------ local layout helpers


def _take_positions(t: torch.Tensor, dim: int, have: Sequence[int], want: Sequence[int]) -> torch.Tensor:
    """The entries at global positions `want` of a local tensor holding positions `have` along `dim`."""
    if len(want) == len(have):
        return t
    if len(want) == 0:
        return t.narrow(dim, 0, 0)
    if isinstance(have, range) and isinstance(want, range):
        return t.narrow(dim, want.start - have.start, len(want))
    where = {p: i for i, p in enumerate(have)}
    return t.index_select(dim, torch.tensor([where[p] for p in want], dtype=torch.long, device=t.device))


def covering_placements(spec: TensorSpec, self_spec: TensorSpec, dim_pairs: Sequence[tuple[int, int]]) -> tuple | None:
    """Placements of `spec` under which it holds every position this rank's self holds; None if it does.

    `dim_pairs` pairs a dim of self with the matching dim of `spec` (batch dim -> target dim,
    class dim -> weight dim 0). Rows pair S(d) of self with S or R of the other operand on each
    mesh dim, which aligns, except when self nests d over several mesh dims and the operand is R
    on an earlier one but sharded on a later one: its chunk then cuts the whole dim, not self's
    sub-chunk. The runtime crosses rows per mesh dim and cannot exclude that combination, so
    the operand is gathered on those later mesh dims instead (a target or weight: small).
    """
    fixed = list(spec.placements)
    for self_dim, dim in dim_pairs:
        replicated_before = False
        for i, p in enumerate(self_spec.placements):
            if not p.is_shard(self_dim):
                continue
            if not fixed[i].is_shard(dim):
                replicated_before = True
            elif replicated_before:
                fixed[i] = R
    return tuple(fixed) if tuple(fixed) != spec.placements else None


def covering(t: torch.Tensor, spec: TensorSpec, self_spec: TensorSpec, dim_pairs) -> tuple[torch.Tensor, TensorSpec]:
    fixed = covering_placements(spec, self_spec, dim_pairs)
    if fixed is None:
        return t, spec
    return redistribute_local(t, spec, fixed), spec.with_placements(fixed)


def batch_dim_pairs(self_ndim: int) -> list[tuple[int, int]]:
    cdim = class_dim(self_ndim)
    return [(b, target_dim(b, cdim)) for b in range(self_ndim) if b != cdim]


def align_to_rows(t: torch.Tensor, t_spec: TensorSpec, self_spec: TensorSpec) -> torch.Tensor:
    """A target-shaped local tensor cut down to the rows (batch positions) this rank's self holds.

    Where the target is replicated over a mesh dim that shards a batch dim of self,
    the rank keeps only the target entries of its own rows.
    """
    pairs = batch_dim_pairs(self_spec.ndim)
    t, t_spec = covering(t, t_spec, self_spec, pairs)
    for b, tb in pairs:
        t = _take_positions(t, tb, global_positions(t_spec, tb), global_positions(self_spec, b))
    return t


def target_weights(
    t: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor | None, weight_classes: range, dtype
) -> torch.Tensor:
    """weight[t] where `mask` holds and class t lies in this rank's slice of the weight, else 0."""
    if weight is None:
        return mask.to(dtype)
    mask = mask & (t >= weight_classes.start) & (t < weight_classes.stop)
    if weight.numel() == 0:
        return torch.zeros(t.shape, dtype=dtype, device=t.device)
    w = weight.to(dtype)[torch.where(mask, t - weight_classes.start, 0)]
    return torch.where(mask, w, torch.zeros((), dtype=dtype, device=w.device))


def check_targets(op_name: str, t: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    if t.is_meta or is_traced_tensor(
        t
    ):  # metadata-only pricing (autoparallel's dry world), torch.compile: no values to check
        return
    bad = (t != ignore_index) & ((t < 0) | (t >= num_classes))
    if bool(
        bad.any()
    ):  # stays (one host read per loss): a bad target raises ShardingError; torch's CUDA kernel would device-assert
        value = int(t[bad].flatten()[0])
        raise ShardingError(
            f"{op_name}: target value {value} is out of range for {num_classes} classes; targets must lie in "
            f"[0, {num_classes}) or equal ignore_index={ignore_index}. Fix the targets (torch raises IndexError here)."
        )


class NllLayout:
    """Where this rank's pieces of an nll_loss call sit in the global problem."""

    def __init__(self, self_spec: TensorSpec, target_spec: TensorSpec, weight_spec: TensorSpec | None) -> None:
        self.self_spec = self_spec
        self.target_spec = target_spec
        self.weight_spec = weight_spec
        self.cdim = class_dim(self_spec.ndim)
        self.num_classes = self_spec.shape[self.cdim]
        self.classes = global_range(self_spec, self.cdim)
        self.weight_classes = global_range(weight_spec, 0) if weight_spec is not None else range(self.num_classes)
        # The total weight is partial over mesh dims where the target or the weight is cut.
        self.total_mesh_dims = [
            i
            for i in range(self_spec.mesh.ndim)
            if target_spec.placements[i].is_shard()
            or (weight_spec is not None and weight_spec.placements[i].is_shard())
        ]

    def owned(self, t: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Targets not ignored whose class this rank's self holds."""
        return (t != ignore_index) & (t >= self.classes.start) & (t < self.classes.stop)

    def local_class_index(self, t: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
        return torch.where(owned, t - self.classes.start, 0).unsqueeze(self.cdim)

    def weight_of_owned(self, t: torch.Tensor, owned: torch.Tensor, weight: torch.Tensor | None, dtype) -> torch.Tensor:
        """weight[t] for the targets this rank picks (0 elsewhere), from a weight slice that covers its classes."""
        if weight is None:
            return owned.to(dtype)
        assert self.weight_spec is not None  # a weight tensor has its spec
        weight, spec = covering(weight, self.weight_spec, self.self_spec, [(self.cdim, 0)])
        return target_weights(t, owned, weight, global_range(spec, 0), dtype)


def _specs(ctx, has_weight: bool, first: int) -> tuple[TensorSpec, TensorSpec, TensorSpec | None]:
    s = ctx.in_specs
    return s[first], s[first + 1], (s[first + 2] if has_weight else None)


# ------------------------------------------------------------------ forward


def _nll_forward_sharded(
    ctx, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int, ignore_index: int
):
    layout = NllLayout(*_specs(ctx, weight is not None, 0))
    dtype = x.dtype
    t_held = target.long()
    check_targets(ctx.schema.name, t_held, layout.num_classes, ignore_index)
    zero = torch.zeros((), dtype=dtype, device=x.device)
    if reduction == NONE:
        total = zero.clone()
    else:
        w_held = target_weights(t_held, t_held != ignore_index, weight, layout.weight_classes, opmath_dtype(dtype))
        total = w_held.sum()
        if reduction == MEAN:
            total = all_reduce(total, layout.self_spec, layout.total_mesh_dims, "sum")
        total = total.to(dtype)
    t = align_to_rows(t_held, layout.target_spec, layout.self_spec)
    owned = layout.owned(t, ignore_index)
    w = layout.weight_of_owned(t, owned, weight, dtype)
    if x.shape[layout.cdim] == 0:
        picked = torch.zeros(t.shape, dtype=dtype, device=x.device)
    else:
        picked = x.gather(layout.cdim, layout.local_class_index(t, owned)).squeeze(layout.cdim)
    losses = torch.where(owned, -w * picked, zero)
    if reduction == NONE:
        return losses, total
    loss = losses.sum()
    return (loss / total if reduction == MEAN else loss), total


def _check_target_dtype(schema: OpSchema, target) -> None:
    """torch's kernels take int64 or uint8 class targets only; the sharded algorithm must refuse the rest too
    (aten's meta kernel does not check, and the algorithm would happily index with an int32 target)."""
    if (
        target.dtype not in (torch.int64, torch.uint8) and not target.dtype.is_floating_point
    ):  # float: torch's meta kernel says it
        raise ShardingError(
            f"{schema.name}: expected target dtype to be Long or Byte, but got {target.dtype} (torch refuses it too); "
            "convert the target with target.long()."
        )


@strategy(
    aten.nll_loss_forward.default,
    aten.nll_loss2d_forward.default,
    algorithms=[LABEL_VOCAB, LABEL_VOCAB_WEIGHT, LABEL_BATCH, LABEL_BATCH_REPLICATED_TARGET],
)
def _nll_forward_rule(schema: OpSchema) -> list[Row]:
    x, target = schema.tensor_specs[0], schema.tensor_specs[1]
    _check_target_dtype(schema, target)
    has_weight = len(schema.tensor_specs) == 3
    reduction = schema.arg("reduction")
    cdim = class_dim(x.ndim)
    w_r = [R] if has_weight else []
    partial_total = P if reduction == SUM else R  # mean all-reduces it inside; none returns 0
    total_comm = [("all_reduce", opmath_dtype(x.dtype).itemsize)] if reduction == MEAN else []
    algo = _nll_forward_sharded
    rows = [row([P, R], [Shard(cdim), R] + w_r, algo, label=LABEL_VOCAB)]
    if has_weight:
        rows.append(
            row([P, partial_total], [Shard(cdim), R, Shard(0)], algo, comm=total_comm, label=LABEL_VOCAB_WEIGHT)
        )
    for b in range(x.ndim):
        if b == cdim:
            continue
        tb = target_dim(b, cdim)
        out = Shard(tb) if reduction == NONE else P
        rows.append(row([out, partial_total], [Shard(b), Shard(tb)] + w_r, algo, comm=total_comm, label=LABEL_BATCH))
        rows.append(row([out, R], [Shard(b), R] + w_r, algo, label=LABEL_BATCH_REPLICATED_TARGET))
    return rows


# ------------------------------------------------------------------ backward


def _nll_backward_sharded(
    ctx,
    grad: torch.Tensor,
    x: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    layout = NllLayout(*_specs(ctx, weight is not None, 1))
    dtype = x.dtype
    t = align_to_rows(target.long(), layout.target_spec, layout.self_spec)
    owned = layout.owned(t, ignore_index)
    w = layout.weight_of_owned(t, owned, weight, dtype)
    g = align_to_rows(grad, ctx.in_specs[0], layout.self_spec) if reduction == NONE else grad
    value = -w * g.to(dtype)
    if reduction == MEAN:
        value = value / total_weight.to(dtype)
    grad_input = torch.zeros(x.shape, dtype=dtype, device=x.device)
    if x.shape[layout.cdim] == 0:
        return grad_input
    value = torch.where(owned, value, torch.zeros((), dtype=dtype, device=x.device))
    return grad_input.scatter_(layout.cdim, layout.local_class_index(t, owned), value.unsqueeze(layout.cdim))


@strategy(
    aten.nll_loss_backward.default,
    aten.nll_loss2d_backward.default,
    algorithms=[LABEL_VOCAB, LABEL_VOCAB_WEIGHT, LABEL_BATCH, LABEL_BATCH_REPLICATED_TARGET],
)
def _nll_backward_rule(schema: OpSchema) -> list[Row]:
    x = schema.tensor_specs[1]
    has_weight = len(schema.tensor_specs) == 5
    reduction = schema.arg("reduction")
    cdim = class_dim(x.ndim)
    w_r = [R] if has_weight else []
    totals = [R] if reduction == MEAN else [R, P]  # sum/none never read the total weight
    algo = _nll_backward_sharded
    rows = []
    for tw in totals:
        rows.append(row(Shard(cdim), [R, Shard(cdim), R] + w_r + [tw], algo, label=LABEL_VOCAB))
        if has_weight:
            rows.append(row(Shard(cdim), [R, Shard(cdim), R, Shard(0), tw], algo, label=LABEL_VOCAB_WEIGHT))
        for b in range(x.ndim):
            if b == cdim:
                continue
            tb = target_dim(b, cdim)
            g = Shard(tb) if reduction == NONE else R
            rows.append(row(Shard(b), [g, Shard(b), Shard(tb)] + w_r + [tw], algo, label=LABEL_BATCH))
            rows.append(row(Shard(b), [g, Shard(b), R] + w_r + [tw], algo, label=LABEL_BATCH_REPLICATED_TARGET))
        # grad_input is linear in grad_output: a pending sum passes through a plain local run
        rows.append(row(P, [P, R, R] + w_r + [tw]))
    return rows


# --------------------------------------------------------------- ops F.cross_entropy dispatches that no family owns yet
# label_smoothing with a weight runs `weight.gather(0, target)` and `masked_fill_` (torch 2.13 CPU).
# NOTE: both belong elsewhere (gather with indexing ops, masked_fill_ in pointwise.py's table);
# they live here until then so that cross-entropy never gathers on their account.


def _gather_sharded(ctx, x: torch.Tensor, dim: int, index: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """self sharded along the gathered dim, index replicated: pick what this rank holds, 0 elsewhere -> P(sum)."""
    spec = ctx.in_specs[0]
    dim = dim % max(x.ndim, 1)
    held = global_range(spec, dim)
    owned = (index >= held.start) & (index < held.stop)
    if x.shape[dim] == 0:
        return torch.zeros(index.shape, dtype=x.dtype, device=x.device)
    picked = torch.gather(x, dim, torch.where(owned, index - held.start, 0))
    return torch.where(owned, picked, torch.zeros((), dtype=x.dtype, device=x.device))


LABEL_GATHER_PICK = "gather from the shard that holds the index"


@strategy(aten.gather.default, algorithms=[LABEL_GATHER_PICK])
def _gather_rule(schema: OpSchema) -> list[Row]:
    """Rows: index sharded along the gathered dim with self replicated (local); self and index
    sharded alike on another dim of equal size (local); self sharded along the gathered dim with
    the index replicated (masked local picks -> P(sum)); a pending sum of self passes through."""
    x, index = schema.tensor_specs
    dim = schema.dim("dim", ndim=x.ndim)
    # NOTE: no rows shard a dim of size <= 1: in-place pointwise ops that follow (masked_fill_)
    # have no row for such a layout and could not keep it.
    rows = [row(Shard(dim), [R, Shard(dim)])] if index.ndim and index.shape[dim] > 1 else []
    rows += [
        row(Shard(k), [Shard(k), Shard(k)])
        for k in range(min(x.ndim, index.ndim))
        if k != dim and x.shape[k] == index.shape[k] > 1
    ]
    if x.ndim and x.dtype != torch.bool:
        rows.append(row(P, [Shard(dim), R], _gather_sharded, label=LABEL_GATHER_PICK))
        rows.append(row(P, [P, R]))
    return rows
