"""OpSchema: an op call parsed once into tensor specs and static arguments.

All argument reading and checking lives here: strategies ask `schema.arg("dim")`
or `schema.dims("dim")` and get bound, defaulted, normalised values; they never
index `args` by position or repeat type checks.

A schema records what its readers read (`reads`): the decision cache keys a float
argument on its value only where a decision read it, and on the class a rule asked for
where it read only that (`arg_class(name, scalar_sign)`): AdamW's new scalars every step
then reuse one decision (dispatch/core.float_key).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import caches
from .._torch.dispatch import OpOverload
from ..errors import ShardingError
from ..spec import TensorSpec

_BINDINGS: dict[Any, tuple[list[str], dict[str, Any], set[str]]] = {}
caches.register("signature bindings", _BINDINGS.clear)


def _binding(op: OpOverload) -> tuple[list[str], dict[str, Any], set[str]]:
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

    op: OpOverload
    args: tuple  # positional args, DTensors replaced by TensorSpec (nested lists too)
    kwargs: dict[str, Any]
    tensor_specs: tuple[TensorSpec, ...]  # every tensor operand, in flattening order
    _bound: dict[str, Any] | None = field(default=None, repr=False)
    # argument name -> how it was read: EXACTLY, or the classifier given to arg_class; EVERY: all of them
    reads: dict[str, Callable[[Any], Any] | None] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return str(self.op).removeprefix("aten.")

    @property
    def mesh(self):
        return self.tensor_specs[0].mesh

    @property
    def bound(self) -> dict[str, Any]:
        """Every argument by name (a reader of this may read any of them exactly)."""
        self.reads[EVERY] = EXACTLY
        return self._arguments()

    def _arguments(self) -> dict[str, Any]:
        if self._bound is None:
            names, defaults, _ = _binding(self.op)
            bound = dict(defaults)
            bound.update(zip(names, self.args))
            bound.update(self.kwargs)
            self._bound = bound
        return self._bound

    def arg(self, name: str, default: Any = None) -> Any:
        self._note(name, EXACTLY)
        return self._arguments().get(name, default)

    def arg_class(self, name: str, classify: Callable[[Any], Any], default: Any = None) -> Any:
        """`classify(value)` of an argument, for a reader whose choice depends on that class alone (e.g.
        `scalar_sign`): a float argument read only so is cached on its class, not its value.
        `classify` must be a module-level function (the cache tells classifiers apart by identity)."""
        self._note(name, classify)
        return classify(self._arguments().get(name, default))

    def _note(self, name: str, how: Callable[[Any], Any] | None) -> None:
        seen = self.reads.get(name, how)
        self.reads[name] = how if seen is how else EXACTLY  # read two ways: exactly

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


class CallSignature:
    """How a torch-level call's arguments are read by name: the callable's forms (Python
    signatures, tried in order as torch's argument parser does) and keyword aliases.

    Every torch-level entry binds through here (registry.torch_entry). The binding is worked
    out once per call shape (number of positional arguments, keyword names, positional
    argument types) and cached, so a repeated call costs one lookup, a zip and a dict update.
    A form may carry `accepts(args, kwargs)`, which must read only what the call shape holds
    (positional types, keyword names): e.g. var(x, True) is the `unbiased` form.
    """

    _MAX_SHAPES = 256  # call shapes remembered per callable (a program uses a handful)

    def __init__(self, *forms: Callable[..., Any] | inspect.Signature, aliases: dict[str, str] | None = None):
        self.forms = [
            (f if isinstance(f, inspect.Signature) else inspect.signature(f), getattr(f, "accepts", None))
            for f in forms
        ]
        self.aliases = aliases or {}
        self._shapes: dict[tuple, tuple[tuple[str, ...], dict[str, Any]] | None] = {}

    @classmethod
    def of_op(cls, op: OpOverload) -> CallSignature:
        """An aten overload's signature, from its schema (the names rules read through OpSchema.arg)."""
        params = []
        for a in op._schema.arguments:
            kind = inspect.Parameter.KEYWORD_ONLY if a.kwarg_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
            default = a.default_value if a.has_default_value() else inspect.Parameter.empty
            params.append(inspect.Parameter(a.name, kind, default=default))
        return cls(inspect.Signature(params))

    def bind(self, args: tuple, kwargs: dict, where: str = "a torch function on DTensors") -> dict[str, Any] | None:
        """The call's arguments by name, defaults filled in; None where no form takes the call.
        A symbolic scalar (torch.compile with dynamic=True) raises ShardingError naming `where`."""
        key = (len(args), tuple(kwargs), tuple(map(type, args)))
        how = self._shapes.get(key, _UNSEEN)
        for v in kwargs.values():  # positional ones are checked once per call shape (their types are in the key)
            refuse_symbolic(v, where)
        if how is _UNSEEN:
            for v in args:
                refuse_symbolic(v, where)
            how = self._learn(args, kwargs)
            if len(self._shapes) < self._MAX_SHAPES:
                self._shapes[key] = how
        if how is None:
            return None
        names, defaults = how
        bound = dict(defaults)
        bound.update(zip(names, args))
        if kwargs:
            aliases = self.aliases
            for k, v in kwargs.items():
                bound[aliases.get(k, k)] = v
        return bound

    def _learn(self, args: tuple, kwargs: dict) -> tuple[tuple[str, ...], dict[str, Any]] | None:
        kw = {self.aliases.get(k, k): v for k, v in kwargs.items()}
        for sig, accepts in self.forms:
            try:
                sig.bind(*args, **kw)
            except TypeError:
                continue
            if accepts is not None and not accepts(args, kwargs):
                continue
            params = list(sig.parameters.values())
            return tuple(p.name for p in params[: len(args)]), {
                p.name: p.default for p in params if p.default is not p.empty
            }
        return None


_UNSEEN: Any = object()  # typed Any: a sentinel, compared by identity

EXACTLY = None  # OpSchema.reads: the argument's value was read
EVERY = "*"  # OpSchema.reads: every argument may have been read exactly (OpSchema.bound)


def scalar_sign(value: Any) -> str | None:
    """A Python scalar's sign class ("c>0", "c=0", "c<0", "c=nan"); None for anything else (a tensor, None)."""
    if not isinstance(value, (int, float, bool)):
        return None
    return "c>0" if value > 0 else "c=0" if value == 0 else "c<0" if value < 0 else "c=nan"


def is_none(value: Any) -> bool:
    return value is None


def normalize_dim(d: int, ndim: int, op_name: str = "op") -> int:
    bound = max(ndim, 1)
    if not isinstance(d, int) or not -bound <= d < bound:
        raise ShardingError(
            f"{op_name}: dim {d} out of range for a tensor with {ndim} dim(s); use a dim in [-{bound}, {bound})."
        )
    return d % bound


def spec_key(spec: TensorSpec) -> tuple:
    return (spec.mesh, spec.placements, spec.meta.shape, spec.meta.stride, spec.meta.dtype)


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def refuse_symbolic(value: Any, where: str = "an op on DTensors") -> None:
    """A symbolic scalar (torch.compile with dynamic=True, or a dim dynamo made dynamic) raises: a
    DTensor's plan is made from static shapes and scalars, as docs/compile.md says."""
    if isinstance(value, _SYMBOLIC):
        kind = type(value).__name__.removeprefix("Sym").lower()
        raise ShardingError(
            f"torch.compile: {where} got the symbolic {kind} {value} (dynamic shapes); shardops DTensors need static "
            "shapes and scalars. Compile with dynamic=False (torch.compile(fn, dynamic=False))."
        )


def static_key(value: Any, op: Any = None) -> Any:
    """A hashable key for a non-tensor argument that tells 1, 1.0 and True apart (a symbolic one raises)."""
    refuse_symbolic(value, str(op) if op is not None else "an op on DTensors")
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(static_key(v, op) for v in value)
    if isinstance(value, TensorSpec):
        return ("T",) + spec_key(value)
    if isinstance(value, float) and value != value:
        return ("nan",)
    try:
        hash(value)
    except TypeError:
        return (type(value).__name__, repr(value))
    return (type(value), value)
