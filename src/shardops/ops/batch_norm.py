"""Batch norm (F.batch_norm / nn.BatchNorm*d) on any layout: exact against the global batch.

Semantics. A DTensor op computes what single-device torch computes on the global tensor.
For a batch-sharded input in training mode that is the statistics of the WHOLE batch (as
torch's SyncBatchNorm gives), not each rank's own batch statistics (as DDP without
SyncBatchNorm gives): the sharded algorithm gathers the per-channel statistics in one round.
A plan that wants per-rank statistics runs BatchNorm on local tensors instead.

x [N, C, *S]: statistics are per channel (dim 1), over every other dim. Rows for one mesh dim,
p = Shard(d) for a dim d != 1:

    _native_batch_norm_legit_functional (x, w?, b?, running_mean, running_var) training
                                        -> (out, mean, invstd, new_running_mean, new_running_var)
      p, R, R, R, R          all_gather per-channel (mean, M2)     p, R, R, R, R      1 round
      S(1), S(0) ...         channels sharded: local               S(1), S(0), S(0), S(0), S(0)
    _native_batch_norm_legit.no_stats: the same without running statistics
    eval (running statistics, `_native_batch_norm_legit_no_training`, or training=False):
      p, R, R, R, R          local (torch's kernel)                p, R, R, (R, R)
      S(1), S(0) ...         local                                 S(1), R, R, (S(0), S(0))
    native_batch_norm_backward (grad, x, w?, running_mean?, running_var?, save_mean?, save_invstd?)
      p, p, R ...            training: all_reduce per-channel      p, R, R            1 round
                             (sum g, sum g*xhat); eval: local      p, P(sum), P(sum)
      S(1), S(1), S(0) ...   local                                 S(1), S(0), S(0)
      P(sum), R ...          linear in grad: local                 P(sum), P(sum), P(sum)

The statistics: each rank's per-channel (mean, M2) in float64, merged by Chan's formula
(moments.chan_merge) with every member's count known from the layout, so uneven and empty
batch shards are exact; x is centred in float64 forward and backward (the backward's two
sums travel in float64 too), so data with a large mean keeps its digits. The running
statistics follow torch: momentum-weighted, with the unbiased variance M2 / (n - 1) of the
global count n.

native_batch_norm (what F.batch_norm reaches on CPU) and _native_batch_norm_legit update
the running statistics in place; on DTensors they are rewritten (registry.DECOMPOSITIONS)
into the functional op above and a `copy_` of the new statistics into the buffers, so the
buffers keep their layout whatever the planner chooses for the op. torch's CPU kernels crash
on eval mode without running statistics and on an empty batch in eval backward; here the
first raises a ShardingError and the backward uses its own formulas on every row.

Not covered: cudnn_batch_norm / miopen (GPU entries), _batch_norm_with_update and
_batch_norm_no_update (export's forms) and their batch_norm_backward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch

from ..dispatch.registry import decomposition, strategy
from ..dispatch.schema import OpSchema
from ..errors import ShardingError
from ..placements import Partial, Placement, Replicate, Shard
from ..planner.rows import Row, row
from ..spec import TensorSpec
from .common import all_gather_stacked, all_reduce, member_shapes, mesh_dims_sharding
from .moments import chan_merge

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")
S = Shard
CHANNEL = 1
F64 = 8

LABEL_BN = "sharded batch_norm: all_gather per-channel (mean, M2), 1 round"
LABEL_BN_BWD = "sharded batch_norm backward: all_reduce per-channel (sum g, sum g*xhat), 1 round"


# ------------------------------------------------------------------ shared helpers


def _stat_dims(ndim: int) -> list[int]:
    return [d for d in range(ndim) if d != CHANNEL]


def _stat_mesh_dims(spec: TensorSpec) -> tuple[int, ...]:
    """Mesh dims that shard a dim the statistics run over: the group of the statistics' round."""
    return mesh_dims_sharding(spec, _stat_dims(spec.ndim))


def _member_counts(spec: TensorSpec, mesh_dims: Sequence[int]) -> list[int]:
    """Elements per channel each member of the group holds (from the layout: never sent)."""
    return [math.prod(s[d] for d in _stat_dims(len(s))) for s in member_shapes(spec, mesh_dims)]


def _channels_per_rank(spec: TensorSpec) -> float:
    return spec.shape[CHANNEL] / spec.shard_count(CHANNEL)


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A [C] statistic shaped to broadcast over x [N, C, *S]."""
    return t.reshape((1, -1) + (1,) * (ndim - 2))


def _check_batched(schema: OpSchema, spec: TensorSpec) -> None:
    if spec.ndim < 2:
        raise ShardingError(f"{schema.name}: batch norm needs an input [N, C, ...]; got {list(spec.shape)} ({spec!r}).")


# ------------------------------------------------------------------ forward, training


def _global_stats(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel (mean, M2) over the global batch (float64) and the global count: one all_gather."""
    spec = ctx.in_specs[0]
    dims = _stat_dims(x.ndim)
    x64 = x.to(torch.float64)
    count = math.prod(x.shape[d] for d in dims)
    if count == 0:
        mean = torch.zeros(x.shape[CHANNEL], dtype=torch.float64, device=x.device)
        m2 = mean.clone()
    else:
        mean = x64.mean(dims)
        m2 = (x64 - _per_channel(mean, x.ndim)).square().sum(dims)
    group = _stat_mesh_dims(spec)
    if not group:
        return mean, m2, count
    stats = all_gather_stacked(torch.stack([mean, m2]), spec, group)  # (G, 2, C_local): one collective
    counts = _member_counts(spec, group)
    n = torch.tensor(counts, dtype=torch.float64, device=x.device).reshape(-1, 1)
    _, mean, m2 = chan_merge(stats[:, 0], stats[:, 1], n)
    return mean, m2, sum(counts)


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


@functools.cache
def _stat_dtype(
    device_type: str, dtype: torch.dtype, weight: torch.dtype | None, running: torch.dtype | None
) -> torch.dtype:
    """The dtype the device's kernel gives save_mean/save_invstd (CPU: the input's when every
    operand is of the input's half type, float32 otherwise; the meta kernel says float32 always),
    so that the sharded path returns what the local path does."""
    probe = torch.ones(2, 1, dtype=dtype, device=device_type)
    w = None if weight is None else torch.ones(1, dtype=weight, device=device_type)
    stats = (
        [None, None]
        if running is None
        else [torch.zeros(1, dtype=running, device=device_type), torch.ones(1, dtype=running, device=device_type)]
    )
    return aten.native_batch_norm.default(probe, w, None, *stats, True, 0.1, 1e-5)[1].dtype


def _batch_norm_training(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    """(out, save_mean, save_invstd, new_running_mean, new_running_var) from the global batch statistics."""
    mean, m2, n = _global_stats(ctx, x)
    invstd = torch.rsqrt(m2 / n + eps)
    scale = invstd if weight is None else invstd * weight.to(torch.float64)
    # centred in float64: x * scale + (bias - mean * scale) in the input's precision loses the
    # digits of data with a large mean (1e3 + randn in float32: 2e-4 off; torch's kernel 1e-4)
    out = (x.to(torch.float64) - _per_channel(mean, x.ndim)) * _per_channel(scale, x.ndim)
    if bias is not None:
        out = out + _per_channel(bias.to(torch.float64), x.ndim)
    out = out.to(x.dtype)
    stat_dtype = _stat_dtype(x.device.type, x.dtype, _dtype(weight), _dtype(running_mean))
    outs = [out, mean.to(stat_dtype), invstd.to(stat_dtype)]
    if running_mean is not None:
        new_mean = (1 - momentum) * running_mean.to(torch.float64) + momentum * mean
        new_var = (1 - momentum) * running_var.to(torch.float64) + momentum * (m2 / (n - 1) if n > 1 else m2 / 0.0)
        outs += [new_mean.to(running_mean.dtype), new_var.to(running_var.dtype)]
    return tuple(outs)


def _functional_training(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm_training(ctx, x, weight, bias, running_mean, running_var, momentum, eps)


def _no_stats_training(ctx, x, weight, bias, training, momentum, eps):
    return _batch_norm_training(ctx, x, weight, bias, None, None, momentum, eps)


def _forward_rows(schema: OpSchema, n_running: int, training: bool, algorithm) -> list[Row]:
    """Rows of a forward op whose tensor operands are x, weight?, bias?, then `n_running` running statistics."""
    x = schema.self_spec
    _check_batched(schema, x)
    n_affine = sum(schema.arg(a) is not None for a in ("weight", "bias"))
    n_extra = len(schema.op._schema.returns) - 3  # the functional op also returns the new running statistics
    comm = [("all_gather", 2 * F64 * _channels_per_rank(x))]
    rows = []
    for d in _stat_dims(x.ndim):
        ins = [S(d)] + [R] * (n_affine + n_running)
        if training:
            rows.append(row([S(d), R, R] + [R] * n_extra, ins, algorithm, comm=comm, label=LABEL_BN))
        else:
            rows.append(row([S(d), R, R] + [R] * n_extra, ins))
    channel_out = [S(1), R, R] if not training else [S(1), S(0), S(0)]  # eval: empty save_mean / save_invstd
    rows.append(
        row(channel_out + [S(0)] * n_extra, [S(1)] + [S(0)] * (n_affine + n_running), algorithm if training else None)
    )
    if training and n_running:
        return _keeping_running_stats(schema, rows)
    return rows


def _keeping_running_stats(schema: OpSchema, rows: list[Row]) -> list[Row]:
    """Training with running statistics: the new statistics are copied into the buffers
    (see `_batch_norm_updating`), so on a mesh dim where the buffers are Replicate or
    Shard(0) only the rows that keep them so are offered (the buffers are the module's state:
    they never move, and the copy is local). Other buffer layouts keep every row."""
    running = schema.tensor_specs[-2:]
    out = []
    for i in range(schema.mesh.ndim):
        here = {spec.placements[i] for spec in running}
        if len(here) != 1 or next(iter(here)) not in (R, S(0)):
            out += [replace(r, mesh_dim=i) for r in rows]
            continue
        keep = next(iter(here))
        out += [replace(r, mesh_dim=i) for r in rows if r.inputs[-1] == keep]
    return out


@strategy(aten._native_batch_norm_legit_functional.default, algorithms=[LABEL_BN])
def _functional_rule(schema: OpSchema) -> list[Row]:
    training = bool(schema.arg("training"))
    return _forward_rows(schema, 2, training, _functional_training)


@strategy(aten._native_batch_norm_legit.no_stats, algorithms=[LABEL_BN])
def _no_stats_rule(schema: OpSchema) -> list[Row]:
    if not schema.arg("training"):
        raise ShardingError(
            f"{schema.name}: batch norm in eval mode (training=False) needs running statistics; "
            "pass running_mean and running_var, or training=True."
        )
    return _forward_rows(schema, 0, True, _no_stats_training)


@strategy(aten._native_batch_norm_legit_no_training.default)
def _no_training_rule(schema: OpSchema) -> list[Row]:
    return _forward_rows(schema, 2, False, None)


# ------------------------------------------------------------------ the in-place forms


def _batch_norm_updating(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """native_batch_norm / _native_batch_norm_legit on DTensors: the functional op,
    then the buffers updated by copy_."""
    has_mean, has_var = running_mean is not None, running_var is not None
    if has_mean != has_var:
        raise ShardingError("batch_norm: pass both running_mean and running_var, or neither.")
    if not training:
        if not has_mean:
            raise ShardingError(
                "batch_norm in eval mode (training=False) needs running statistics; pass running_mean and "
                "running_var, or training=True."
            )
        return aten._native_batch_norm_legit_no_training.default(
            input, weight, bias, running_mean, running_var, momentum, eps
        )
    if not has_mean:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, True, momentum, eps)
    out, mean, invstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        input, weight, bias, running_mean, running_var, True, momentum, eps
    )
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, invstd


decomposition(aten.native_batch_norm.default)(_batch_norm_updating)
decomposition(aten._native_batch_norm_legit.default)(_batch_norm_updating)


# ------------------------------------------------------------------ backward


def _batch_norm_backward(
    ctx, grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask, *, reduce
):
    """d_x, d_weight, d_bias by torch's formulas; in training, the two per-channel sums over the
    global batch (one all_reduce) when d_x is wanted."""
    op = torch.float64  # xhat = (x - mean) * invstd keeps its digits for data with a large mean
    dims = _stat_dims(x.ndim)
    if train:
        mean, invstd = save_mean.to(op), save_invstd.to(op)
    else:
        mean, invstd = running_mean.to(op), torch.rsqrt(running_var.to(op) + eps)
    g = grad.to(op)
    xhat = (x.to(op) - _per_channel(mean, x.ndim)) * _per_channel(invstd, x.ndim)
    sums = torch.stack([g.sum(dims), (g * xhat).sum(dims)])
    if reduce:
        sums = all_reduce(sums, ctx.in_specs[1], _stat_mesh_dims(ctx.in_specs[1]))
    sum_g, sum_gx = sums[0], sums[1]
    scale = invstd if weight is None else invstd * weight.to(op)
    d_x = d_w = d_b = None
    if output_mask[0]:
        if train:
            n = math.prod(ctx.in_specs[1].shape[d] for d in dims)
            d_x = _per_channel(scale, x.ndim) * (
                g - _per_channel(sum_g / n, x.ndim) - xhat * _per_channel(sum_gx / n, x.ndim)
            )
        else:
            d_x = g * _per_channel(scale, x.ndim)
        d_x = d_x.to(ctx.out_specs[0].dtype)
    specs = iter(ctx.out_specs[1:] if output_mask[0] else ctx.out_specs)
    if output_mask[1]:
        d_w = sum_gx.to(next(specs).dtype)
    if output_mask[2]:
        d_b = sum_g.to(next(specs).dtype)
    return d_x, d_w, d_b


BACKWARD = {reduce: partial(_batch_norm_backward, reduce=reduce) for reduce in (True, False)}

_BACKWARD_OPTIONAL = ("weight", "running_mean", "running_var", "save_mean", "save_invstd")


@strategy(aten.native_batch_norm_backward.default, algorithms=[LABEL_BN_BWD])
def _backward_rule(schema: OpSchema) -> list[Row]:
    grad, x = schema.tensor_specs[:2]
    _check_batched(schema, x)
    mask = list(schema.arg("output_mask"))
    present = [i for i, m in enumerate(mask) if m]
    # the optional operands, in order: empty save_mean/save_invstd (eval) stay Replicate
    optional = [schema.arg(name) for name in _BACKWARD_OPTIONAL]
    per_channel = lambda p: [(p if o.shape[0] else R) for o in optional if o is not None]  # noqa: E731
    reduce = bool(schema.arg("train")) and mask[0]
    algo = BACKWARD[reduce]
    comm = [("all_reduce", 2 * F64 * _channels_per_rank(x))] if reduce else []
    sums: Placement = R if reduce else P

    def r(outs, ins, **kw) -> Row:
        return row([outs[i] for i in present], ins, algo, **kw)

    rows = [
        r([S(d), sums, sums], [S(d), S(d)] + per_channel(R), comm=comm, label=LABEL_BN_BWD if reduce else "")
        for d in _stat_dims(x.ndim)
    ]
    rows.append(r([S(1), S(0), S(0)], [S(1), S(1)] + per_channel(S(0))))
    rows.append(r([P, P, P], [P, R] + per_channel(R)))
    return rows
