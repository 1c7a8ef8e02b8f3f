"""Parameters already sharded over the data mesh: expert parallelism's experts (`Shard(0)` over
ep, where ep is the data mesh, or its dim of an (ep, tp) mesh).

Each rank holds its own experts, and every token routed to them from every data-parallel rank
reaches them, so their gradient is complete on its rank: nothing to gather, nothing to reduce.
`fully_shard` and `replicate` leave them as they are (torchtitan shards them on a data mesh of
size 1 to the same effect) and only divide their gradient as the data-parallel reduction
divides the others (a rank-local mean loss: by the data-parallel size, or by
`set_gradient_divide_factor`'s factor), so the whole model gets the gradient of the
global-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..mesh import DeviceMesh
from ..tensor import DTensor

DIVIDED_MARK = "_shardops_dp_divided"  # its gradient hook is in place (one per parameter)


def sharded_over(param: torch.Tensor, mesh: DeviceMesh) -> bool:
    """Whether `param` is a DTensor sharded on every dim of the data mesh `mesh` (its own mesh, one
    of the same ranks, or one that holds the data mesh's dims by name, sliced from the same root)."""
    if not isinstance(param, DTensor):
        return False
    own = param.device_mesh
    if own.shape == mesh.shape and torch.equal(own.mesh, mesh.mesh):  # the same ranks (names aside: a default mesh)
        dims = list(range(mesh.ndim))
    else:
        names, own_names = mesh.mesh_dim_names, own.mesh_dim_names
        if not names or not own_names or any(n not in own_names for n in names):
            return False
        if (own.root_mesh or own) != (mesh.root_mesh or mesh):
            return False
        dims = [own_names.index(n) for n in names]
    return all(param.placements[d].is_shard() for d in dims)


def divide_gradient(param: nn.Parameter, factor: Callable[[], float]) -> None:
    """Each gradient `param` receives is divided by `factor()` (read at backward time) before it
    accumulates: one division per contribution, so accumulation over micro-batches stays right."""
    if getattr(param, DIVIDED_MARK, False):
        return
    setattr(param, DIVIDED_MARK, True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        f = factor()
        return grad if f == 1 else grad / f

    param.register_hook(hook)
