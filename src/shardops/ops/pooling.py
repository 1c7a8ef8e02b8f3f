"""Per-plane spatial ops: pooling (max, avg, adaptive) and upsampling, forward and backward.

Each of these ops works on every (n, c) plane of its input on its own: the trailing k
spatial dims are the plane, every dim before them (batch, channels; just channels for an
unbatched input) is a leading dim. Sharding a leading dim is therefore local, with every
tensor operand and output sharded alike:

    op (x, ...)                       tensors            outputs
      leading dim d sharded           S(d) each          S(d) each

max pooling's indices point into the plane (h * W + w), so they stay right on any leading
shard. The backwards of upsampling take the input's global size as a list argument: each
rank passes its own piece's size.

Spatial dims are not sharded: a window or an interpolation reads across a shard's edge
(halos), which these rules do not exchange; adaptive pooling to 1x1 reaches torch's
`mean` (ops/reductions.py) instead, where a sharded spatial dim is a pending sum.

Empty shards (channels split over more ranks than they fill) run no kernel: torch refuses
planes with no channels; their outputs are empty.
"""

from __future__ import annotations

import torch

from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..placements import Shard
from ..planner.rows import Row, row
from ._local_kernel import any_empty, arg_of, with_arg, zero_outputs

aten = torch.ops.aten

# op -> spatial dims of its plane
POOLS = {
    aten.max_pool2d_with_indices.default: 2,
    aten.max_pool2d_with_indices_backward.default: 2,
    aten.max_pool3d_with_indices.default: 3,
    aten.max_pool3d_with_indices_backward.default: 3,
    aten.avg_pool2d.default: 2,
    aten.avg_pool2d_backward.default: 2,
    aten.avg_pool3d.default: 3,
    aten.avg_pool3d_backward.default: 3,
    aten._adaptive_avg_pool2d.default: 2,
    aten._adaptive_avg_pool2d_backward.default: 2,
    aten._adaptive_avg_pool3d.default: 3,
    aten._adaptive_avg_pool3d_backward.default: 3,
    aten.adaptive_max_pool2d.default: 2,
    aten.adaptive_max_pool2d_backward.default: 2,
    aten.adaptive_max_pool3d.default: 3,
    aten.adaptive_max_pool3d_backward.default: 3,
}
UPSAMPLES = {
    "upsample_nearest1d": 1,
    "upsample_nearest2d": 2,
    "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1,
    "_upsample_nearest_exact2d": 2,
    "_upsample_nearest_exact3d": 3,
    "upsample_linear1d": 1,
    "upsample_bilinear2d": 2,
    "upsample_bicubic2d": 2,
    "upsample_trilinear3d": 3,
    "_upsample_bilinear2d_aa": 2,
    "_upsample_bicubic2d_aa": 2,
}
for _name, _k in UPSAMPLES.items():
    POOLS[getattr(aten, _name).default] = _k
    POOLS[getattr(aten, _name + "_backward").default] = _k


def _plane_local(ctx, *args, **kwargs):
    """torch's kernel on this rank's planes (its own input size for an upsample's backward)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
        v for v in kwargs.values() if isinstance(v, torch.Tensor)
    ]
    if any_empty(tensors):
        outs = zero_outputs(ctx, tensors[0].device)
        return outs[0] if len(outs) == 1 else tuple(outs)
    op = ctx.func
    if any(a.name == "input_size" for a in op._schema.arguments):
        sizes = [int(s) for s in arg_of(op, args, kwargs, "input_size")]
        grad = tensors[0]
        k = POOLS[op]
        sizes = list(grad.shape[: grad.ndim - k]) + sizes[len(sizes) - k :]
        args, kwargs = with_arg(op, args, kwargs, "input_size", sizes)
    return op(*args, **kwargs)


def _leading_dims_rule(schema: OpSchema) -> list[Row]:
    x = schema.tensor_specs[0]
    leading = x.ndim - POOLS[schema.op]
    n_out = len(schema.op._schema.returns)
    n_in = len(schema.tensor_specs)
    return [row([Shard(d)] * n_out, [Shard(d)] * n_in, _plane_local) for d in range(max(leading, 0))]


strategy(*POOLS)(_leading_dims_rule)
