"""distribute_module (torch.distributed.tensor's name and semantics): lay out a module's
parameters and install input/output hooks. The parallel styles are built on it."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Replicate
from ..tensor import DTensor
from ._layout import as_mesh, distribute_param

__all__ = ["distribute_module"]


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
        raise ShardingError(
            "distribute_module should only be called once on a module, but it has already been called on this module"
        )
    mesh = as_mesh(device_mesh, "distribute_module")
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        _replicate_rest(sub, mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(
            _hook(
                input_fn,
                "input_fn",
                lambda f: lambda m, inputs: f(m, inputs, mesh),
                lambda f: lambda m, inputs: f(inputs, mesh),
            )
        )
    if output_fn is not None:
        module.register_forward_hook(
            _hook(
                output_fn,
                "output_fn",
                lambda f: lambda m, i, out: f(m, out, mesh),
                lambda f: lambda m, i, out: f(out, mesh),
            )
        )
    module._distribute_module_applied = True  # type: ignore[assignment]  # nn.Module's stub admits only tensors and modules
    return module


def _hook(fn, what: str, three, two):
    n = len(inspect.signature(fn).parameters)
    if n == 3:
        return three(fn)
    if n == 2:
        warnings.warn(
            f"Deprecating {what} that takes two arguments (inputs, device_mesh), use (module, inputs, device_mesh)",
            FutureWarning,
            stacklevel=3,
        )
        return two(fn)
    raise ShardingError(f"{what} should take in 3 arguments, but got {n} arguments")


def _replicate_rest(module: nn.Module, mesh: DeviceMesh) -> None:
    replicate = [Replicate()] * mesh.ndim
    for key, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            with torch.no_grad():
                dt = distribute_param(param, mesh, replicate, 0)
            module.register_parameter(key, nn.Parameter(dt, requires_grad=param.requires_grad))
    for key, buf in list(module._buffers.items()):
        if buf is not None and not isinstance(buf, DTensor):
            module._buffers[key] = distribute_param(buf, mesh, replicate, 0)
