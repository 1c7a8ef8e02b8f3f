"""Group norm (F.group_norm / nn.GroupNorm): native_group_norm and its backward.

x [N, C, *S] is normalised per (sample, group of C/G channels); mean and rstd are [N, G].
Rows for one mesh dim:

    native_group_norm (x, weight?, bias?)                 -> (out, mean, rstd)
      batch            S(0), R, R                            S(0), S(0), S(0)
      whole groups     S(1), S(0), S(0)                      S(1), S(1), S(1)
    native_group_norm_backward (grad, x, mean, rstd, weight?) -> (d_x, d_weight, d_bias)
      batch            S(0), S(0), S(0), S(0), R             S(0), P(sum), P(sum)
      whole groups     S(1), S(1), S(1), S(1), S(0)          S(1), S(0), S(0)
      linear in grad   P(sum), R, R, R, R                    P(sum), P(sum), P(sum)

Both are local: a sample's statistics never leave its rank. The op takes N, C and the
group count as numbers; each rank passes its own (local N; with whole groups, its C and
its groups). Channels are sharded only where every shard holds whole groups: on mesh dims
whose sizes multiply to a divisor of the group count (convolution.whole_group_mesh_dims);
other layouts with sharded channels get no row (the planner moves the input, strict mode
refuses). Spatial dims are not sharded here (their statistics would need a round).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..placements import Partial, Replicate, Shard
from ..planner.rows import Row, row
from ._local_kernel import any_empty, zero_outputs
from .convolution import whole_group_mesh_dims

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")
S = Shard


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


def _group_dims(schema: OpSchema, x) -> list[int]:
    return whole_group_mesh_dims(x, int(schema.arg("group")))


@strategy(aten.native_group_norm.default)
def _group_norm_rule(schema: OpSchema) -> list[Row]:
    x = schema.self_spec
    n_affine = len(schema.tensor_specs) - 1
    rows = [row([S(0)] * 3, [S(0)] + [R] * n_affine, _group_norm_local)]
    rows += [row([S(1)] * 3, [S(1)] + [S(0)] * n_affine, _group_norm_local, mesh_dim=i) for i in _group_dims(schema, x)]
    return rows


@strategy(aten.native_group_norm_backward.default)
def _group_norm_backward_rule(schema: OpSchema) -> list[Row]:
    x = schema.tensor_specs[1]
    has_w = len(schema.tensor_specs) == 5
    present = [i for i, m in enumerate(schema.arg("output_mask")) if m]

    def r(outs, ins) -> Row:
        return row([outs[i] for i in present], ins[: 4 + has_w], _group_norm_backward_local)

    rows = [r([S(0), P, P], [S(0)] * 4 + [R]), r([P, P, P], [P, R, R, R, R])]
    rows += [replace(r([S(1), S(0), S(0)], [S(1)] * 4 + [S(0)]), mesh_dim=i) for i in _group_dims(schema, x)]
    return rows
