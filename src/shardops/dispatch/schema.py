"""OpSchema: an op call parsed once into tensor specs and static arguments.

All argument reading and checking lives here: strategies ask `schema.arg("dim")`
or `schema.dims("dim")` and get bound, defaulted, normalised values; they never
index `args` by position or repeat type checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import ShardingError
from ..spec import TensorSpec

_BINDINGS: dict[Any, tuple[list[str], dict[str, Any], set[str]]] = {}


def _binding(op: torch._ops.OpOverload) -> tuple[list[str], dict[str, Any], set[str]]:
    """Argument names, defaults, and kwarg-only names of an aten overload (cached)."""
    b = _BINDINGS.get(op)
    if b is None:
        names, defaults, kwonly = [], {}, set()
        for a in op._schema.arguments:
            names.append(a.name)
            if a.has_default_value():
                defaults[a.name] = a.default_value
            if a.kwarg_only:
                kwonly.add(a.name)
        b = _BINDINGS[op] = (names, defaults, kwonly)
    return b


@dataclass
class OpSchema:
    """An op call with every DTensor replaced by its TensorSpec."""

    op: torch._ops.OpOverload
    args: tuple  # positional args, DTensors replaced by TensorSpec (nested lists too)
    kwargs: dict[str, Any]
    tensor_specs: tuple[TensorSpec, ...]  # every tensor operand, in flattening order
    _bound: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return str(self.op).removeprefix("aten.")

    @property
    def mesh(self):
        return self.tensor_specs[0].mesh

    @property
    def bound(self) -> dict[str, Any]:
        if self._bound is None:
            names, defaults, _ = _binding(self.op)
            bound = dict(defaults)
            bound.update(zip(names, self.args))
            bound.update(self.kwargs)
            self._bound = bound
        return self._bound

    def arg(self, name: str, default: Any = None) -> Any:
        return self.bound.get(name, default)

    @property
    def self_spec(self) -> TensorSpec:
        s = self.args[0] if self.args else next(iter(self.kwargs.values()))
        if not isinstance(s, TensorSpec):
            raise ShardingError(f"{self.name}: first argument is not a tensor")
        return s

    def dims(self, name: str = "dim", ndim: int | None = None) -> tuple[int, ...]:
        """The reduced dims, normalised: None or [] mean every dim (torch's convention)."""
        ndim = self.self_spec.ndim if ndim is None else ndim
        raw = self.arg(name)
        if raw is None or (isinstance(raw, (list, tuple)) and len(raw) == 0):
            return tuple(range(ndim))
        raw = (raw,) if isinstance(raw, int) else tuple(raw)
        return tuple(sorted({normalize_dim(d, ndim, self.name) for d in raw}))

    def dim(self, name: str = "dim", ndim: int | None = None) -> int:
        ndim = self.self_spec.ndim if ndim is None else ndim
        return normalize_dim(self.arg(name), ndim, self.name)

    def is_inplace(self) -> bool:
        return self.op._schema.name.endswith("_") or self.name.endswith("_")


def normalize_dim(d: int, ndim: int, op_name: str = "op") -> int:
    bound = max(ndim, 1)
    if not isinstance(d, int) or not -bound <= d < bound:
        raise ShardingError(f"{op_name}: dim {d} out of range for a tensor with {ndim} dim(s); use a dim in [-{bound}, {bound}).")
    return d % bound


def spec_key(spec: TensorSpec) -> tuple:
    return (spec.mesh, spec.placements, spec.meta.shape, spec.meta.stride, spec.meta.dtype)


def static_key(value: Any) -> Any:
    """A hashable key for a non-tensor argument that tells 1, 1.0 and True apart."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(static_key(v) for v in value)
    if isinstance(value, TensorSpec):
        return ("T",) + spec_key(value)
    if isinstance(value, float) and value != value:
        return ("nan",)
    try:
        hash(value)
    except TypeError:
        return (type(value).__name__, repr(value))
    return (type(value), value)
