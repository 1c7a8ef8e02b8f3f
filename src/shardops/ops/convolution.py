"""Convolution (conv1d/2d/3d, transposed, grouped) and its backward, as channel and batch products.

A convolution is a matrix product per output position: batch N and output channels are
free dims, input channels are contracted. Input x [N, C_in, *S]; weight [C_out, C_in/g, *K]
(transposed: [C_in, C_out/g, *K]); output [N, C_out, *S']. Rows for one mesh dim, every
one of them local (no collective inside the op):

    convolution            x        weight      bias      out
      batch                S(0)     R           R         S(0)
      output channels      R        S(out)      S(0)      S(1)      groups = 1
      input channels       S(1)     S(in)       P(sum)    P(sum)    groups = 1: a contracting dim
      linear in x / w      P(sum)   R / R P(sum) P(sum)   P(sum)    any groups
      whole groups         S(1)     S(0)        S(0)      S(1)      groups > 1, see below
      1x1 kernel           S(d)     R           R         S(d)      d spatial; stride 1, no padding

    convolution_backward   grad     x        weight     d_x      d_weight   d_bias
      batch                S(0)     S(0)     R          S(0)     P(sum)     P(sum)
      output channels      S(1)     R        S(out)     P(sum)   S(out)     S(0)
      input channels       R        S(1)     S(in)      S(1)     S(in)      R
      linear in grad       P(sum)   R        R          P(sum)   P(sum)     P(sum)
      linear in x          R        P(sum)   R          R        P(sum)     R
      linear in weight     R        R        P(sum)     P(sum)   R          R
      whole groups         S(1)     S(1)     S(0)       S(1)     S(0)       S(0)
      1x1 kernel           S(d)     S(d)     R          S(d)     P(sum)     P(sum)

(out, in) = weight dims (0, 1), transposed (1, 0). With the output pending (P(sum)), the bias
is pending too, so it is added once in total (a Replicate bias becomes P(sum) locally: kept
on one rank, zero on the others), as for addmm (ops/matrix.py).

Groups > 1: an output channel reads only its own group's input channels, so sharding the
input channels inside a group has no exact local form, and neither has sharding output
channels across a group boundary. Whole groups per rank are local: the rank runs its groups
with `groups` scaled to the groups it holds. That is exact when every shard boundary falls
on a group boundary for both channel dims, which holds on mesh dims whose sizes multiply
to a divisor of `groups` (then every split is even; `whole_group_mesh_dims`); other mesh
dims get no grouped row (the planner moves the inputs; strict mode refuses).

Spatial dims need halos (a kernel wider than 1 reads its neighbours' edges), which these
rules do not exchange: a spatial dim is sharded only for a 1x1 kernel with stride 1 and no
padding, where every output position reads its own input position.

Empty shards (uneven channels over many ranks) run no kernel: torch refuses a weight with
no output channels. Their outputs are empty, or zeros where the rank adds nothing to a
pending sum (plus its bias piece).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..placements import Partial, Placement, Replicate, Shard
from ..planner.rows import Row, row
from ..spec import TensorSpec
from ._local_kernel import any_empty, zero_outputs

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")
S = Shard


def _weight_dims(transposed: bool) -> tuple[int, int]:
    """(output-channel dim, input-channel dim) of the weight."""
    return (1, 0) if transposed else (0, 1)


def whole_group_mesh_dims(spec: TensorSpec, groups: int) -> list[int]:
    """The mesh dims on which the channel dim (1) of `spec` may be sharded in whole groups.

    Any set of mesh dims whose sizes multiply to a divisor of `groups` splits the channels
    evenly, every shard holding whole groups (C = groups * c, split by n | groups: chunks of
    groups/n * c), however the mesh dims nest. The dims chosen: greedily, those that shard
    the channels now first (the planner prefers leaving inputs where they are), then the
    rest in mesh order, while the product of their sizes divides `groups`; any subset of
    them is then safe too.
    """
    if groups <= 1:
        return []
    mesh_shape = spec.mesh.shape
    now = [i for i, p in enumerate(spec.placements) if p.is_shard(1)]
    chosen, product = [], 1
    for i in now + [i for i in range(len(mesh_shape)) if i not in now]:
        if groups % (product * mesh_shape[i]) == 0:
            chosen.append(i)
            product *= mesh_shape[i]
    return chosen


def _pointwise_kernel(schema: OpSchema, weight: TensorSpec) -> bool:
    """A 1x1 kernel with stride 1 and no padding: output position i reads input position i only."""
    kernel = weight.shape[2:]
    flat = lambda name: [int(v) for v in (schema.arg(name) or [])]  # noqa: E731
    return (
        all(k == 1 for k in kernel)
        and all(s == 1 for s in flat("stride"))
        and all(p == 0 for p in flat("padding"))
        and all(p == 0 for p in flat("output_padding"))
    )


def _local_groups(ctx, x: torch.Tensor, groups: int) -> int:
    """The groups this rank holds: all of them unless the channel dim is sharded (whole groups then)."""
    channels = ctx.in_specs[1].shape[1] if ctx.func is aten.convolution_backward.default else ctx.in_specs[0].shape[1]
    if groups == 1 or x.shape[1] == channels:
        return groups
    return groups * x.shape[1] // channels


# ------------------------------------------------------------------ forward


def _convolution_local(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """torch's kernel on this rank's shards, with its groups; empty shards give zeros (+ the bias piece)."""
    if any_empty([x, weight]):
        out = zero_outputs(ctx, x.device)[0]
        if bias is not None and bias.numel() == out.shape[1]:
            out += bias.reshape((1, -1) + (1,) * (out.ndim - 2)).to(out.dtype)
        return out
    local_groups = _local_groups(ctx, x, groups)
    return aten.convolution.default(
        x, weight, bias, stride, padding, dilation, transposed, output_padding, local_groups
    )


@strategy(aten.convolution.default)
def _convolution_rule(schema: OpSchema) -> list[Row]:
    x, w = schema.tensor_specs[0], schema.tensor_specs[1]
    if x.ndim != w.ndim or x.ndim < 3:
        return []  # not a batched call (torch batches unbatched input before this op)
    has_bias = schema.arg("bias") is not None
    transposed, groups = bool(schema.arg("transposed")), int(schema.arg("groups"))
    w_out, w_in = _weight_dims(transposed)

    def r(out: Placement, xp: Placement, wp: Placement, bp: Placement) -> Row:
        return row(out, [xp, wp] + [bp] * has_bias, _convolution_local)

    rows = [r(S(0), S(0), R, R)]
    if groups == 1:
        rows += [r(S(1), R, S(w_out), S(0)), r(P, S(1), S(w_in), P)]
    else:
        rows += [replace(r(S(1), S(1), S(0), S(0)), mesh_dim=i) for i in whole_group_mesh_dims(x, groups)]
    rows += [r(P, P, R, P), r(P, R, P, P)]
    if _pointwise_kernel(schema, w):
        rows += [r(S(d), S(d), R, R) for d in range(2, x.ndim)]
    return rows


# ------------------------------------------------------------------ backward


def _convolution_backward_local(
    ctx, grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """torch's backward kernel on this rank's shards; with an empty shard, the sums it would add up."""
    if any_empty([grad, x, weight]):
        d_x, d_w = torch.zeros_like(x), torch.zeros_like(weight)
        d_b = grad.sum([d for d in range(grad.ndim) if d != 1])
        outs = [d_x, d_w, d_b]
    else:
        local_bias = None if bias_sizes is None else [grad.shape[1]]
        outs = list(
            aten.convolution_backward.default(
                grad,
                x,
                weight,
                local_bias,
                stride,
                padding,
                dilation,
                transposed,
                output_padding,
                _local_groups(ctx, x, groups),
                output_mask,
            )
        )
    return tuple(o if m else None for o, m in zip(outs, output_mask))


@strategy(aten.convolution_backward.default)
def _convolution_backward_rule(schema: OpSchema) -> list[Row]:
    grad, x, w = schema.tensor_specs[:3]
    if x.ndim != w.ndim or x.ndim < 3:
        return []
    transposed, groups = bool(schema.arg("transposed")), int(schema.arg("groups"))
    w_out, w_in = _weight_dims(transposed)
    present = [i for i, m in enumerate(schema.arg("output_mask")) if m]

    def r(outs: Sequence[Placement], ins: Sequence[Placement]) -> Row:
        return row([outs[i] for i in present], list(ins), _convolution_backward_local)

    rows = [r([S(0), P, P], [S(0), S(0), R])]
    if groups == 1:
        rows += [r([P, S(w_out), S(0)], [S(1), R, S(w_out)]), r([S(1), S(w_in), R], [R, S(1), S(w_in)])]
    else:
        rows += [
            replace(r([S(1), S(0), S(0)], [S(1), S(1), S(0)]), mesh_dim=i) for i in whole_group_mesh_dims(x, groups)
        ]
    rows += [r([P, P, P], [P, R, R]), r([R, P, R], [R, P, R]), r([P, R, R], [R, R, P])]
    if _pointwise_kernel(schema, w):
        rows += [r([S(d), P, P], [S(d), S(d), R]) for d in range(2, x.ndim)]
    return rows
