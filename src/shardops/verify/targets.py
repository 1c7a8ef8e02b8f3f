"""Which ops verify checks: every registered op, discovered from the registry at run time.

An op added later is checked without anyone listing it: the aten overloads in
RULES, REPLICATE_ONLY and DECOMPOSITIONS (out= and in-place variants left out:
their functional forms are checked), and the torch-level callables in
TORCH_FUNCTIONS.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._torch.dispatch import OpOverload
from ..dispatch import core, registry
from ..notation import callable_name
from . import samples


@dataclass(frozen=True)
class Target:
    """One thing verify calls on DTensors: an aten overload or a torch-level callable."""

    name: str  # aten.sum.dim_IntList, torch.cumsum, Tensor.cumsum
    group: str  # the summary row: aten.sum, torch.cumsum
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    generator: Callable[..., Any] | None
    kind: str  # rule | replicate | decomposition | torch_function


def _writes_self(op) -> bool:
    args = op._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def aten_target(op, kind: str) -> Target:
    return Target(
        str(op), str(op).rsplit(".", 1)[0], op, samples.reference_for(op) or op, samples.generator_for(op), kind
    )


# A torch-level entry that only checks a call, then runs torch's own path (views' aliasing check,
# ops/views.py): the aten ops that path reaches are the targets; the check has its own tests.
GUARD_SKIP = "call checks (views alias or raise: tests/test_views_alias.py)"
RANDOM_SKIP = "random ops (layout-invariant draws, not torch's values: tests/test_random.py)"


# Tagged nondeterministic_seeded for a dropout argument they are sampled without (dropout_p = 0).
_DETERMINISTIC_WHEN_SAMPLED = frozenset({"aten._scaled_dot_product_flash_attention_for_cpu.default"})


def _is_random(fn) -> bool:
    from ..ops.random import RANDOM_ENTRIES

    if fn in RANDOM_ENTRIES:
        return True
    return (
        isinstance(fn, OpOverload)
        and torch.Tag.nondeterministic_seeded in fn.tags
        and str(fn) not in _DETERMINISTIC_WHEN_SAMPLED
    )


def discover() -> tuple[list[Target], dict[str, int]]:
    """Every registered op, one Target per overload (out= and in-place variants left out)."""
    skipped: Counter[str] = Counter()
    found: dict[str, Target] = {}
    sources = [
        (registry.RULES, "rule"),
        (registry.REPLICATE_ONLY, "replicate"),
        (registry.DECOMPOSITIONS, "decomposition"),
    ]
    for ops, kind in sources:
        for op in list(ops):
            if not isinstance(op, OpOverload):
                continue
            if core.out_arg_names(op):
                skipped["out= variants"] += 1
            elif _is_random(op):
                skipped[RANDOM_SKIP] += 1
            elif _writes_self(op):
                skipped["in-place variants"] += 1
            elif str(op) not in found:
                found[str(op)] = aten_target(op, kind)
    for fn in list(registry.TORCH_FUNCTIONS):
        if _is_random(fn):
            skipped[RANDOM_SKIP] += 1
            continue
        if callable_name(fn).startswith("Tensor.") and callable_name(fn).endswith("_"):  # Tensor.fill_ & co
            skipped["in-place variants"] += 1
            continue
        if getattr(registry.TORCH_FUNCTIONS[fn], "guard_only", False):
            skipped[GUARD_SKIP] += 1
            continue
        if isinstance(fn, OpOverload):  # an aten op intercepted before dispatch: verify calls it as such
            found.setdefault(str(fn), aten_target(fn, "torch_function"))
            continue
        name = callable_name(fn)
        while name in found:
            name += "'"
        found[name] = Target(name, name, fn, fn, samples.torch_generator(fn), "torch_function")
    return sorted(found.values(), key=lambda t: t.name), dict(skipped)


def select(targets: Sequence[Target], filters: Sequence[str] | None) -> list[Target]:
    """Targets named exactly by a filter, else those whose name contains it."""
    if not filters:
        return list(targets)
    chosen = []
    for f in filters:
        exact = [t for t in targets if t.name == f]
        chosen += exact or [t for t in targets if f in t.name]
    seen: set[str] = set()
    unique = []
    for t in chosen:  # each name once, at its first place
        if t.name not in seen:
            seen.add(t.name)
            unique.append(t)
    return unique
