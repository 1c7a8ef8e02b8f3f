"""Moments: var, std, var_mean, std_mean (every overload: default/unbiased, dim, correction).

With reduced dims sharded, each rank computes its shard's (mean, M2) in float64, ONE
all_gather of the packed pair (one round) gives every rank all of them, and Chan's
parallel formula merges them locally. The counts never travel: every member's count
follows from the layout. A rank with count 0 contributes nothing, so uneven and empty
shards are exact:

    n = sum n_r    mean = sum n_r mean_r / n    M2 = sum M2_r + sum n_r (mean_r - mean)^2

(A single all_reduce of sum and sum of squares would be one round too, but loses every
digit for data with a large mean, e.g. 1e4 + randn in float32.) The output is Replicate
on the mesh dims that sharded reduced dims; other dims keep their shards.

Backward: torch's formula recomputes the mean over the sharded dims. The torch-level entry
points use their own autograd.Function instead, which keeps the forward's mean: the
gradient is local, grad * 2 (x - mean) / (N - correction) (std: divided by 2 std, 0 where
std is 0; the mean output adds grad / N), in the input's layout. No communication.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from ..dispatch.registry import strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema
from ..placements import Replicate, Shard
from ..planner.rows import Row, row
from ..wrapping import local_of, shard_in, spec_of
from ._shard_stats import (
    grad_local,
    input_grad,
    local_count,
    needs_grad,
    reduced_dims,
    reduction_layouts,
    reduction_stats_bytes,
    resolve_partials,
    to_layout,
    unsqueeze_reduced,
)
from .common import all_gather_stacked, global_positions, member_coordinates, mesh_dims_sharding, shift_after_reduce

aten = torch.ops.aten
R = Replicate()
STATS_BYTES_PER_ROW = 2 * 8  # (mean, M2) in float64


def _moment_params(op, bound: dict, ndim: int) -> tuple[tuple[int, ...] | None, float, bool]:
    """(reduced dims, correction, keepdim) of any var/std/var_mean/std_mean form, from bound arguments."""
    dims = reduced_dims(bound.get("dim"), ndim, str(op))
    unbiased, correction = bound.get("unbiased"), bound.get("correction")
    if correction is None:
        correction = 0 if unbiased is False else 1
    return dims, correction, bool(bound.get("keepdim", False))


def _moment_args(schema: OpSchema) -> tuple[tuple[int, ...], float, bool]:
    dims, correction, keepdim = _moment_params(schema.op, schema.bound, schema.self_spec.ndim)
    assert dims is not None  # an aten call's dims are ints
    return dims, correction, keepdim


def _base(op) -> str:
    return op._schema.name.split("::")[-1]


# ------------------------------------------------------------------ forward


def chan_merge(
    means: torch.Tensor, m2s: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge per-member (mean, M2) stacked on dim 0 with `counts` (float64, broadcastable): (n, mean, M2)."""
    n = counts.sum(0)
    mean = (counts * means).sum(0) / n
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return n, mean, m2


def _shard_stats(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's (mean, M2) over `dims`, keepdim, in float64 (zeros for an empty shard)."""
    xd = x.to(torch.float64)
    if xd.numel() == 0 or math.prod(xd.shape[d] for d in dims) == 0:
        shape = [1 if d in dims else s for d, s in enumerate(xd.shape)]
        zeros = torch.zeros(shape, dtype=torch.float64, device=x.device)
        return zeros, zeros.clone()
    mean = xd.mean(dims, keepdim=True)
    return mean, (xd - mean).square().sum(dims, keepdim=True)


def _mark_infs(x: torch.Tensor, dims: tuple[int, ...], spec, m2: torch.Tensor) -> torch.Tensor:
    """M2, with rows holding +-inf (and no NaN) marked -(2 * their inf count + 1 if this shard holds the
    row's last element and it is infinite).

    torch's Welford mean of a row holding +-inf is NaN unless the only infinity is the row's last
    element (then +-inf); its variance is NaN. A real M2 is never negative, so the marks travel in
    the same gather, at no extra byte.
    """
    if x.numel() == 0 or not x.is_floating_point():
        return m2
    infs = x.isinf().sum(dims, keepdim=True).to(torch.float64)
    holds_last = all(spec.shape[d] - 1 in global_positions(spec, d) for d in dims)
    last = x
    for d in dims:
        last = last.narrow(d, x.shape[d] - 1, 1)
    last_inf = last.isinf().to(torch.float64) if holds_last else torch.zeros_like(infs)
    marked = (infs > 0) & ~_any(x.isnan(), dims)
    return torch.where(marked, -(2 * infs + last_inf), m2)


def _any(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for d in dims:
        t = t.any(d, keepdim=True)
    return t


def _moments_sharded(ctx, x, *args, **kwargs):
    spec = ctx.in_specs[0]
    dims, correction, keepdim = _moment_args(ctx.schema)
    group = mesh_dims_sharding(spec, dims)
    mean_local, m2_local = _shard_stats(x, dims)
    means, m2s = all_gather_stacked([mean_local, _mark_infs(x, dims, spec, m2_local)], spec, group)
    marked = m2s < 0
    inf_count = torch.where(marked, torch.floor(-m2s / 2), 0.0).sum(0)
    last_inf = (torch.where(marked, torch.remainder(-m2s, 2), 0.0) > 0).any(0)
    m2s = torch.where(marked, math.nan, m2s)
    member_counts = [local_count(spec, dims, c) for c in member_coordinates(spec, group)]
    counts = torch.tensor(member_counts, dtype=torch.float64, device=x.device).reshape([-1] + [1] * x.ndim)
    _, mean, m2 = chan_merge(means, m2s, counts)
    mean = torch.where((inf_count > 1) | ((inf_count == 1) & ~last_inf), math.nan, mean)  # torch's Welford mean
    var = m2 / max(0.0, sum(member_counts) - correction)  # the count from metadata: no read of a tensor (compiles)
    if not keepdim:
        var, mean = var.squeeze(dims), mean.squeeze(dims)
    dtype = ctx.out_specs[0].dtype
    base = _base(ctx.schema.op)
    stat = (var.sqrt() if base.startswith("std") else var).to(dtype)
    if base.endswith("_mean"):
        return stat, mean.to(ctx.out_specs[1].dtype)
    return stat


# One algorithm for all four ops (var and std differentiate through var_mean/std_mean's rows): one name.
LABEL_MOMENTS = "sharded var/std (Chan merge)"
MOMENT_OPS = {
    (kind, with_mean): [
        getattr(getattr(aten, f"{kind}_mean" if with_mean else kind), ov) for ov in ("default", "dim", "correction")
    ]
    for kind in ("var", "std")
    for with_mean in (False, True)
}


@strategy(*[op for ops in MOMENT_OPS.values() for op in ops], algorithms=[LABEL_MOMENTS])
def _moments_rule(schema: OpSchema) -> list[Row]:
    """Rows: S(k) -> S(k shifted) for kept dims (local); S(k) -> R for reduced dims
    (sharded Chan merge: one all_gather of 16 bytes per output element)."""
    spec = schema.self_spec
    dims, _, keepdim = _moment_args(schema)
    rows = [row(shift_after_reduce(Shard(k), dims, keepdim), Shard(k)) for k in range(spec.ndim) if k not in dims]
    if spec.dtype.is_floating_point:
        comm = [("all_gather", reduction_stats_bytes(spec, dims, STATS_BYTES_PER_ROW))]
        rows += [row(R, Shard(k), algorithm=_moments_sharded, comm=comm, label=LABEL_MOMENTS) for k in dims]
    return rows


# ------------------------------------------------------------------ backward


def _var_input_grad(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, dof: float, every_dim: bool) -> torch.Tensor:
    """torch's var_backward: 2 (x - mean) / dof * grad; a reduction over every dim (dim=None) with
    dof <= 0 gives NaN where x equals the mean and inf elsewhere, a dim list divides as it is."""
    if every_dim and dof <= 0:
        return g * torch.where(x == mean, math.nan, math.inf).to(x.dtype)
    scale = 2.0 / dof if dof != 0 else math.inf
    return scale * g * (x - mean)


class _MomentsFunction(torch.autograd.Function):
    """var_mean / std_mean on DTensors with a local backward that reuses the forward's mean."""

    @staticmethod
    def forward(ctx, x, kind: str, dims: tuple[int, ...], correction, keepdim: bool, every_dim: bool):
        ctx.set_materialize_grads(False)
        x_in = resolve_partials(x)
        op = aten.var_mean.correction if kind == "var" else aten.std_mean.correction
        stat, mean = op(x_in, None if every_dim else list(dims), correction=correction, keepdim=keepdim)
        ctx.kind, ctx.dims, ctx.keepdim, ctx.correction, ctx.every_dim = kind, dims, keepdim, correction, every_dim
        ctx.x_spec, ctx.out_spec = spec_of(x), spec_of(stat)
        ctx.layout, ctx.out_layout = reduction_layouts(spec_of(x_in), dims, keepdim)
        ctx.x_local = shard_in(x_in, ctx.layout)
        ctx.stat_local, ctx.mean_local = local_of(stat), local_of(mean)
        ctx.count = math.prod(x.shape[d] for d in dims)
        return stat, mean

    @staticmethod
    def backward(ctx, g_stat, g_mean):
        nd = len(ctx.x_spec.shape)

        def full(t):
            return unsqueeze_reduced(t, nd, ctx.dims, ctx.keepdim)

        def small(local):  # the forward's small outputs, in the layout matching x (moved only if dispatch resharded)
            return full(to_layout(local, ctx.out_spec, ctx.out_layout))

        x = ctx.x_local
        gx = None
        if g_stat is not None:
            g = full(grad_local(g_stat, ctx.out_spec, ctx.out_layout))
            if ctx.kind == "std":
                s = small(ctx.stat_local)
                g = (g / (s * 2)).masked_fill(s == 0, 0)
            gx = _var_input_grad(g, x, small(ctx.mean_local), ctx.count - ctx.correction, ctx.every_dim)
        if g_mean is not None:
            term = full(grad_local(g_mean, ctx.out_spec, ctx.out_layout)).expand(x.shape) / ctx.count
            gx = term if gx is None else gx + term
        if gx is None:
            return None, None, None, None, None, None
        return input_grad(gx, ctx.layout, ctx.x_spec), None, None, None, None, None


# torch's forms of var/std/var_mean/std_mean, with aten's names: f(x, unbiased) and f(x, dim, unbiased, keepdim)
# or f(x, dim, *, correction, keepdim)
def _moments_unbiased(self, unbiased, *, dim=None, keepdim=False, correction=None, out=None): ...  # noqa: E704
def _moments_call(self, dim=None, unbiased=None, keepdim=False, *, correction=None, out=None): ...  # noqa: E704


_moments_unbiased.accepts = lambda args, kwargs: len(args) > 1 and type(args[1]) is bool  # type: ignore[attr-defined]  # a function attribute CallSignature reads
MOMENTS_SIGNATURE = CallSignature(_moments_unbiased, _moments_call, aliases={"input": "self"})


def _parse_moments(kind: str, name: str, b: dict, *_) -> tuple | None:
    """(input, kind, dims, correction, keepdim, every_dim) of a differentiable call; None: not ours.
    every_dim: dim was None (torch's backward treats dof <= 0 differently then)."""
    x = b["self"]
    if b.get("out") is not None or not isinstance(x, torch.Tensor) or x.ndim == 0:
        return None
    if b.get("unbiased") is not None and b.get("correction") is not None:
        return None
    dims, correction, keepdim = _moment_params(name, b, x.ndim)
    if dims is None or not x.dtype.is_floating_point or not needs_grad(x):
        return None
    return x, kind, dims, correction, keepdim, b.get("dim") is None


def _stat_only(*parsed):
    return _MomentsFunction.apply(*parsed)[0]


# ------------------------------------------------------------------ registration

for (_kind, _with_mean), _ops in MOMENT_OPS.items():
    _apply = _MomentsFunction.apply if _with_mean else _stat_only
    _name = f"{_kind}_mean" if _with_mean else _kind
    _funcs = (getattr(torch, _name),) + ((getattr(torch.Tensor, _name),) if not _with_mean else ())
    torch_level(*_funcs, signature=MOMENTS_SIGNATURE, apply=_apply)(partial(_parse_moments, _kind, "var"))
    for _op in _ops:  # torch.ops.aten.* called directly get the same backward
        torch_level(_op, apply=_apply)(partial(_parse_moments, _kind, str(_op)))
