"""Group norm (F.group_norm / nn.GroupNorm): native_group_norm and its backward.

x [N, C, *S] is normalised per (sample, group of C/G channels) over the group's channels
and the whole plane S; mean and rstd are [N, G]. Rows for one mesh dim (d: a spatial dim):

    native_group_norm (x, weight?, bias?)                 -> (out, mean, rstd)
      batch            S(0), R, R                            S(0), S(0), S(0)
      whole groups     S(1), S(0), S(0)                      S(1), S(1), S(1)
      plane sharded    S(d), R, R                            S(d), R, R      all_gather per (sample,
                                                                             group) (mean, M2): 1 round
    native_group_norm_backward (grad, x, mean, rstd, weight?) -> (d_x, d_weight, d_bias)
      batch            S(0), S(0), S(0), S(0), R             S(0), P(sum), P(sum)
      whole groups     S(1), S(1), S(1), S(1), S(0)          S(1), S(0), S(0)
      plane sharded    S(d), S(d), R, R, R                   S(d), P(sum), P(sum)  all_reduce per
                                                                             (sample, group) of
                                                                             (sum g*w, sum g*w*xhat)
      linear in grad   P(sum), R, R, R, R                    P(sum), P(sum), P(sum)

Batch and whole-group rows are local: torch's kernel, each rank passing its own N, C and
group count (the op takes them as numbers). Channels are sharded only where every shard
holds whole groups: on mesh dims whose sizes multiply to a divisor of the group count
(convolution.whole_group_mesh_dims); other layouts with sharded channels get no row (the
planner moves the input, strict mode refuses). A sharded plane merges the per-shard
statistics (float64, Chan's formula, counts from the layout: uneven and empty shards are
exact). Every row also comes with the sharded-plane algorithm, so that a batch or group
row on one mesh dim combines with a sharded plane on another (the planner runs one
algorithm per op); torch's kernel rows come first and win their ties.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..placements import Partial, Replicate, Shard
from ..planner.rows import Row, row
from ..spec import TensorSpec
from ._local_kernel import any_empty, zero_outputs
from .common import all_gather_stacked, all_reduce, member_shapes, mesh_dims_sharding
from .convolution import whole_group_mesh_dims
from .moments import chan_merge

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")
S = Shard
F64 = 8

LABEL_GN = "sharded group_norm: all_gather per (sample, group) (mean, M2) over the plane, 1 round"
LABEL_GN_BWD = "sharded group_norm backward: all_reduce per (sample, group) (sum g*w, sum g*w*xhat), 1 round"


def _local_sizes(ctx, x: torch.Tensor, group: int) -> tuple[int, int, int]:
    """(N, C, groups) of this rank's piece."""
    channels = ctx.in_specs[1 if ctx.func is aten.native_group_norm_backward.default else 0].shape[1]
    return x.shape[0], x.shape[1], group * x.shape[1] // channels


def _group_norm_local(ctx, x, weight, bias, N, C, HxW, group, eps):
    if any_empty([x]):
        return tuple(zero_outputs(ctx, x.device))
    n, c, g = _local_sizes(ctx, x, group)
    return aten.native_group_norm.default(x, weight, bias, n, c, HxW, g, eps)


def _group_norm_backward_local(ctx, grad, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    if any_empty([grad, x]):
        zeros = iter(zero_outputs(ctx, x.device))
        return tuple(next(zeros) if m else None for m in output_mask)
    n, c, g = _local_sizes(ctx, x, group)
    return aten.native_group_norm_backward.default(grad, x, mean, rstd, weight, n, c, HxW, g, output_mask)


# ------------------------------------------------------------------ spatial dims sharded: statistics in one round


def _rows_per_rank(schema: OpSchema, x: TensorSpec) -> float:
    """(sample, group) statistics one rank holds on average (batch and whole groups as now sharded)."""
    return x.shape[0] / x.shard_count(0) * int(schema.arg("group")) / x.shard_count(1)


def _spatial_mesh_dims(spec: TensorSpec) -> tuple[int, ...]:
    return mesh_dims_sharding(spec, range(2, spec.ndim))


def _by_group(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, c, *s] as [n, groups, c / groups * prod(s)]: one row per (sample, group)."""
    return t.reshape(t.shape[0], groups, t.shape[1] // groups * math.prod(t.shape[2:]))


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.reshape((1, -1) + (1,) * (ndim - 2))


def _group_stats(ctx, x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sample, group) mean and rstd-ready M2 / count over the whole plane: one all_gather of (mean, M2)."""
    spec = ctx.in_specs[0]
    rows = _by_group(x.to(torch.float64), groups)
    count = rows.shape[-1]
    mean = rows.mean(-1) if count else torch.zeros(rows.shape[:2], dtype=torch.float64, device=x.device)
    m2 = (rows - mean.unsqueeze(-1)).square().sum(-1)
    group = _spatial_mesh_dims(spec)
    if not group:
        return mean, m2 / max(count, 1)
    stats = all_gather_stacked(torch.stack([mean, m2]), spec, group)  # (G, 2, n, groups): one collective
    per_channel = x.shape[1] // groups
    counts = [per_channel * math.prod(s[2:]) for s in member_shapes(spec, group)]
    n, mean, m2 = chan_merge(
        stats[:, 0], stats[:, 1], torch.tensor(counts, dtype=torch.float64, device=x.device).reshape(-1, 1, 1)
    )
    return mean, m2 / n


@functools.cache
def _stat_dtype(device_type: str, dtype: torch.dtype, weight: torch.dtype | None) -> torch.dtype:
    """The dtype the device's kernel gives mean/rstd (CPU: the input's when every operand is of
    the input's half type, float32 otherwise), so the sharded path returns what the local path does."""
    w = None if weight is None else torch.ones(1, dtype=weight, device=device_type)
    return aten.native_group_norm.default(
        torch.ones(1, 1, 1, dtype=dtype, device=device_type), w, None, 1, 1, 1, 1, 0.0
    )[1].dtype


def _group_norm_spatial(ctx, x, weight, bias, N, C, HxW, group, eps):
    """Group norm with the plane's spatial dims sharded: every rank merges the (mean, M2) of all pieces."""
    if x.shape[0] == 0:
        return tuple(zero_outputs(ctx, x.device))
    _, c, g = _local_sizes(ctx, x, group)
    mean, var = _group_stats(ctx, x, g)
    rstd = torch.rsqrt(var + eps)
    xhat = (_by_group(x.to(torch.float64), g) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    out = xhat.reshape(x.shape)
    if weight is not None:
        out = out * _per_channel(weight.to(torch.float64), x.ndim)
    if bias is not None:
        out = out + _per_channel(bias.to(torch.float64), x.ndim)
    stat = _stat_dtype(x.device.type, x.dtype, None if weight is None else weight.dtype)
    return out.to(x.dtype), mean.to(stat), rstd.to(stat)


def _group_norm_backward_spatial(ctx, grad, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    """d_x needs two per (sample, group) sums over the whole plane (one all_reduce); d_weight and
    d_bias are this rank's sums over its piece (pending where the batch or the plane is sharded)."""
    spec = ctx.in_specs[1]
    _, c, g = _local_sizes(ctx, x, group)
    g64 = grad.to(torch.float64)
    xhat = (
        (_by_group(x.to(torch.float64), g) - mean.to(torch.float64).unsqueeze(-1))
        * rstd.to(torch.float64).unsqueeze(-1)
    ).reshape(x.shape)
    outer = [0] + list(range(2, x.ndim))
    d_x = d_w = d_b = None
    if output_mask[0]:
        gw = g64 if weight is None else g64 * _per_channel(weight.to(torch.float64), x.ndim)
        sums = torch.stack([_by_group(gw, g).sum(-1), _by_group(gw * xhat, g).sum(-1)])
        sums = all_reduce(sums, spec, _spatial_mesh_dims(spec))
        count = c // g * math.prod(spec.shape[2:])  # elements of one (sample, group) in the whole plane
        mean_gw, mean_gwx = (sums / count).unbind(0)
        d_x = _by_group(gw, g) - mean_gw.unsqueeze(-1) - _by_group(xhat, g) * mean_gwx.unsqueeze(-1)
        d_x = (d_x * rstd.to(torch.float64).unsqueeze(-1)).reshape(x.shape).to(ctx.out_specs[0].dtype)
    specs = iter(ctx.out_specs[1:] if output_mask[0] else ctx.out_specs)
    if output_mask[1]:
        d_w = (g64 * xhat).sum(outer).to(next(specs).dtype)
    if output_mask[2]:
        d_b = g64.sum(outer).to(next(specs).dtype)
    return d_x, d_w, d_b


def _group_dims(schema: OpSchema, x) -> list[int]:
    return whole_group_mesh_dims(x, int(schema.arg("group")))


@strategy(aten.native_group_norm.default, algorithms=[LABEL_GN])
def _group_norm_rule(schema: OpSchema) -> list[Row]:
    x = schema.self_spec
    n_affine = len(schema.tensor_specs) - 1
    comm = [("all_gather", 2 * F64 * _rows_per_rank(schema, x))]
    rows = []
    for algo in (_group_norm_local, _group_norm_spatial):  # torch's kernel first: it wins their ties
        rows.append(row([S(0)] * 3, [S(0)] + [R] * n_affine, algo))
        rows += [row([S(1)] * 3, [S(1)] + [S(0)] * n_affine, algo, mesh_dim=i) for i in _group_dims(schema, x)]
    rows += [
        row([S(d), R, R], [S(d)] + [R] * n_affine, _group_norm_spatial, comm=comm, label=LABEL_GN)
        for d in range(2, x.ndim)
    ]
    return rows


@strategy(aten.native_group_norm_backward.default, algorithms=[LABEL_GN_BWD])
def _group_norm_backward_rule(schema: OpSchema) -> list[Row]:
    x = schema.tensor_specs[1]
    has_w = len(schema.tensor_specs) == 5
    present = [i for i, m in enumerate(schema.arg("output_mask")) if m]

    def r(outs, ins, algo, **kw) -> Row:
        return row([outs[i] for i in present], ins[: 4 + has_w], algo, **kw)

    rows = []
    for algo in (_group_norm_backward_local, _group_norm_backward_spatial):
        rows += [r([S(0), P, P], [S(0)] * 4 + [R], algo), r([P, P, P], [P, R, R, R, R], algo)]
        rows += [replace(r([S(1), S(0), S(0)], [S(1)] * 4 + [S(0)], algo), mesh_dim=i) for i in _group_dims(schema, x)]
    comm = [("all_reduce", 2 * F64 * _rows_per_rank(schema, x))] if schema.arg("output_mask")[0] else []
    rows += [
        r([S(d), P, P], [S(d), S(d), R, R, R], _group_norm_backward_spatial, comm=comm, label=LABEL_GN_BWD)
        for d in range(2, x.ndim)
    ]
    return rows
