"""Compute views: during a module's forward, a parameter is read in another layout than it is stored in.

Two users: a tied parameter (one object, two modules whose styles want two layouts) is
stored once and redistributed for the module that wants the other layout; and a module
that computes on plain local tensors reads its DTensor parameter as a plain tensor
(`LocalView`: the whole parameter or its local shard, its gradient declared in the
placements the style gives, e.g. a per-head norm's gradient Partial(sum) over tp, or the
local shards of an experts module's parameters). The view is made with `redistribute` /
`to_local` (autograd-tracked), so the gradient flows back into the one stored
parameter, in its storage layout; `nn.Module`'s parameters, `state_dict` and the
optimizer keep seeing the stored parameter.

The view lives in the module's instance `__dict__` for the duration of the forward
(attribute lookup finds it before `nn.Module.__getattr__` reaches `_parameters`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn as nn

from ..placements import Placement, Replicate
from ..tensor import DTensor

VIEWS_ATTR = "_shardops_compute_layouts"


@dataclass(frozen=True)
class LocalView:
    """The module reads the parameter as a plain tensor whose gradient has `grad_placements`: its
    local piece in `placements` (a module computing on its shards), or with None the whole parameter."""

    grad_placements: tuple[Placement, ...]
    placements: tuple[Placement, ...] | None = None


def set_compute_layout(module: nn.Module, name: str, layout: Sequence[Placement] | LocalView) -> None:
    """During `module`'s forward, `module.<name>` is its parameter moved to `layout` (or a LocalView of it)."""
    layouts = module.__dict__.get(VIEWS_ATTR)
    if layouts is None:
        layouts = module.__dict__[VIEWS_ATTR] = {}
        module.register_forward_pre_hook(_install_views)
        module.register_forward_hook(_drop_views, always_call=True)
    layouts[name] = layout if isinstance(layout, LocalView) else tuple(layout)


def _install_views(module: nn.Module, inputs) -> None:
    for name, layout in module.__dict__[VIEWS_ATTR].items():
        p = module._parameters.get(name)
        if not isinstance(p, DTensor):
            continue
        if isinstance(layout, LocalView):
            compute = layout.placements or (Replicate(),) * p.device_mesh.ndim
            view = (p if p.placements == compute else p.redistribute(placements=compute)).to_local(
                grad_placements=layout.grad_placements
            )
        elif p.placements == layout:
            continue
        else:
            view = p.redistribute(placements=layout)
        module.__dict__[name] = view


def _drop_views(module: nn.Module, inputs, outputs) -> None:
    for name in module.__dict__[VIEWS_ATTR]:
        module.__dict__.pop(name, None)
