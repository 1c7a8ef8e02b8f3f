"""parallelize_module (torch.distributed.tensor.parallel's name and semantics).

Better than torch on one point: parameters tied before parallelizing (GPT-2's input
and output embeddings) stay one parameter. torch replaces each module's parameter
by its own DTensor, so the tie breaks silently and the tied weight's gradient is
wrong. Here the first module (in module order) keeps its layout; a later module
whose style wants the same layout shares the parameter, and one that wants another
layout reads it through a compute view redistributed at forward time (_views), so
the gradient of both uses lands in the one parameter.
"""

from __future__ import annotations

import warnings
from fnmatch import fnmatch
from typing import Any

import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Replicate
from ..tensor import DTensor
from ._layout import as_mesh
from ._views import LocalView, set_compute_layout
from .style import ParallelStyle

__all__ = ["parallelize_module"]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: Any = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Apply a ParallelStyle, or a plan {module path: style}, to `module`.

    Plan keys are dotted paths whose tokens may hold `*`/`?` wildcards (fnmatch), matched
    against child names level by level; "" is the module itself. Unmatched keys warn.
    """
    if parallelize_plan is None:
        warnings.warn("No parallelize_plan is provided, so this parallelize_module call will do nothing.", stacklevel=2)
        return module
    mesh = as_mesh(device_mesh, "parallelize_module")
    ties = _tied_parameters(module)
    _apply_plan(module, mesh, parallelize_plan, src_data_rank)
    _retie(ties)
    return module


def _apply_plan(module: nn.Module, mesh: DeviceMesh, plan: Any, src_data_rank: int | None) -> None:
    if isinstance(plan, ParallelStyle):
        plan.src_data_rank = src_data_rank
        plan._apply(module, mesh)
        return
    if not isinstance(plan, dict):
        raise ShardingError(
            f"parallelize_module: expected a ParallelStyle or a dict of them as the plan, got {type(plan).__name__}"
        )
    for path, style in plan.items():
        if path == "":
            _apply_plan(module, mesh, style, src_data_rank)
            continue
        token, _, rest = path.partition(".")
        matched = [child for name, child in module.named_children() if fnmatch(name, token)]
        if not matched:
            warnings.warn(
                f"Parallelize plan key '{path}' could not be resolved: no submodule matching token '{token}' in "
                f"{type(module).__name__}, skipping this plan entry.",
                stacklevel=3,
            )
            continue
        for child in matched:
            _apply_plan(child, mesh, {rest: style} if rest else style, src_data_rank)


def _tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, name) that hold one parameter object, in module order."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((sub, name))
    return [h for h in holders.values() if len(h) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    for group in groups:
        current = [sub._parameters[name] for sub, name in group]
        primary = next((p for p in current if isinstance(p, DTensor)), None)
        if not isinstance(primary, DTensor) or all(p is primary for p in current):  # (None: no DTensor)
            continue
        for (sub, name), p in zip(group, current):
            if p is primary:
                continue
            if isinstance(p, DTensor):
                if p.device_mesh != primary.device_mesh:
                    raise ShardingError(
                        f"parallelize_module: a tied parameter is laid out on {primary.device_mesh} by one module and "
                        f"on {p.device_mesh} by {type(sub).__name__}.{name}; tied modules must use one mesh"
                    )
                if p.placements != primary.placements:
                    set_compute_layout(sub, name, p.placements)
            else:  # a module outside the plan: the whole parameter, as a plain tensor
                set_compute_layout(sub, name, LocalView((Replicate(),) * primary.device_mesh.ndim))
            sub._parameters[name] = primary
