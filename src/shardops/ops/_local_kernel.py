"""Running torch's own kernel on a rank's shards where the kernel refuses an empty shard.

Uneven layouts leave some ranks an empty piece (3 channels over 4 ranks: 1, 1, 1, 0).
Many CNN kernels (pooling, upsampling, convolution with no output channels) refuse a
tensor with a zero-sized non-batch dim, although the answer for an empty piece is plain:
an empty output, or zeros where the output is a pending sum the rank adds nothing to.
The op families of the convolutional family run their local rows through these helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._torch.dispatch import OpOverload


def local_output_shapes(ctx) -> list[tuple[int, ...]]:
    """This rank's shape of each output of the decision (from the output specs: no data needed)."""
    coord = ctx.out_specs[0].mesh.get_coordinate()
    return [spec.local_shape(coord) for spec in ctx.out_specs]


def zero_outputs(ctx, device: torch.device) -> list[torch.Tensor]:
    """Zeros in this rank's shape and dtype of every output: empty pieces, or nothing added to a pending sum."""
    return [
        torch.zeros(shape, dtype=spec.dtype, device=device)
        for shape, spec in zip(local_output_shapes(ctx), ctx.out_specs)
    ]


def any_empty(tensors: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in tensors)


def with_arg(op: OpOverload, args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    """(args, kwargs) with the argument `name` of `op` set to `value`, wherever the call passed it."""
    names = [a.name for a in op._schema.arguments]
    i = names.index(name)
    if i < len(args):
        return args[:i] + (value,) + args[i + 1 :], kwargs
    return args, {**kwargs, name: value}


def arg_of(op: OpOverload, args: tuple, kwargs: dict, name: str) -> Any:
    """The argument `name` as the call passed it (its schema default otherwise)."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, a.default_value if a.has_default_value() else None)
    raise KeyError(name)
