"""parallelize_module and distribute_module (torch.distributed.tensor names and semantics).

Better than torch on one point: parameters tied before parallelizing (GPT-2's input
and output embeddings) stay one parameter. torch replaces each module's parameter
by its own DTensor, so the tie breaks silently and the tied weight's gradient is
wrong. Here the first module (in module order) keeps its layout; a later module
whose style wants the same layout shares the parameter, and one that wants another
layout reads it through a compute view redistributed at forward time (_views), so
the gradient of both uses lands in the one parameter.
"""
from __future__ import annotations

import inspect
import warnings
from fnmatch import fnmatch
from typing import Any, Callable

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Replicate
from ..tensor import DTensor, distribute_tensor
from ._layout import as_mesh, global_src_rank
from ._views import FULL, set_compute_layout

__all__ = ["distribute_module", "parallelize_module"]


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
    output_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
) -> nn.Module:
    """Lay out a module's parameters (`partition_fn` per submodule; the rest replicated,
    buffers too) and install `input_fn` / `output_fn` as forward pre/post hooks."""
    if getattr(module, "_distribute_module_applied", False):
        raise ShardingError("distribute_module should only be called once on a module, but it has already been called on this module")
    mesh = as_mesh(device_mesh, "distribute_module")
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        _replicate_rest(sub, mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(_hook(input_fn, "input_fn", lambda f: lambda m, inputs: f(m, inputs, mesh), lambda f: lambda m, inputs: f(inputs, mesh)))
    if output_fn is not None:
        module.register_forward_hook(
            _hook(output_fn, "output_fn", lambda f: lambda m, i, out: f(m, out, mesh), lambda f: lambda m, i, out: f(out, mesh))
        )
    module._distribute_module_applied = True
    return module


def _hook(fn, what: str, three, two):
    n = len(inspect.signature(fn).parameters)
    if n == 3:
        return three(fn)
    if n == 2:
        warnings.warn(f"Deprecating {what} that takes two arguments (inputs, device_mesh), use (module, inputs, device_mesh)", FutureWarning, stacklevel=3)
        return two(fn)
    raise ShardingError(f"{what} should take in 3 arguments, but got {n} arguments")


def _replicate_rest(module: nn.Module, mesh: DeviceMesh) -> None:
    replicate = [Replicate()] * mesh.ndim
    for key, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            with torch.no_grad():
                dt = distribute_tensor(param.detach(), mesh, replicate, src_data_rank=global_src_rank(mesh, 0))
            module.register_parameter(key, nn.Parameter(dt, requires_grad=param.requires_grad))
    for key, buf in list(module._buffers.items()):
        if buf is not None and not isinstance(buf, DTensor):
            module._buffers[key] = distribute_tensor(buf, mesh, replicate, src_data_rank=global_src_rank(mesh, 0))


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
    from .style import ParallelStyle

    if isinstance(plan, ParallelStyle):
        plan.src_data_rank = src_data_rank
        plan._apply(module, mesh)
        return
    if not isinstance(plan, dict):
        raise ShardingError(f"parallelize_module: expected a ParallelStyle or a dict of them as the plan, got {type(plan).__name__}")
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
        if primary is None or all(p is primary for p in current):
            continue
        for (sub, name), p in zip(group, current):
            if p is primary:
                continue
            if isinstance(p, DTensor):
                if p.device_mesh != primary.device_mesh:
                    raise ShardingError(
                        f"parallelize_module: a tied parameter is laid out on {primary.device_mesh} by one module and on "
                        f"{p.device_mesh} by {type(sub).__name__}.{name}; tied modules must use one mesh"
                    )
                if p.placements != primary.placements:
                    set_compute_layout(sub, name, p.placements)
            else:
                set_compute_layout(sub, name, FULL)
            sub._parameters[name] = primary
