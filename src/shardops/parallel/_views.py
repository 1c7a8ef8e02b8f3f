"""Compute views: during a module's forward, a parameter is read in another layout than it is stored in.

Two users: a parameter sharded over the data-parallel dims (FSDP-style) is gathered
for compute, and a tied parameter (one object, two modules whose styles want two
layouts) is stored once and redistributed for the module that wants the other
layout. The view is made with `redistribute` (autograd-tracked), so the gradient
flows back into the one stored parameter, in its storage layout; `nn.Module`'s
parameters, `state_dict` and the optimizer keep seeing the stored parameter.

The view lives in the module's instance `__dict__` for the duration of the forward
(attribute lookup finds it before `nn.Module.__getattr__` reaches `_parameters`).
"""
from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from ..placements import Placement
from ..tensor import DTensor

VIEWS_ATTR = "_shardops_compute_layouts"
FULL = "full"  # the view is a plain full tensor (a tied module outside the plan)


def compute_layouts(module: nn.Module) -> dict[str, tuple[Placement, ...] | str]:
    """The module's compute views so far (read only; set_compute_layout adds one)."""
    return dict(module.__dict__.get(VIEWS_ATTR, {}))


def set_compute_layout(module: nn.Module, name: str, layout: Sequence[Placement] | str) -> None:
    """During `module`'s forward, `module.<name>` is its parameter moved to `layout` (or FULL)."""
    layouts = module.__dict__.get(VIEWS_ATTR)
    if layouts is None:
        layouts = module.__dict__[VIEWS_ATTR] = {}
        module.register_forward_pre_hook(_install_views)
        module.register_forward_hook(_drop_views, always_call=True)
    layouts[name] = layout if isinstance(layout, str) else tuple(layout)


def _install_views(module: nn.Module, inputs) -> None:
    for name, layout in module.__dict__[VIEWS_ATTR].items():
        p = module._parameters.get(name)
        if not isinstance(p, DTensor):
            continue
        if layout == FULL:
            view = p.full_tensor()
        elif p.placements == layout:
            continue
        else:
            view = p.redistribute(placements=layout)
        module.__dict__[name] = view


def _drop_views(module: nn.Module, inputs, outputs) -> None:
    for name in module.__dict__[VIEWS_ATTR]:
        module.__dict__.pop(name, None)
