"""Compute views: during a module's forward, a parameter is read in another layout than it is stored in.

Three users: a parameter sharded over the data-parallel dims (FSDP-style) is
gathered for compute; a tied parameter (one object, two modules whose styles want
two layouts) is stored once and redistributed for the module that wants the other
layout; and a module outside the plan, which computes on plain local tensors,
reads its DTensor parameter as a plain tensor (`LocalView`: the whole parameter,
its gradient declared Partial(sum) over the data-parallel dims, where each rank
saw its own batch shard, and Replicate elsewhere, as torch assumes for modules a
tensor-parallel plan leaves alone; a style whose module computes on local tensors
declares its own, e.g. a per-head norm's gradient Partial(sum) over tp, or the local
shards of an experts module's parameters, and data_parallel adds Partial(sum) over dp
to it). The view is made with `redistribute` /
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
    # data_parallel's view for a module outside the plan: only while the module's inputs are plain
    # (a module fed DTensors reads the DTensor parameter; a plain one beside them would raise)
    only_for_plain_inputs: bool = False


View = tuple[Placement, ...] | LocalView


def compute_layouts(module: nn.Module) -> dict[str, View]:
    """The module's compute views so far (read only; set_compute_layout adds one)."""
    return dict(module.__dict__.get(VIEWS_ATTR, {}))


def set_compute_layout(module: nn.Module, name: str, layout: Sequence[Placement] | LocalView) -> None:
    """During `module`'s forward, `module.<name>` is its parameter moved to `layout` (or a LocalView of it)."""
    layouts = module.__dict__.get(VIEWS_ATTR)
    if layouts is None:
        layouts = module.__dict__[VIEWS_ATTR] = {}
        module.register_forward_pre_hook(_install_views)
        module.register_forward_hook(_drop_views, always_call=True)
    layouts[name] = layout if isinstance(layout, LocalView) else tuple(layout)


def _install_views(module: nn.Module, inputs) -> None:
    fed_dtensors = any(isinstance(x, DTensor) for x in inputs)
    for name, layout in module.__dict__[VIEWS_ATTR].items():
        p = module._parameters.get(name)
        if not isinstance(p, DTensor):
            continue
        if isinstance(layout, LocalView):
            if layout.only_for_plain_inputs and fed_dtensors:
                continue
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
