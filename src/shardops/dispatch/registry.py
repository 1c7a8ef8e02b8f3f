"""The op registry: aten overload -> rule (rows for one mesh dim).

Op-family modules end with one table registering every op they cover:

    register(rule, aten.sum.default, aten.sum.dim_IntList, ...)

`register_torch_function` maps a torch-level callable (e.g. torch.cumsum) to an
implementation entered from DTensor.__torch_function__, for ops that carry their
own sharded backward as an autograd.Function.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .schema import OpSchema
from .strategy import Row

Rule = Callable[[OpSchema], list[Row]]

RULES: dict[Any, Rule] = {}
TORCH_FUNCTIONS: dict[Any, Callable[..., Any]] = {}
# Ops rewritten into other ops on DTensors (e.g. _foreach_* into per-tensor ops).
DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {}
# Ops known to have no sharded strategy on purpose (replicate fallback, said so in explain).
REPLICATE_ONLY: set[Any] = set()


def _overloads(ops: Iterable[Any]) -> list[torch._ops.OpOverload]:
    out = []
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            out.extend(getattr(op, name) for name in op.overloads())
        else:
            out.append(op)
    return out


def register(rule: Rule, *ops: Any) -> Rule:
    for op in _overloads(ops):
        RULES[op] = rule
    return rule


def register_replicate(*ops: Any) -> None:
    for op in _overloads(ops):
        REPLICATE_ONLY.add(op)


def register_torch_function(fn: Callable[..., Any], *torch_callables: Any) -> Callable[..., Any]:
    for c in torch_callables:
        TORCH_FUNCTIONS[c] = fn
    return fn


def rule_for(op: Any) -> Rule | None:
    return RULES.get(op)
