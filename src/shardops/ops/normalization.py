"""Layer norm and RMS norm over 1..k trailing dims, forward and backward, on any layout.

Rows for one mesh dim; p = a shard placement of input dim d (Shard or the input's own
StridedShard), axis = first normalized dim, w(p) = the same placement on weight dim
d - axis (a free local slice of a replicated weight):

    native_layer_norm (input, weight?, bias?)            -> (out, mean, rstd)
      p, R, R         d < axis: local                       p, p, p
      p, w(p), w(p)   d >= axis: all_gather (mean, M2)      p, R, R     1 round, Chan merge
    native_layer_norm_backward (grad, input, mean, rstd, weight?, bias?) -> (d_in, d_w, d_b)
      p, p, p, p, R, R          d < axis: local             p, P(sum), P(sum)
      p, p, R, R, w(p), w(p)    d >= axis: row sums         p, w(p), w(p)   1 round
                                (sum g*w, sum g*w*xhat) packed in one collective
      P(sum), R, R, R, R, R     linear in grad: local       P(sum), P(sum), P(sum)
    _fused_rms_norm (input, weight?)                     -> (out, rstd)
      p, R            d < axis: local                       p, p
      p, w(p)         d >= axis: row sums of x^2            p, R        1 round
    _fused_rms_norm_backward (grad, input, rstd, weight?) -> (d_in, d_w)
      as layer norm, with one row sum (sum g*w*xhat)

"Row sums" travel one of two ways (see HOW): all_gather + local sum, or all_reduce;
the same bytes per rank, the cost model picks (one latency chain against two).

Statistics are per-shard (mean, M2) in float64, merged by Chan's formula, so data with
a large mean (1e4 + randn) keeps its precision; each member's count comes from the
layout math, not from the wire. rms_norm sums squares in float64; backward row sums stay
in torch's opmath dtype (float32 for half types), as torch's kernels compute them.

F.rms_norm on CPU decomposes (pow / mean / add_ / rsqrt / mul) before __torch_dispatch__,
and an eager planner handles that chain's backward badly (see tests/test_normalization).
So F.rms_norm / torch.rms_norm on DTensors enter `_RMSNorm`, an autograd.Function whose
forward and backward dispatch `_fused_rms_norm` / `_fused_rms_norm_backward` through the
planner: the cost model still picks every layout. F.layer_norm reaches native_layer_norm
and its autograd formula native_layer_norm_backward by itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..dispatch.registry import strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema
from ..errors import ShardingError
from ..placements import Partial, Placement, Replicate, Shard, StridedShard, as_shard
from ..planner.rows import Row, row
from ..spec import TensorSpec
from ..tensor import dispatch
from .common import all_gather_stacked, all_reduce, member_shapes, mesh_dims_sharding, opmath_dtype, shard_placements

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")
F64 = 8  # bytes of a float64 statistic

LABEL_LN = "sharded layer_norm: all_gather per-shard (mean, M2), 1 round"
LABEL_LN_BWD = "sharded layer_norm backward: {} (sum g*w, sum g*w*xhat), 1 round"
LABEL_RMS = "sharded rms_norm: {} per-row sum of squares, 1 round"
LABEL_RMS_BWD = "sharded rms_norm backward: {} sum g*w*xhat, 1 round"
LABEL_RMS_LOCAL = "rms_norm backward, local math (no aten CPU kernel)"
# Row sums over the group travel one of two ways, both 1 round and the same bytes per
# rank: all_gather + local sum (one latency chain; what a rank receives grows with the
# group) or all_reduce (two latency chains in the ring model). The cost model picks.
HOW = {True: "all_gather + local sum", False: "all_reduce"}


# ------------------------------------------------------------------ shared helpers


def _axis(schema: OpSchema, spec: TensorSpec) -> int:
    """First normalized dim; checks normalized_shape against the input's trailing dims."""
    shape = [int(s) for s in schema.arg("normalized_shape")]
    k = len(shape)
    if k == 0 or k > spec.ndim or list(spec.shape[spec.ndim - k :]) != shape:
        raise ShardingError(
            f"{schema.name}: normalized_shape {shape} must be the trailing dims of the input "
            f"{list(spec.shape)} ({spec!r}); pass input.shape[-k:] for some k >= 1."
        )
    return spec.ndim - k


def _on_weight_dim(p: Placement, axis: int) -> Placement:
    """The placement of a normalized input dim, moved onto the weight's matching dim."""
    if isinstance(p, StridedShard):
        return StridedShard(p.dim - axis, p.split_factor)
    return Shard(as_shard(p).dim - axis)


def _rows_per_rank(spec: TensorSpec, axis: int) -> float:
    """Rows (outer elements) per rank on average: the same figure on every rank, and the
    measure the redistribution planner uses, so rows and plans compare fairly.

    NOTE: assumes the outer dims keep their current sharding, which is the usual choice.
    """
    parts = math.prod(
        n for n, p in zip(spec.mesh.shape, spec.placements) if isinstance(p, (Shard, StridedShard)) and p.dim < axis
    )
    return math.prod(spec.shape[:axis]) / parts


def _norm_mesh_dims(spec: TensorSpec, axis: int) -> tuple[int, ...]:
    return mesh_dims_sharding(spec, range(axis, spec.ndim))


def _group_sum(t: torch.Tensor, spec: TensorSpec, mesh_dims: Sequence[int], gather: bool) -> torch.Tensor:
    """Sum of `t` over the group spanning `mesh_dims`, in one collective (see HOW)."""
    if not mesh_dims:
        return t
    if gather:  # every rank adds the same pieces in the same order: bitwise equal results
        return all_gather_stacked(t, spec, mesh_dims).sum(0)
    return all_reduce(t, spec, mesh_dims, "sum")


def _sum_comm(gather: bool, nbytes: float) -> list[tuple[str, float]]:
    return [("all_gather" if gather else "all_reduce", nbytes)]


def _member_counts(spec: TensorSpec, axis: int, mesh_dims: Sequence[int]) -> list[int]:
    """Elements of one row each member of the group holds (known from the layout: never sent)."""
    return [math.prod(s[axis:]) for s in member_shapes(spec, mesh_dims)]


# ------------------------------------------------------------------ layer norm forward


def _chan_merge(means: torch.Tensor, m2s: torch.Tensor, counts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-member (mean, M2) stacked on dim 0 (float64) into the row's (mean, M2).

    Chan et al.: M2 = sum M2_i + sum n_i (mean_i - mean)^2, with mean the count-weighted mean.
    """
    n = torch.tensor(counts, dtype=torch.float64, device=means.device).reshape((-1,) + (1,) * (means.ndim - 1))
    total = max(sum(counts), 1)
    mean = (n * means).sum(0) / total
    m2 = m2s.sum(0) + (n * (means - mean) ** 2).sum(0)
    return mean, m2


def _local_mean_m2(x64: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-row (mean, M2) in float64; (0, 0) for an empty part of a row."""
    count = math.prod(x64.shape[d] for d in dims)
    mean = x64.sum(dims, keepdim=True) / max(count, 1)
    m2 = ((x64 - mean) ** 2).sum(dims, keepdim=True)
    return mean, m2


def _layer_norm_sharded(ctx, x, normalized_shape, weight, bias, eps):
    spec = ctx.in_specs[0]
    axis = x.ndim - len(normalized_shape)
    dims = tuple(range(axis, x.ndim))
    mesh_dims = _norm_mesh_dims(spec, axis)
    mean, m2 = _local_mean_m2(x.to(torch.float64), dims)
    stats = all_gather_stacked(torch.stack([mean, m2]), spec, mesh_dims)  # one collective: (G, 2, *rows)
    mean, m2 = _chan_merge(stats[:, 0], stats[:, 1], _member_counts(spec, axis, mesh_dims))
    n = math.prod(normalized_shape)
    rstd = torch.rsqrt(m2 / n + eps)
    op = opmath_dtype(x.dtype)  # half inputs: computed in float32, as torch's CPU kernel does
    y = (x.to(op) - mean.to(op)) * rstd.to(op)
    if weight is not None:
        y = y * weight.to(op)
    if bias is not None:
        y = y + bias.to(op)
    stat_dtype = _layer_norm_stat_dtype(x.device.type, x.dtype)
    return y.to(x.dtype), mean.to(stat_dtype), rstd.to(stat_dtype)


@functools.cache
def _layer_norm_stat_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the device's kernel gives mean/rstd (CPU: the input's, even for bfloat16;
    the meta kernel says float32), so the sharded path returns what the local path does."""
    probe = torch.zeros(1, 1, dtype=dtype, device=device_type)
    return aten.native_layer_norm(probe, [1], None, None, 0.0)[1].dtype


@strategy(aten.native_layer_norm.default, algorithms=[LABEL_LN])
def _layer_norm_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    axis = _axis(schema, spec)
    n_affine = sum(schema.arg(a) is not None for a in ("weight", "bias"))
    stat_bytes = 2 * F64 * _rows_per_rank(spec, axis)
    rows = []
    for p in shard_placements(spec):
        if p.dim < axis:
            rows.append(row([p, p, p], [p] + [R] * n_affine))
        else:
            wp = _on_weight_dim(p, axis)
            rows.append(
                row(
                    [p, R, R],
                    [p] + [wp] * n_affine,
                    _layer_norm_sharded,
                    comm=[("all_gather", stat_bytes)],
                    label=LABEL_LN,
                )
            )
    return rows


# ------------------------------------------------------------------ layer norm backward


def _layer_norm_backward_sharded(ctx, grad, x, normalized_shape, mean, rstd, weight, bias, output_mask, *, gather):
    spec = ctx.in_specs[1]
    axis = x.ndim - len(normalized_shape)
    mesh_dims = _norm_mesh_dims(spec, axis)
    dims, outer = tuple(range(axis, x.ndim)), tuple(range(axis))
    op = opmath_dtype(x.dtype)  # half inputs: float32 sums, as torch's CPU kernel does
    g, rstd = grad.to(op), rstd.to(op)
    xhat = (x.to(op) - mean.to(op)) * rstd
    gw = g * weight.to(op) if weight is not None else g
    d_in = d_w = d_b = None
    if output_mask[0]:
        sums = torch.stack([gw.sum(dims, keepdim=True), (gw * xhat).sum(dims, keepdim=True)])
        sums = _group_sum(sums, spec, mesh_dims, gather)  # one collective for both
        n = math.prod(normalized_shape)
        d_in = (rstd * (gw - sums[0] / n - xhat * (sums[1] / n))).to(x.dtype)
    if output_mask[1] and weight is not None:
        d_w = (g * xhat).sum(outer).to(weight.dtype) if outer else (g * xhat).to(weight.dtype)
    if output_mask[2] and bias is not None:
        d_b = g.sum(outer).to(bias.dtype) if outer else g.to(bias.dtype)
    return d_in, d_w, d_b


def _grad_outputs(mask: Sequence[bool], present: Sequence[bool]) -> list[int]:
    """Which of the op's outputs are tensors (torch returns None for masked-off gradients)."""
    return [i for i, (m, has) in enumerate(zip(mask, present)) if m and has]


@strategy(aten.native_layer_norm_backward.default, algorithms=[LABEL_LN_BWD.format(how) for how in HOW.values()])
def _layer_norm_backward_rule(schema: OpSchema) -> list[Row]:
    grad, spec = schema.tensor_specs[0], schema.tensor_specs[1]
    axis = _axis(schema, spec)
    has_w, has_b = schema.arg("weight") is not None, schema.arg("bias") is not None
    mask = list(schema.arg("output_mask"))
    outs = _grad_outputs(mask, [True, has_w, has_b])
    n_affine = int(has_w) + int(has_b)
    sum_bytes = 2 * opmath_dtype(spec.dtype).itemsize * _rows_per_rank(spec, axis)
    rows = []
    for p in dict.fromkeys(shard_placements(grad) + shard_placements(spec)):
        if p.dim < axis:  # whole rows on this rank: torch's own kernel (redistributed shards arrive contiguous)
            rows.append(row([[p, P, P][i] for i in outs], [p, p, p, p] + [R] * n_affine))
            continue
        wp = _on_weight_dim(p, axis)
        for gather, algo in LN_BACKWARD.items():
            comm = _sum_comm(gather, sum_bytes) if mask[0] else []
            rows.append(
                row(
                    [[p, wp, wp][i] for i in outs],
                    [p, p, R, R] + [wp] * n_affine,
                    algo,
                    comm=comm,
                    label=LABEL_LN_BWD.format(HOW[gather]),
                )
            )
    # every gradient is linear in grad_out: a pending sum passes through
    rows.append(row([P] * len(outs), [P, R, R, R] + [R] * n_affine))
    return rows


# ------------------------------------------------------------------ rms norm forward


def _rms_eps(eps: float | None, dtype: torch.dtype) -> float:
    """torch's default: the machine epsilon of the computation dtype."""
    if eps is not None:
        return eps
    return torch.finfo(torch.float32 if opmath_dtype(dtype) == torch.float32 else torch.float64).eps


def _rms_norm_sharded(ctx, x, normalized_shape, weight, eps, *, gather):
    spec = ctx.in_specs[0]
    axis = x.ndim - len(normalized_shape)
    dims = tuple(range(axis, x.ndim))
    sumsq = (x.to(torch.float64) ** 2).sum(dims, keepdim=True)
    sumsq = _group_sum(sumsq, spec, _norm_mesh_dims(spec, axis), gather)
    op = ctx.out_specs[1].dtype
    rstd = torch.rsqrt(sumsq / math.prod(normalized_shape) + _rms_eps(eps, x.dtype)).to(op)
    y = x.to(op) * rstd
    if weight is not None:
        y = y * weight
    return y.to(x.dtype), rstd


@strategy(aten._fused_rms_norm.default, algorithms=[LABEL_RMS.format(how) for how in HOW.values()])
def _rms_norm_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    axis = _axis(schema, spec)
    has_w = schema.arg("weight") is not None
    sum_bytes = F64 * _rows_per_rank(spec, axis)
    rows = []
    for p in shard_placements(spec):
        if p.dim < axis:
            rows.append(row([p, p], [p] + [R] * has_w))
        else:
            wp = _on_weight_dim(p, axis)
            for gather, algo in RMS_FORWARD.items():
                rows.append(
                    row(
                        [p, R],
                        [p] + [wp] * has_w,
                        algo,
                        comm=_sum_comm(gather, sum_bytes),
                        label=LABEL_RMS.format(HOW[gather]),
                    )
                )
    return rows


# ------------------------------------------------------------------ rms norm backward


def _rms_norm_backward_sharded(ctx, grad, x, normalized_shape, rstd, weight, output_mask, *, gather):
    spec = ctx.in_specs[1]
    axis = x.ndim - len(normalized_shape)
    dims, outer = tuple(range(axis, x.ndim)), tuple(range(axis))
    op = opmath_dtype(x.dtype)
    g, rstd = grad.to(op), rstd.to(op)
    xhat = x.to(op) * rstd
    gw = g * weight.to(op) if weight is not None else g
    d_in = d_w = None
    if output_mask[0]:
        s = _group_sum((gw * xhat).sum(dims, keepdim=True), spec, _norm_mesh_dims(spec, axis), gather)
        d_in = ((gw - xhat * (s / math.prod(normalized_shape))) * rstd).to(x.dtype)
    if output_mask[1] and weight is not None:
        d_w = ((g * xhat).sum(outer) if outer else g * xhat).to(x.dtype)
    return d_in, d_w


@strategy(
    aten._fused_rms_norm_backward.default,
    algorithms=[*(LABEL_RMS_BWD.format(how) for how in HOW.values()), LABEL_RMS_LOCAL],
)
def _rms_norm_backward_rule(schema: OpSchema) -> list[Row]:
    grad, spec = schema.tensor_specs[0], schema.tensor_specs[1]
    axis = _axis(schema, spec)
    has_w = schema.arg("weight") is not None
    mask = list(schema.arg("output_mask"))
    outs = _grad_outputs(mask, [True, has_w])
    sum_bytes = opmath_dtype(spec.dtype).itemsize * _rows_per_rank(spec, axis)
    # NOTE: aten has no CPU kernel for _fused_rms_norm_backward, so every row runs our
    # math, local rows included; a combination takes one algorithm, so each variant gets
    # its own copy of the local rows. The last row duplicates the implicit all-Replicate
    # row with an algorithm; it comes first in row order, so it wins their tie.
    rows = []
    for gather, algo in RMS_BACKWARD.items():
        for p in dict.fromkeys(shard_placements(grad) + shard_placements(spec)):
            if p.dim < axis:
                rows.append(row([[p, P][i] for i in outs], [p, p, p] + [R] * has_w, algo))
            else:
                wp = _on_weight_dim(p, axis)
                comm = _sum_comm(gather, sum_bytes) if mask[0] else []
                rows.append(
                    row(
                        [[p, wp][i] for i in outs],
                        [p, p, R] + [wp] * has_w,
                        algo,
                        comm=comm,
                        label=LABEL_RMS_BWD.format(HOW[gather]),
                    )
                )
        rows.append(row([P] * len(outs), [P, R, R] + [R] * has_w, algo))
        rows.append(row([R] * len(outs), [R, R, R] + [R] * has_w, algo, label=LABEL_RMS_LOCAL))
    return rows


# ------------------------------------------------------------------ F.rms_norm entry


class _RMSNorm(torch.autograd.Function):
    """F.rms_norm on DTensors: the fused op and its backward, both planned by the dispatcher."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        out, rstd = dispatch(aten._fused_rms_norm.default, (x, normalized_shape, weight, eps), {})
        ctx.save_for_backward(x, rstd, weight)
        ctx.normalized_shape = normalized_shape
        return out

    @staticmethod
    def backward(ctx, grad):
        return (*_rms_norm_grads(ctx, grad), None, None)


def _rms_norm_grads(ctx, grad) -> tuple:
    """(d_input, d_weight) of the fused op, planned by the dispatcher (None where not needed)."""
    x, rstd, weight = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
    if not any(mask):
        return None, None
    d_in, d_w = dispatch(aten._fused_rms_norm_backward.default, (grad, x, ctx.normalized_shape, rstd, weight, mask), {})
    return d_in, d_w


class _FusedRMSNorm(torch.autograd.Function):
    """aten._fused_rms_norm called directly on DTensors: (out, rstd), both differentiable.

    On CPU torch decomposes the op before __torch_dispatch__, so without this entry a direct
    call would never reach its rule. rstd's own gradient is elementwise (d rstd / dx =
    -rstd^3 x / N), as torch's decomposition differentiates it.
    """

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        out, rstd = dispatch(aten._fused_rms_norm.default, (x, normalized_shape, weight, eps), {})
        ctx.save_for_backward(x, rstd, weight)
        ctx.normalized_shape = normalized_shape
        return out, rstd

    @staticmethod
    def backward(ctx, grad, grad_rstd):
        d_in, d_w = _rms_norm_grads(ctx, grad)
        if grad_rstd is not None and ctx.needs_input_grad[0]:
            x, rstd, _ = ctx.saved_tensors
            term = (grad_rstd * rstd.pow(3) * x / -math.prod(ctx.normalized_shape)).to(x.dtype)
            d_in = term if d_in is None else d_in + term
        return d_in, d_w, None, None


def _rms_norm_call(input, normalized_shape, weight=None, eps=None): ...  # noqa: E704  (torch's form)


@torch_level(F.rms_norm, torch.rms_norm, signature=CallSignature(_rms_norm_call), apply=_RMSNorm.apply)
def _parse_rms_norm(b: dict, *_) -> tuple:
    """F.rms_norm / torch.rms_norm for DTensor operands (see the module docstring)."""
    shape = b["normalized_shape"]
    shape = [shape] if isinstance(shape, int) else [int(s) for s in shape]
    return b["input"], b["weight"], shape, b["eps"]


@torch_level(aten._fused_rms_norm.default, apply=_FusedRMSNorm.apply)
def _parse_fused_rms_norm(b: dict, *_) -> tuple:
    return b["input"], b["weight"], [int(s) for s in b["normalized_shape"]], b["eps"]


# one object per variant: rows of different mesh dims combine only if they share the algorithm
LN_BACKWARD = {g: functools.partial(_layer_norm_backward_sharded, gather=g) for g in (True, False)}
RMS_FORWARD = {g: functools.partial(_rms_norm_sharded, gather=g) for g in (True, False)}
RMS_BACKWARD = {g: functools.partial(_rms_norm_backward_sharded, gather=g) for g in (True, False)}
