"""The seam between op modules and DTensor's internals: wrap a local shard, read a DTensor's shard and spec.

tensor.py owns DTensor's private fields. Everything else that needs them (sharded
algorithms' torch-level entries and autograd functions, interop, verify) goes through
these functions, so the fields can change in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .placements import Placement
from .spec import TensorSpec
from .tensor import DTensor
from .wrapper_meta import restride_wrapper


def wrap(local: torch.Tensor, spec: TensorSpec, requires_grad: bool = False) -> DTensor:
    """A DTensor whose shard on this rank is `local`, laid out as `spec` (no autograd edge, no data moved)."""
    return DTensor._make(local, spec, requires_grad=requires_grad)


def local_of(x: DTensor) -> torch.Tensor:
    """This rank's shard of `x`, as stored (no autograd edge, no pending gradient resolved)."""
    return x._local_tensor


def spec_of(x: DTensor) -> TensorSpec:
    """The mesh, placements and global metadata of `x`."""
    return x._spec


def shard_in(x: DTensor, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's shard of `x` moved to `placements` (no autograd edge; the shard itself when nothing moves)."""
    return x._redistribute_local(placements)


def relabel(x: DTensor, spec: TensorSpec) -> None:
    """Give `x` a new spec for the same local shard (a layout change that moves no data,
    e.g. a fill over a pending sum)."""
    x._set_spec(spec)


def become(x: DTensor, other: DTensor) -> None:
    """Make `x` take `other`'s shard, spec, sizes and strides in place (an in-place view)."""
    x._local_tensor = other._local_tensor
    x._set_spec(other._spec)
    restride_wrapper(x, other.shape, other.stride())


def resolve_pending_gradient(x: DTensor) -> None:
    """A leaf gradient still pending after backward takes its parameter's layout now (what a first read does)."""
    if x._pending_layout is not None:
        x._resolve_pending()


def relayout(x: DTensor, placements: Sequence[Placement]) -> None:
    """Move `x`'s data to `placements` in place (same global tensor;
    e.g. a pending sum made Replicate before it is saved)."""
    x._local_tensor = x._redistribute_local(placements)
    x._set_spec(x._spec.with_placements(tuple(placements)))
