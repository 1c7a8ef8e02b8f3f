"""The best candidates without enumerating them, and the exhaustive ranking they must equal.

Crossing the rows is exponential in the mesh ndim (20 rows on a 4-D mesh are 160,000
combinations), so `Search` does not enumerate them: it searches mesh dim by mesh dim,
best first (A* over prefixes of rows), with a lower bound on every component of the
rank key, and stops after the best `limit`. The bound is admissible for each term (see
`Search`), so the candidates it returns are exactly the first `limit` of the exhaustive
ranking (`all_candidates()`, kept for explain, verify's hooks and
tests/test_planner_pruning.py, which proves it).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cost import Link, resolve_links
from ..placements import NormPartial, Placement
from ..spec import TensorSpec
from .pricing import (
    collective_time,
    comm_time,
    gathered_bytes,
    move_guard,
    price,
    redistribution_term,
    source_local_bytes,
    unblock_term,
)
from .rows import (
    Candidate,
    Ranked,
    Row,
    check_rows,
    fits_mesh_dim,
    mixed_partials,
    needs_norm_partial,
    order_index,
    rank_key,
    row_options,
)

_NO_COMM = Row((), ())  # stands in for a row whose per-dim collectives are already in the separable sum


def all_candidates(
    rows: Sequence[Row],
    in_specs: Sequence[TensorSpec],
    out_shapes: Sequence[tuple[Sequence[int], int]],
    links: tuple[Link, ...] | None = None,
    filter_fn: Callable[[Candidate], bool] | None = None,
) -> Ranked:
    """Every candidate, priced and ranked: the exhaustive reference the search must equal."""
    mesh = in_specs[0].mesh
    links = resolve_links(links, mesh.ndim)
    check_rows(rows, len(in_specs), len(out_shapes))
    options = row_options(rows, len(in_specs), len(out_shapes))
    out, total, replicate = [], 0, None
    for indices in itertools.product(range(len(options)), repeat=mesh.ndim):
        combo = tuple(options[r] for r in indices)
        if len({r.algorithm for r in combo if r.algorithm is not None}) > 1 or not all(
            fits_mesh_dim(r, i) for i, r in enumerate(combo)
        ):
            continue
        c = price(combo, in_specs, out_shapes, links, order_index(indices, len(options)))
        if mixed_partials(c) or needs_norm_partial(c, in_specs):
            continue
        total += 1
        if filter_fn is None or filter_fn(c):
            out.append(c)
            if all(r == len(options) - 1 for r in indices):
                replicate = c
    ranked = Ranked(sorted(out, key=lambda c: rank_key(c, mesh.shape)))
    ranked.total, ranked.replicate, ranked.exhaustive = total, replicate, True
    return ranked


@dataclass(frozen=True, slots=True)
class Prefix:
    """The rows chosen on mesh dims 0..len(indices)-1, and what they fix of every completion's rank key."""

    indices: tuple[int, ...]  # the row option chosen on each mesh dim so far
    time: float  # exact separable time of those dims: input moves, per-dim collectives, forced gathers
    changes: int  # input placements those dims change
    algorithm: Callable[..., Any] | None  # the one sharded algorithm a chosen row runs, if any
    partials: tuple[Placement | None, ...]  # per tensor (inputs, then outputs): the pending partial so far
    shards: tuple[int, ...]  # per tensor: the pieces the chosen dims cut it into
    gathers: tuple[bool, ...]  # per input: a chosen dim gathers one of its shards
    pending: tuple[float, ...]  # per output: resolution time per byte on the chosen dims
    guarded: tuple[frozenset[int], ...]  # per input: tensor dims the chosen dims' moves touch


class Search:
    """Best-first search over the rows of mesh dim 0, then 1, ... (A* over row prefixes).

    A prefix's key is a lower bound, component by component, of the rank key of every
    candidate that completes it, so the candidates come out of the heap in exact rank
    order (componentwise bounds bound the lexicographic key):

    - time: the separable terms (each input's per-dim move, the per-dim collectives of
      rows without an algorithm) of the chosen dims and the gathers their nesting forces
      (a dim's depend only on earlier dims, so they are exact once it is chosen), plus for
      each later dim its cheapest row's; the joint collectives of the chosen algorithm rows priced over the dims so
      far (a joint collective only grows with its group), plus each later dim's latency
      floor (alpha (n-1) per collective it would join); the pending resolution and the
      gather-then-compute work of the chosen dims with the later dims sharding as much
      as any of their rows can (both shrink with sharding). Lowered by a relative 1e-9
      so float rounding in another summation order cannot lift it above the exact time.
    - changes: the chosen dims' count plus each later dim's least.
    - pending: 0 unless neither the chosen nor any later row leaves an output pending.
    - -sharding: with each later dim sharding every tensor any of its rows can shard.
    - order: the prefix followed by row 0 everywhere (the product index is monotone).

    Combinations the exhaustive path drops are cut as soon as a prefix shows them: two
    algorithms, two different partials in one placement tuple, a NormPartial target that
    is not already the source. `filter_fn` (in-place ops) sees complete candidates only.
    """

    def __init__(self, rows, in_specs, out_shapes, links) -> None:
        self.in_specs, self.out_shapes, self.links = tuple(in_specs), tuple(out_shapes), tuple(links)
        self.mesh_shape = tuple(in_specs[0].mesh.shape)
        self.n_in, self.n_out = len(in_specs), len(out_shapes)
        self.options = row_options(rows, self.n_in, self.n_out)
        self.radix = len(self.options)
        self.tuples = [
            r.inputs + tuple(r.outputs[min(k, len(r.outputs) - 1)] for k in range(self.n_out)) for r in self.options
        ]
        self.src_local = [source_local_bytes(spec) for spec in in_specs]
        self.in_bytes = [math.prod(spec.shape) * spec.itemsize for spec in in_specs]
        self.out_bytes = [math.prod(shape) * itemsize for shape, itemsize in out_shapes]
        self.compute_rate = min(link.compute for link in links)
        self._comm_memo: dict[tuple, float] = {}
        self._per_dim_tables()
        self._suffix_bounds()

    def _per_dim_tables(self) -> None:
        """Per mesh dim, per row option: valid, separable time, latency floor, changes, pending cost per byte."""
        self.valid, self.sep, self.floor, self.changes, self.pend_coef = [], [], [], [], []
        for i in range(len(self.mesh_shape)):
            n, link = self.mesh_shape[i], self.links[i]
            valid, sep, floor, changes, pend = [], [], [], [], []
            for index, r in enumerate(self.options):
                srcs = [spec.placements[i] for spec in self.in_specs]
                valid.append(
                    fits_mesh_dim(r, i)
                    and not any(isinstance(t, NormPartial) and t != a for a, t in zip(srcs, r.inputs))
                )
                moves = sum(
                    redistribution_term(a, t, loc, n, link) for a, t, loc in zip(srcs, r.inputs, self.src_local)
                )
                lat = 0.0
                if r.algorithm is None:
                    moves += sum(collective_time(kind, gathered_bytes(kind, b, n), n, link) for kind, b in r.comm)
                elif n > 1:
                    lat = sum(
                        (2 if kind == "all_reduce" else 1) * (n - 1) * link.latency
                        for kind, _ in {(k, float(b)) for k, b in r.comm}
                    )
                sep.append(moves)
                floor.append(lat)
                changes.append(sum(a != t for a, t in zip(srcs, r.inputs)))
                # resolve_time per byte of a pending output on this dim
                pend.append(
                    [
                        (2 if len(shape) == 0 else 1) * (n - 1) / n / link.bandwidth
                        if n > 1 and p.is_partial()
                        else 0.0
                        for (shape, _), p in zip(self.out_shapes, self.tuples[index][self.n_in :])
                    ]
                )
            self.valid.append(valid)
            self.sep.append(sep)
            self.floor.append(floor)
            self.changes.append(changes)
            self.pend_coef.append(pend)

    def _suffix_bounds(self) -> None:
        """Per suffix of mesh dims (index j covers j..ndim-1):
        the least time and changes, any pending, the most sharding."""
        ndim = len(self.mesh_shape)
        n_tuples = self.n_in + self.n_out
        self.rest_time = [0.0] * (ndim + 1)
        self.rest_changes = [0] * (ndim + 1)
        self.rest_shard = [[1] * n_tuples for _ in range(ndim + 1)]
        self.rest_pending = [False] * (ndim + 1)
        for i in reversed(range(ndim)):
            ok = [r for r in range(self.radix) if self.valid[i][r]]
            self.rest_time[i] = self.rest_time[i + 1] + min(
                (self.sep[i][r] + self.floor[i][r] for r in ok), default=0.0
            )
            self.rest_changes[i] = self.rest_changes[i + 1] + min((self.changes[i][r] for r in ok), default=0)
            self.rest_pending[i] = self.rest_pending[i + 1] or any(
                p.is_partial() for r in ok for p in self.tuples[r][self.n_in :]
            )
            self.rest_shard[i] = [
                m * (self.mesh_shape[i] if any(self.tuples[r][t].is_shard() for r in ok) else 1)
                for t, m in enumerate(self.rest_shard[i + 1])
            ]

    # ---------------------------------------------------------------- states

    def root(self) -> Prefix:
        n_tuples = self.n_in + self.n_out
        return Prefix(
            (),
            0.0,
            0,
            None,
            (None,) * n_tuples,
            (1,) * n_tuples,
            (False,) * self.n_in,
            (0.0,) * self.n_out,
            (frozenset(),) * self.n_in,
        )

    def _child(self, state: Prefix, r: int) -> Prefix | None:
        """The prefix `state` extended by row r on the next mesh dim; None if no completion is valid."""
        i = len(state.indices)
        if not self.valid[i][r]:
            return None
        row = self.options[r]
        algo = state.algorithm
        if row.algorithm is not None:
            if algo is not None and algo != row.algorithm:
                return None
            algo = row.algorithm
        placed = self.tuples[r]
        partials = list(state.partials)
        for t, p in enumerate(placed):
            if p.is_partial():
                if partials[t] is None:
                    partials[t] = p
                elif partials[t] != p:
                    return None
        n = self.mesh_shape[i]
        shards = tuple(m * n if p.is_shard() else m for m, p in zip(state.shards, placed))
        gathers = tuple(
            g or (spec.placements[i].is_shard() and p.is_replicate())
            for g, spec, p in zip(state.gathers, self.in_specs, placed)
        )
        pending = tuple(a + b for a, b in zip(state.pending, self.pend_coef[i][r]))
        # nesting: earlier mesh dims' moves are known now, so this dim's forced gathers are exact
        unblock, guarded = 0.0, []
        for k, (spec, g, b) in enumerate(zip(self.in_specs, state.guarded, row.inputs)):
            a = spec.placements[i]
            unblock += unblock_term(g, a, b, self.src_local[k], n, self.links[i])
            guarded.append(g | move_guard(a, b))
        return Prefix(
            state.indices + (r,),
            state.time + self.sep[i][r] + unblock,
            state.changes + self.changes[i][r],
            algo,
            tuple(partials),
            shards,
            gathers,
            pending,
            tuple(guarded),
        )

    def _bound(self, state: Prefix) -> tuple:
        j = len(state.indices)
        rest = self.rest_shard[j]
        time = state.time + self.rest_time[j]
        time += self._joint_comm(state.indices)
        for k in range(self.n_out):
            t = self.n_in + k
            time += state.pending[k] * self.out_bytes[k] / (state.shards[t] * rest[t])
        time += (
            sum(b / (state.shards[k] * rest[k]) for k, b in enumerate(self.in_bytes) if state.gathers[k])
            / self.compute_rate
        )
        pending = 0 if any(p is not None for p in state.partials[self.n_in :]) or self.rest_pending[j] else 1
        sharding = sum(m * rest[t] for t, m in enumerate(state.shards))
        order = order_index(state.indices + (0,) * (len(self.mesh_shape) - j), self.radix)
        return (round(time * (1 - 1e-9), 12), state.changes + self.rest_changes[j], pending, -sharding, order)

    def _joint_comm(self, indices) -> float:
        """The joint collectives of the prefix's algorithm rows (memoised: most prefixes share them)."""
        key = tuple(
            (i, r) for i, r in enumerate(indices) if self.options[r].algorithm is not None and self.options[r].comm
        )
        if not key:
            return 0.0
        value = self._comm_memo.get(key)
        if value is None:
            combo = [_NO_COMM] * len(indices)
            for i, r in key:
                combo[i] = self.options[r]
            value = self._comm_memo[key] = comm_time(combo, self.mesh_shape, self.links)
        return value

    # ---------------------------------------------------------------- answers

    def best(self, limit: int, filter_fn=None) -> list[Candidate]:
        ndim = len(self.mesh_shape)
        root = self.root()
        tick = itertools.count()
        heap: list[tuple[tuple, int, int, Prefix | Candidate]] = [(self._bound(root), 1, next(tick), root)]
        out: list[Candidate] = []
        while heap and len(out) < limit:
            _, kind, _, item = heapq.heappop(heap)
            if isinstance(item, Candidate):  # kind 0, a priced candidate: nothing left in the heap can rank before it
                out.append(item)
                continue
            if len(item.indices) == ndim:
                c = self._price(item.indices)
                if filter_fn is None or filter_fn(c):
                    heapq.heappush(heap, (rank_key(c, self.mesh_shape), 0, next(tick), c))
                continue
            for r in range(self.radix):
                child = self._child(item, r)
                if child is not None:
                    heapq.heappush(heap, (self._bound(child), 1, next(tick), child))
        return out

    def _price(self, indices: Sequence[int]) -> Candidate:
        combo = tuple(self.options[r] for r in indices)
        return price(combo, self.in_specs, self.out_shapes, self.links, order_index(indices, self.radix))

    def replicate(self, filter_fn=None) -> Candidate | None:
        c = self._price((self.radix - 1,) * len(self.mesh_shape))
        return c if filter_fn is None or filter_fn(c) else None

    def count_valid(self) -> int:
        """How many combinations pass the structural rules: a count over (algorithm, partials) states."""
        states = {(None, (None,) * (self.n_in + self.n_out)): 1}
        for i in range(len(self.mesh_shape)):
            nxt: dict = {}
            for (algo, partials), count in states.items():
                for r in range(self.radix):
                    row = self.options[r]
                    if not self.valid[i][r] or (
                        row.algorithm is not None and algo is not None and row.algorithm != algo
                    ):
                        continue
                    new: list[Placement | None] = list(partials)
                    for t, p in enumerate(self.tuples[r]):
                        if p.is_partial():
                            if new[t] is None:
                                new[t] = p
                            elif new[t] != p:
                                break
                    else:
                        key = (row.algorithm if row.algorithm is not None else algo, tuple(new))
                        nxt[key] = nxt.get(key, 0) + count
            states = nxt
        return sum(states.values())
