"""Every planning cache, registered in one place, with one invalidation.

Decisions, redistribution plans and searches, attention plans, signature bindings and spec
ids are all derived from things that can change under them: the link model (`set_links`),
strict mode (`set_strict`), a test's or verify's planner hook. Each cache registers how to
clear itself here; `invalidate()` clears them all and bumps `EPOCH`, which the caches keyed
by value (an lru_cache, the dispatch key) include, so nothing planned before is reused.

It sits at the bottom of the package (it imports nothing of shardops), so the low modules that
cache (spec.py, cost.py, redistribute.py) register here without importing the planner above them.
"""

from __future__ import annotations

from collections.abc import Callable

EPOCH = [0]  # read on the hot path as EPOCH[0]: a list, so importers see every bump
_CLEARS: dict[str, Callable[[], None]] = {}


def register(name: str, clear: Callable[[], None]) -> None:
    """Make `invalidate()` call `clear` (one entry per name: re-registering replaces it)."""
    _CLEARS[name] = clear


def invalidate() -> None:
    """Forget every cached plan and decision; later calls plan anew."""
    EPOCH[0] += 1
    for clear in _CLEARS.values():
        clear()


def registered() -> tuple[str, ...]:
    """The names of the registered caches (what `invalidate` clears)."""
    return tuple(_CLEARS)
