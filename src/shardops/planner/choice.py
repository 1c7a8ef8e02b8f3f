"""The ranked candidates an op chooses from, and the hooks that may reorder them.

`candidates()` enumerates small spaces and searches large ones (search.py); the runtime
takes the first. Hooks see every ranked list before the choice and return the candidates
to choose from, in order (never none of them): verify forces each sharded algorithm in turn
through one (verify/forcing.py), and tests steer the planner with `choosing(hook)`
instead of replacing planner functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from .. import caches
from ..cost import Link, resolve_links
from ..redistribute import plan
from ..spec import TensorSpec
from .rows import Candidate, Ranked, Row, check_rows, rank_key
from .search import Search, all_candidates

Hook = Callable[[list[Candidate]], list[Candidate]]
# Called on every ranked candidate list before the choice (cheapest first). Empty in normal runs.
CHOICE_HOOKS: list[Hook] = []
_UNCACHED: list[Hook] = []  # hooks whose choices must not be cached (they differ by rank or by call)

DEFAULT_LIMIT = 1  # candidates kept when the search space is large and no limit is asked: the runtime uses the first
EXHAUSTIVE_MAX = 256  # search spaces this small are simply enumerated


def candidates(
    rows: Sequence[Row],
    in_specs: Sequence[TensorSpec],
    out_shapes: Sequence[tuple[Sequence[int], int]],
    links: tuple[Link, ...] | None = None,
    filter_fn: Callable[[Candidate], bool] | None = None,
    limit: int | None = None,
) -> Ranked:
    """The best candidates, cheapest first (by `rank_key`).

    limit None: every candidate when the space is small (<= EXHAUSTIVE_MAX combinations),
    else the best DEFAULT_LIMIT. limit k: exactly the first k of the exhaustive ranking,
    found by the pruned search however large the mesh. With hooks installed, the hooks
    choose among every candidate.
    """
    mesh = in_specs[0].mesh
    links = resolve_links(links, mesh.ndim)
    check_rows(rows, len(in_specs), len(out_shapes))
    space = (len(rows) + 1) ** mesh.ndim
    if CHOICE_HOOKS:
        return _hooked(all_candidates(rows, in_specs, out_shapes, links, filter_fn))
    if limit is None and space <= EXHAUSTIVE_MAX:
        return all_candidates(rows, in_specs, out_shapes, links, filter_fn)
    search = Search(rows, in_specs, out_shapes, links)
    out = Ranked(
        sorted(search.best(DEFAULT_LIMIT if limit is None else limit, filter_fn), key=lambda c: rank_key(c, mesh.shape))
    )
    out.total = search.count_valid()
    out.replicate = search.replicate(filter_fn)
    return out


def _hooked(ranked: Ranked) -> Ranked:
    for hook in CHOICE_HOOKS:
        chosen = hook(ranked)
        if chosen is not None and chosen is not ranked:
            chosen = Ranked(chosen)
            chosen.total, chosen.replicate, chosen.exhaustive = ranked.total, ranked.replicate, ranked.exhaustive
            ranked = chosen
    return ranked


@contextlib.contextmanager
def choosing(hook: Hook, *, cache: bool = True) -> Iterator[None]:
    """Within the block, every op's ranked candidates pass through `hook` before the choice.

    The planner hook for tests (and verify): `hook(ranked)` returns the candidates to choose
    from, first one chosen. Every planning cache is invalidated on entry and exit, so no
    decision crosses the boundary. `cache=False`: decisions made inside are not cached
    either (a hook whose choice differs by rank, or from call to call).

        with choosing(lambda ranked: [c for c in ranked if c.redistribute_time == 0] or ranked):
            y = torch.softmax(x, 1)
    """
    caches.invalidate()
    CHOICE_HOOKS.append(hook)
    if not cache:
        _UNCACHED.append(hook)
    try:
        yield
    finally:
        CHOICE_HOOKS.remove(hook)
        if not cache:
            _UNCACHED.remove(hook)
        caches.invalidate()


def caching_decisions() -> bool:
    """False while a hook that asked not to be cached is installed."""
    return not _UNCACHED


def with_plans(c: Candidate, in_specs: Sequence[TensorSpec], links=None) -> Candidate:
    """The candidate with its exact redistribution plans (and their estimated time)."""
    plans = tuple(plan(spec, target, links) for spec, target in zip(in_specs, c.inputs))
    c.plans = plans
    c.redistribute_time = sum(p.time for p in plans)
    return c
