"""The op registry: aten overload -> rule (rows for one mesh dim), and the other ways in.

An op is registered where its rule is written, by a decorator that names its ops and
the sharded algorithms its rows may run (by name: the rows' labels):

    @strategy(aten.histc.default, algorithms=[LABEL_HISTC_RANGE])
    def _histc_rule(schema: OpSchema) -> list[Row]: ...

    @torch_level(F.rms_norm, torch.rms_norm, signature=CallSignature(_rms_norm_call), apply=_RMSNorm.apply)
    def _parse_rms_norm(b: dict, *_) -> tuple: ...     # a torch-level entry: the parse decorated

    @decomposition(aten._foreach_norm.Scalar)
    def _foreach_norm(tensors, ord=2, dtype=None): ...   # rewritten into other ops on DTensors

    @replicate_when(aten.sort.default, aten.sort.stable)
    def _sorts_a_sharded_dim(schema: OpSchema) -> bool: ...  # replicated on purpose for these layouts

A rule or parse built by a factory is registered where it is built, by calling the
decorator: `strategy(aten.conj.default)(_elementwise_view_rule(...))`.
A torch-level entry (`torch_entry`) binds the call (schema.CallSignature), parses the bound
arguments, applies the op's autograd.Function (whose backward is itself sharded), or else
runs torch's ordinary path into __torch_dispatch__. Two marks have no function of their own:
`replicate_on_purpose(*ops)` (no sharded strategy, on purpose) and `overwrites_self(*ops)`
(in-place ops that never read self's values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._torch.dispatch import DisableTorchFunctionSubclass, OpOverload, OpOverloadPacket
from ..planner.rows import Row
from .schema import CallSignature, OpSchema

Rule = Callable[[OpSchema], list[Row]]
# parse(bound, args, kwargs) -> the arguments of `apply`, or None: not ours (torch's ordinary path)
Parse = Callable[[dict, tuple, dict], "tuple | None"]

RULES: dict[Any, Rule] = {}
TORCH_FUNCTIONS: dict[Any, Callable[..., Any]] = {}
# Ops rewritten into other ops on DTensors (e.g. _foreach_* into per-tensor ops).
DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {}
# Ops known to have no sharded strategy on purpose (replicate fallback, said so in explain).
REPLICATE_ONLY: set[Any] = set()
# The names of the sharded algorithms each op's rule declares (verify runs and credits them by name).
ALGORITHMS: dict[Any, tuple[str, ...]] = {}
# Ops replicated on purpose only for some layouts (sort over a sharded dim): op -> when (schema -> bool).
# Where it holds, a plan that moves data is strict mode's to refuse (so.allow_replicate allows it).
REPLICATE_WHEN: dict[Any, Callable[[OpSchema], bool]] = {}
# In-place ops whose result never reads self's values (fills, draws): a pending (Partial) self
# is relabelled Replicate before planning, never resolved (tensor.dispatch).
OVERWRITES_SELF: set[Any] = set()
# Sharded algorithms of view ops (slice/select along a sharded dim) that return new data, not a
# view of the input: an in-place op on their output would miss the input (tensor.dispatch refuses it).
COPYING_VIEW_ALGORITHMS: set[Callable[..., Any]] = set()


def _overloads(ops: Iterable[Any]) -> list[OpOverload]:
    out: list[OpOverload] = []
    for op in ops:
        if isinstance(op, OpOverloadPacket):
            out.extend(getattr(op, name) for name in op.overloads())
        else:
            out.append(op)
    return out


def strategy(*ops: Any, algorithms: Iterable[str] = ()) -> Callable[[Rule], Rule]:
    """Decorator: the rule below is the strategy of `ops` (overloads; a packet: all its overloads).

    `algorithms`: the names (row labels) of the sharded algorithms its rows may run.
    """
    names = tuple(algorithms)

    def register_rule(rule: Rule) -> Rule:
        for op in _overloads(ops):
            RULES[op] = rule
            ALGORITHMS[op] = names
        return rule

    return register_rule


def torch_level(
    *torch_callables: Any,
    apply: Callable[..., Any],
    signature: CallSignature | None = None,
    around: Callable[[Any], Any] | None = None,
) -> Callable[[Parse], Parse]:
    """Decorator over a parse: calls of `torch_callables` on DTensors that it takes run `apply`.

    signature None: each callable is an aten overload, bound by its own schema.
    around: wraps each entry (a context the whole call runs in, e.g. implicit replication).
    """

    def register_parse(parse: Parse) -> Parse:
        for c in torch_callables:
            entry = torch_entry(c, signature or CallSignature.of_op(c), parse, apply)
            TORCH_FUNCTIONS[c] = around(entry) if around is not None else entry
        return parse

    return register_parse


def decomposition(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: on DTensors, `ops` are rewritten into other ops by the function below (never cached)."""

    def register_decomposition(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in _overloads(ops):
            DECOMPOSITIONS[op] = fn
        return fn

    return register_decomposition


def replicate_when(*ops: Any) -> Callable[[Callable[[OpSchema], bool]], Callable[[OpSchema], bool]]:
    """Decorator over when(schema) -> bool: where it holds, `ops` replicate on purpose (strict mode
    refuses a plan that moves data unless so.allow_replicate)."""

    def register_when(when: Callable[[OpSchema], bool]) -> Callable[[OpSchema], bool]:
        for op in _overloads(ops):
            REPLICATE_WHEN[op] = when
        return when

    return register_when


def replicate_on_purpose(*ops: Any) -> None:
    """Mark `ops` as having no sharded strategy on purpose: they replicate without a warning (explain says so)."""
    for op in _overloads(ops):
        REPLICATE_ONLY.add(op)


def overwrites_self(*ops: Any) -> None:
    """Mark in-place `ops` whose result never reads self's values: a pending self is relabelled, not resolved."""
    for op in _overloads(ops):
        OVERWRITES_SELF.add(op)


def call_default(func, args: tuple, kwargs: dict) -> Any:
    """Run a torch function the ordinary way (into __torch_dispatch__), without our override."""
    with (
        _NO_SUBCLASS_TORCH_FUNCTION()
    ):  # (the seam's disabled_torch_function_impl would enter __torch_function__ again)
        return func(*args, **kwargs)


_NO_SUBCLASS_TORCH_FUNCTION = DisableTorchFunctionSubclass


def torch_entry(func: Any, signature: CallSignature, parse: Parse, apply: Callable[..., Any]) -> Callable[..., Any]:
    """A __torch_function__ override for `func`: bind once, parse, apply; calls that are not ours
    (no form binds, or `parse` says None: no gradient needed, out=, named dims...) run as torch runs them."""

    not_ours: set[tuple] = set()  # call keys whose parse said "not ours": the parse is cached too
    name = getattr(func, "__qualname__", None) or str(func)  # what an argument error names

    def entry(*args, **kwargs):
        key = call_key(args, kwargs)
        if key in not_ours:
            return call_default(func, args, kwargs)
        bound = signature.bind(args, kwargs, name)
        parsed = None if bound is None else parse(bound, args, kwargs)
        if parsed is None:
            if key is not None and len(not_ours) < MAX_CALL_KEYS:
                not_ours.add(key)
            return call_default(func, args, kwargs)
        return apply(*parsed)

    entry.__name__ = f"{getattr(func, '__name__', func)}_entry"
    entry.not_ours = not_ours  # type: ignore[attr-defined]  # a function attribute (tests read it)
    return entry


MAX_CALL_KEYS = 4096  # per entry: bounds the parse cache (a program makes a few call shapes per op)


def call_key(args: tuple, kwargs: dict) -> tuple | None:
    """What a torch-level parse reads, as one flat hashable key: grad mode, and per argument its type and
    value (a tensor: its spec id, or shape and dtype, and requires_grad). None: not keyable (then the
    call is parsed every time)."""
    key: list[Any] = [torch.is_grad_enabled()]
    # a subclass's tensor properties (requires_grad, shape) would each enter __torch_function__
    with _NO_SUBCLASS_TORCH_FUNCTION():
        for a in (*args, *kwargs.items()) if kwargs else args:
            t = type(a)
            if t in _SCALARS:
                key.append(t)
                key.append(a if a == a else "nan")
            else:
                k = _leaf_key(a)
                if k is None:
                    return None
                key.append(k)
    return tuple(key)


_SCALARS = {int, float, bool, str, type(None), torch.dtype}


def _leaf_key(a: Any) -> Any:
    t = type(a)
    if t in _SCALARS:
        return (t, a) if a == a else (t, "nan")
    if isinstance(a, torch.Tensor):
        spec = getattr(a, "_spec", None)  # a DTensor: its spec id says mesh, layout, shape and dtype
        if spec is not None:
            return (t, spec.key, a.requires_grad)
        return (t, a.shape, a.dtype, a.device.type, a.requires_grad)
    if t is tuple or t is list:
        parts = tuple(_leaf_key(v) for v in a)
        return None if None in parts else (t, parts)
    return None


def rule_for(op: Any) -> Rule | None:
    return RULES.get(op)
