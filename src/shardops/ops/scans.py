"""Scans: cumsum, cumprod, logcumsumexp, cummax, cummin.

Over a sharded dim d each rank scans its own shard; ONE all_gather of the shard totals
(the tensor with d reduced to 1) gives every rank the totals of the ranks before it,
whose fold it applies to its local scan. The output stays Shard(d):

    rank 0 [1 2 3]   rank 1 [4 5]   rank 2 []        local cumsum: [1 3 6] [4 9] []
    totals    6             9          0 (neutral)
    prefix    -             6          15            output: [1 3 6] [10 15] []

cummax/cummin carry (value, global index) totals, combined the way torch's kernel walks
the dim (the newest element wins ties and NaN wins everything), so indices are exactly
torch's, ties and NaNs included.

Over an unsharded dim the scan is local and the other dims keep their shards. cumsum is
linear: a Partial(sum) input gives a Partial(sum) output.

Backward: torch's formulas flip the scanned dim, which would move whole shards. The
torch-level entry points use their own autograd.Function whose backward is sharded too:
reverse scans = local reverse scan + exclusive suffix of the shard totals (one all_gather;
logcumsumexp packs its two reverse scans in one). cumprod's backward handles zeros exactly
(one all_gather of six per-shard numbers per row). cummax/cummin's backward scatters the
gradient to the global argmax indices; an index may sit on an earlier rank, but all the
positions of a rank that point before it point at ONE index (the prefix's), so each rank
sends one (sum of those gradients, index) pair per row: one small all_gather.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..comm.traceable import is_traced_tensor
from ..dispatch.registry import strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema, normalize_dim
from ..placements import Partial, Replicate, Shard, without_partials
from ..planner.rows import Row, row
from ..wrapping import local_of, shard_in, spec_of
from ._shard_stats import (
    ShardLine,
    first_along,
    grad_local,
    input_grad,
    last_along,
    needs_grad,
    reduction_stats_bytes,
    resolve_partials,
    shard_line,
)

aten = torch.ops.aten
R = Replicate()


# ------------------------------------------------------------------ the scan kinds


def _fold_sum(totals: torch.Tensor) -> torch.Tensor:
    return totals.sum(0)


def _fold_prod(totals: torch.Tensor) -> torch.Tensor:
    return totals.prod(0)


def _fold_logsumexp(totals: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(totals, 0)


# name -> (neutral total, fold of earlier totals, apply a prefix to a local scan, local scan)
_KINDS: dict[str, tuple[float, Callable, Callable, Callable]] = {
    "cumsum": (0, _fold_sum, torch.add, lambda t, d: t.cumsum(d)),
    "cumprod": (1, _fold_prod, torch.mul, lambda t, d: t.cumprod(d)),
    "logcumsumexp": (-math.inf, _fold_logsumexp, torch.logaddexp, lambda t, d: t.logcumsumexp(d)),
}
_FUNCTIONAL = {
    aten.cumsum.default: aten.cumsum.default,
    aten.cumsum_.default: aten.cumsum.default,
    aten.cumprod.default: aten.cumprod.default,
    aten.cumprod_.default: aten.cumprod.default,
    aten.logcumsumexp.default: aten.logcumsumexp.default,
}


def _kind_name(op) -> str:
    return op._schema.name.split("::")[-1].rstrip("_")


def _out_dtype(schema: OpSchema) -> torch.dtype:
    dtype = schema.arg("dtype")
    if dtype is not None:
        return dtype
    src = schema.self_spec.dtype
    if _kind_name(schema.op) in ("cumsum", "cumprod") and not (src.is_floating_point or src.is_complex):
        return torch.int64
    return src


# ------------------------------------------------------------------ forward: sharded algorithms


def _combine_extreme(out_v, out_i, cur_v, cur_i, newer_wins):
    """torch's cummax/cummin step: the newer element wins if it is NaN, or ties/beats a non-NaN."""
    take = torch.isnan(cur_v) | (~torch.isnan(out_v) & newer_wins(cur_v, out_v))
    return torch.where(take, cur_v, out_v), torch.where(take, cur_i, out_i)


def _exclusive_prefix(line: ShardLine, totals: torch.Tensor, fold: Callable) -> torch.Tensor | None:
    before = line.before()
    return fold(totals[before]) if before else None


def _scan_sharded(ctx, *args, **kwargs):
    """cumsum/cumprod/logcumsumexp (and in-place forms) with the scanned dim sharded."""
    op = ctx.schema.op
    neutral, fold, apply, _ = _KINDS[_kind_name(op)]
    d = ctx.schema.dim("dim")
    out = _FUNCTIONAL[op](*args, **kwargs)
    line = shard_line(ctx.in_specs[0], d)
    (totals,) = line.gather([last_along(out, d, neutral)])
    prefix = _exclusive_prefix(line, totals, fold)
    if prefix is not None:
        out = apply(out, prefix)
    if op is not _FUNCTIONAL[op]:  # in-place: self keeps its storage
        return args[0].copy_(out)
    return out


def _extreme_sharded(ctx, x, *args, **kwargs):
    """cummax/cummin with the scanned dim sharded: (value, global index) totals."""
    newer_wins = torch.ge if _kind_name(ctx.schema.op) == "cummax" else torch.le
    d = ctx.schema.dim("dim")
    values, indices = ctx.func(x, *args, **kwargs)
    line = shard_line(ctx.in_specs[0], d)
    indices = indices + line.start
    last_v, last_i = last_along(values, d, 0), last_along(indices, d, -1)
    tv, ti = line.gather([last_v, last_i])
    before = line.before()
    if before:
        pv, pi = tv[before[0]], ti[before[0]]
        for m in before[1:]:
            pv, pi = _combine_extreme(pv, pi, tv[m], ti[m], newer_wins)
        values, indices = _combine_extreme(pv, pi, values, indices, newer_wins)
    return values, indices


# ------------------------------------------------------------------ rules


@strategy(aten.cumsum.default, aten.cumsum_.default, algorithms=["sharded cumsum"])
@strategy(aten.cumprod.default, aten.cumprod_.default, algorithms=["sharded cumprod"])
@strategy(aten.logcumsumexp.default, algorithms=["sharded logcumsumexp"])
@strategy(aten.cummax.default, algorithms=["sharded cummax"])
@strategy(aten.cummin.default, algorithms=["sharded cummin"])
def _scan_rule(schema: OpSchema) -> list[Row]:
    """Rows: S(k)->S(k) for every dim (the scanned one runs the sharded algorithm); P(sum) for cumsum.

    The sharded scan issues one all_gather of the shard totals (the tensor with d reduced to 1).
    """
    spec = schema.self_spec
    if spec.ndim == 0:
        return []
    d = schema.dim("dim")
    name = _kind_name(schema.op)
    extreme = name in ("cummax", "cummin")
    if spec.dtype.is_complex and name not in ("cumsum", "cumprod"):
        return [row(Shard(k), Shard(k)) for k in range(spec.ndim) if k != d]
    per_row = spec.dtype.itemsize + 8 if extreme else _out_dtype(schema).itemsize
    comm = [("all_gather", reduction_stats_bytes(spec, (d,), per_row))]
    algo = _extreme_sharded if extreme else _scan_sharded
    rows = [row(Shard(k), Shard(k)) for k in range(spec.ndim) if k != d]
    rows.append(row(Shard(d), Shard(d), algorithm=algo, comm=comm, label=f"sharded {name}"))  # as declared above
    if name == "cumsum":
        rows += [row(Partial(op), Partial(op)) for op in ("sum", "avg")]
    return rows


# ------------------------------------------------------------------ backward: reverse scans


def _reverse_scans(values: list[torch.Tensor], kind: str, line: ShardLine) -> list[torch.Tensor]:
    """Suffix scans (sum or logsumexp) of several same-shaped tensors along the line: one all_gather."""
    neutral, fold, apply, scan = _KINDS[kind]
    d = line.dim
    local = [scan(v.flip(d), d).flip(d) for v in values]
    totals = line.gather([first_along(t, d, neutral) for t in local])
    after = line.after()
    if not after:
        return local
    return [apply(t, fold(tot[after])) for t, tot in zip(local, totals)]


def _cumsum_backward(g: torch.Tensor, line: ShardLine) -> torch.Tensor:
    return _reverse_scans([g], "cumsum", line)[0]


def _logcumsumexp_backward(g: torch.Tensor, x: torch.Tensor, y: torch.Tensor, line: ShardLine) -> torch.Tensor:
    """torch's formula: the positive and negative parts of grad in log space, reverse-scanned together."""
    lowest = torch.finfo(g.dtype).min
    log_abs = g.abs().log()
    log_pos = torch.where(g > 0, log_abs, lowest)
    log_neg = torch.where(g < 0, log_abs, lowest)
    pos, neg = _reverse_scans([log_pos - y, log_neg - y], "logcumsumexp", line)
    return (pos + x).exp() - (neg + x).exp()


def _cumprod_backward(g: torch.Tensor, x: torch.Tensor, y: torch.Tensor, line: ShardLine) -> torch.Tensor:
    """d/dx_j of sum_i g_i y_i, with k the first zero of x along d (global):

        j < k : (suffix sum of g*y)_j / x_j
        j = k : y_{k-1} * sum_{i>=k} g_i * prod_{k<l<=i} x_l
        j > k : 0

    Per shard and row: T = sum g*y; A = sum g*localcumprod(x); P = prod x; and, from the
    shard's own first zero, B = sum_{i>=z} g_i prod_{z<l<=i} x_l and Q = prod_{l>z} x_l:
    one all_gather. The owner of k adds the later shards as Q * sum_m (prod of P between) A_m.
    """
    d, n = line.dim, x.shape[line.dim]
    big = torch.iinfo(torch.int64).max
    local_pos = torch.arange(n, device=x.device).reshape([n if i == d else 1 for i in range(x.ndim)])
    is_zero = x == 0
    has_zero = is_zero.any(d, keepdim=True) if n else torch.zeros_like(last_along(x, d, 0), dtype=torch.bool)
    first = (
        torch.where(has_zero, is_zero.to(torch.uint8).argmax(d, keepdim=True), n)
        if n
        else torch.full_like(has_zero, 0, dtype=torch.int64)
    )
    w = g * y
    lcp = x.cumprod(d)
    z = torch.where(local_pos > first, x, torch.ones_like(x)).cumprod(d)
    stats = [
        w.sum(d, keepdim=True),
        (g * lcp).sum(d, keepdim=True),
        last_along(lcp, d, 1),
        (g * z * (local_pos >= first)).sum(d, keepdim=True),
        last_along(z, d, 1),
        torch.where(has_zero, first + line.start, big),
    ]
    T, A, P, B, Q, zero_at = line.gather(stats)
    k = zero_at.amin(0)
    after, before = line.after(), line.before()
    suffix = w.flip(d).cumsum(d).flip(d)
    if after:
        suffix = suffix + T[after].sum(0)
    gpos = local_pos + line.start
    dx = torch.where(gpos < k, suffix / x, torch.zeros_like(x))
    owns_k = (zero_at[line.me] == k) & (k != big)
    # eager on CPU skips the scatter when no row's first zero is here; a traced graph cannot read that,
    # and on an accelerator the read would cost a host round trip: both always scatter
    if n and (is_traced_tensor(owns_k) or owns_k.device.type != "cpu" or bool(owns_k.any())):
        later = torch.zeros_like(A[0])
        for m in reversed(after):
            later = A[m] + P[m] * later
        at = (k - line.start).clamp(0, n - 1)
        y_prev = y.gather(d, (at - 1).clamp(min=0))
        head = P[before].prod(0) if before else torch.ones_like(y_prev)
        y_prev = torch.where(at > 0, y_prev, head)
        value = y_prev * (B[line.me] + Q[line.me] * later)
        dx = dx.scatter(d, at, torch.where(owns_k, value, dx.gather(d, at)))
    return dx


def _extreme_backward(g: torch.Tensor, indices: torch.Tensor, line: ShardLine) -> torch.Tensor:
    """Scatter-add of grad at the global argmax indices, the foreign ones as one pair per rank and row."""
    d, n = line.dim, g.shape[line.dim]
    local_idx = indices - line.start
    mine = local_idx >= 0
    out = torch.zeros_like(g)
    if n:
        out.scatter_add_(d, local_idx.clamp(min=0), torch.where(mine, g, torch.zeros_like(g)))
    if not line.mesh_dims:
        return out
    foreign = torch.where(mine, torch.zeros_like(g), g).sum(d, keepdim=True)
    target = (
        torch.where(mine, -1, indices).amax(d, keepdim=True)
        if n
        else torch.full(foreign.shape, -1, dtype=torch.int64, device=g.device)
    )
    sums, targets = line.gather([foreign, target])
    if not n:
        return out
    for m in range(len(line.starts)):
        hit = (targets[m] >= line.start) & (targets[m] < line.start + n)
        out.scatter_add_(
            d, (targets[m] - line.start).clamp(0, n - 1), torch.where(hit, sums[m], torch.zeros_like(sums[m]))
        )
    return out


# ------------------------------------------------------------------ autograd entry


class _ScanFunction(torch.autograd.Function):
    """A scan on DTensors whose backward is itself sharded (no flip over a sharded dim)."""

    @staticmethod
    def forward(ctx, x, name: str, dim: int, dtype):
        ctx.set_materialize_grads(False)
        op = getattr(aten, name).default
        x_in = x if name == "cumsum" else resolve_partials(x)
        out = op(x_in, dim, dtype=dtype) if dtype is not None else op(x_in, dim)
        values = out[0] if isinstance(out, tuple) else out
        ctx.name, ctx.x_spec = name, spec_of(x)
        ctx.layout = without_partials(spec_of(values).placements)
        ctx.spec = spec_of(values).with_placements(ctx.layout)
        ctx.dim = dim % max(x.ndim, 1)
        if name in ("cumprod", "logcumsumexp"):
            # NOTE: x moves to the output's layout only in backward: the forward already paid for it
            # once inside dispatch (only where the planner resharded; normally the layouts agree).
            ctx.x_in = x_in
            ctx.y_local = local_of(values)
        if isinstance(out, tuple):
            ctx.indices = local_of(out[1])
            ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    def backward(ctx, grad, *unused):
        if grad is None:
            return None, None, None, None
        g = grad_local(grad, ctx.spec)
        line = shard_line(ctx.spec, ctx.dim)
        if ctx.name == "cumsum":
            gx = _cumsum_backward(g, line)
        elif ctx.name == "cumprod":
            x = shard_in(ctx.x_in, ctx.layout)
            gx = _cumprod_backward(g, x.to(g.dtype), ctx.y_local.to(g.dtype), line)
        elif ctx.name == "logcumsumexp":
            gx = _logcumsumexp_backward(g, shard_in(ctx.x_in, ctx.layout), ctx.y_local, line)
        else:
            gx = _extreme_backward(g, ctx.indices, line)
        return input_grad(gx, ctx.layout, ctx.x_spec), None, None, None


def _scan_call(self, dim, dtype=None, *, out=None): ...  # noqa: E704  (torch's forms, aten's names)


def _parse_scan(name: str, b: dict) -> tuple | None:
    """(input, name, dim, dtype) of a differentiable scan call; None: not ours."""
    x, dim = b["self"], b["dim"]
    if b.get("out") is not None or not isinstance(dim, int) or isinstance(dim, bool):
        return None
    normalize_dim(dim, x.ndim, name)  # a bad dim is the user's error, said before any data moves
    if not _differentiable(x) or x.ndim == 0:
        return None
    return x, name, dim, None if name in ("cummax", "cummin") else b.get("dtype")


def _differentiable(x) -> bool:
    return x.dtype.is_floating_point and needs_grad(x)


def _apply_scan(named_tuple: bool):
    def apply(x, name: str, dim: int, dtype):
        out = _ScanFunction.apply(x, name, dim, dtype)
        return getattr(torch.return_types, name)(out) if named_tuple and name in ("cummax", "cummin") else out

    return apply


# Each scan's torch entries: torch.<scan> and Tensor.<scan> (named tuples for cummax/cummin), and
# torch.ops.aten.<scan> called directly, which gets the same backward.
SCAN_SIGNATURE = CallSignature(_scan_call, aliases={"input": "self"})


def _register_scan(name: str) -> None:
    """torch.<name>, Tensor.<name> (named tuples for cummax/cummin) and aten.<name> called directly."""

    def parse(b: dict, *_) -> tuple | None:
        return _parse_scan(name, b)

    torch_level(getattr(aten, name).default, apply=_apply_scan(False))(parse)
    torch_level(getattr(torch, name), getattr(torch.Tensor, name), signature=SCAN_SIGNATURE, apply=_apply_scan(True))(
        parse
    )


for _scan in ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"):
    _register_scan(_scan)
