"""Making the planner run a chosen sharded algorithm, and recording which algorithms ran.

The cost model picks one candidate per op and layout; on small samples that is
often "redistribute, then torch's kernel", so a check of the cost model's
picks alone would rarely run the sharded algorithms. Verify therefore also
runs cases with one algorithm forced: `forcing(label)` keeps, for every op
whose candidates include a row with that label, only those candidates (the
cheapest of them wins), and leaves every other op to the cost model.

`offering()` collects the labels of every algorithm the planner could have
chosen (verify's probe of torch-level entries, whose rows belong to the aten
ops they reach). `recording()` (one per rank thread and case) collects the labels of the
sharded algorithms that actually ran, so the report says what ran, not what
was asked for. Both work through the planner's CHOICE_HOOKS; decisions are
cached, so the cache is cleared whenever the forced label changes.

    with installed(), forcing(LABEL_TWO_REDUCES):
        ... so.run(fn, 4) ...        # fn may use `with recording() as ran:`
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .. import caches
from ..planner.choice import CHOICE_HOOKS, choosing
from ..planner.rows import Candidate

_forced: dict[str, str | None] = {"label": None}
_thread = threading.local()


def algorithm_labels(c: Candidate) -> set[str]:
    """The labels of the sharded algorithms a candidate runs (rows with an algorithm and a label)."""
    return {r.label for r in c.rows if r.algorithm is not None and r.label}


def _recorded(algorithm: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(algorithm)
    def run(*args: Any, **kwargs: Any) -> Any:
        ran = getattr(_thread, "ran", None)
        if ran is not None:
            ran.add(label)
        return algorithm(*args, **kwargs)

    run.recorded_label = label  # type: ignore[attr-defined]
    return run


def _choose(ranked: list[Candidate]) -> list[Candidate]:
    offered = getattr(_thread, "offered", None)
    if offered is not None:
        offered.update(labels_of(ranked))
    label = _forced["label"]
    if label is not None:
        ranked = [c for c in ranked if label in algorithm_labels(c)] or ranked
    for c in ranked:
        labels = sorted(algorithm_labels(c))
        if labels and c.algorithm is not None and not hasattr(c.algorithm, "recorded_label"):
            c.algorithm = _recorded(c.algorithm, labels[0])
    return ranked


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Route every planning decision through the forcing/recording hook (planning caches invalidated around it)."""
    with choosing(_choose):
        try:
            yield
        finally:
            _forced["label"] = None


@contextlib.contextmanager
def forcing(label: str | None) -> Iterator[None]:
    """Within the block, ops that can run the algorithm `label` run it (None: the cost model decides).

    Installs the hook if it is not installed. Not for use while other threads plan outside the
    block: the forced label is one for the whole process (every rank of a threads world sees it).
    """
    with contextlib.ExitStack() as stack:
        if _choose not in CHOICE_HOOKS:
            stack.enter_context(installed())
        previous = _forced["label"]
        _forced["label"] = label
        caches.invalidate()
        try:
            yield
        finally:
            _forced["label"] = previous
            caches.invalidate()


@contextlib.contextmanager
def _collecting(name: str) -> Iterator[set[str]]:
    """A fresh set at _thread.<name> for the block (the outer one restored after it)."""
    previous = getattr(_thread, name, None)
    found: set[str] = set()
    setattr(_thread, name, found)
    try:
        yield found
    finally:
        setattr(_thread, name, previous)


def recording() -> contextlib.AbstractContextManager[set[str]]:
    """On this thread (one rank), the labels of the sharded algorithms that run inside the block."""
    return _collecting("ran")


def offering() -> contextlib.AbstractContextManager[set[str]]:
    """On this thread, the labels of every sharded algorithm the planner is offered inside the block
    (chosen or not; decisions served from the cache are not seen: clear it first)."""
    return _collecting("offered")


def labels_of(candidates: Sequence[Candidate]) -> set[str]:
    return set().union(*(algorithm_labels(c) for c in candidates)) if candidates else set()
