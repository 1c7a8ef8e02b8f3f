"""Strategy rows, their expansion across mesh dims, and the cost-based choice.

A rule describes ONE mesh dim: a list of `Row`s, each giving the output
placements, then the input placements (one per tensor operand), and, for a
sharded algorithm, the collectives it issues inside the op on that mesh dim.
The all-Replicate row is implicit. `candidates()` crosses the rows of every
mesh dim and prices each combination:

    cost = redistributing the inputs (planned)     + internal collectives
         + resolving any pending (Partial) output later (an eager planner
           must price what it defers)
         + the redundant local work a gather creates (every rank then
           runs the kernel on the whole gathered data)

and the cheapest wins; ties prefer leaving inputs as they are, then a pending
output (a later linear op may absorb it), then more sharding, then the rule's
row order.

Crossing the rows is exponential in the mesh ndim (20 rows on a 4-D mesh are
160,000 combinations), so `candidates()` does not enumerate them: it searches
mesh dim by mesh dim, best first (A* over prefixes of rows), with a lower bound
on every component of the rank key, and stops after the best `limit`. The
bound is admissible for each term (see `_Search`), so the candidates it returns
are exactly the first `limit` of the exhaustive ranking (`all_candidates()`,
kept for explain and for tests/test_planner_pruning.py, which proves it).
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .. import cost
from ..errors import ShardingError
from ..placements import NormPartial, Placement, Replicate
from ..redistribute import Plan, plan
from ..spec import TensorSpec

R = Replicate()
# Called on every ranked candidate list before the choice (cheapest first): each hook returns the
# candidates to choose from, in order, never none of them. Empty in normal runs; verify forces
# each sharded algorithm in turn through it (shardops/verify/forcing.py).
CHOICE_HOOKS: list[Callable[[list["Candidate"]], list["Candidate"]]] = []


@dataclass(frozen=True)
class Row:
    """One mesh dim's layout: outputs then inputs, plus what the op sends inside."""

    outputs: tuple[Placement, ...]
    inputs: tuple[Placement, ...]
    algorithm: Callable[..., Any] | None = None
    # Collectives the op issues inside, on this mesh dim: (kind, bytes this rank puts in, as
    # CommDebugMode counts them: all_gather its own piece, all_reduce its whole input).
    comm: tuple[tuple[str, float], ...] = ()
    label: str = ""
    # A row that holds on this mesh dim only (a view's exact layout: what one mesh dim's
    # shard becomes depends on what the mesh dims before it cut); None: any mesh dim.
    mesh_dim: int | None = None


def row(outputs, inputs, algorithm=None, comm=(), label="", mesh_dim=None) -> Row:
    as_tuple = lambda x: tuple(x) if isinstance(x, (list, tuple)) else (x,)  # noqa: E731
    return Row(as_tuple(outputs), as_tuple(inputs), algorithm, tuple(comm), label, mesh_dim)


@dataclass
class Candidate:
    inputs: tuple[tuple[Placement, ...], ...]  # per tensor operand, one placement per mesh dim
    outputs: tuple[tuple[Placement, ...], ...]  # per tensor output
    algorithm: Callable[..., Any] | None
    rows: tuple[Row, ...]
    plans: tuple[Plan, ...] = ()
    redistribute_time: float = 0.0
    comm_time: float = 0.0
    pending_time: float = 0.0
    order: int = 0
    changes: int = 0  # input placements that differ from the current ones (ties prefer fewer)
    compute_time: float = 0.0

    @property
    def time(self) -> float:
        return self.redistribute_time + self.comm_time + self.pending_time + self.compute_time

    @property
    def label(self) -> str:
        labels = [r.label for r in self.rows if r.label]
        return labels[0] if labels else ("local" if not any(p.is_partial() for o in self.outputs for p in o) else "pending")

    def describe(self) -> str:
        ins = " ".join("[" + ",".join(map(repr, p)) + "]" for p in self.inputs)
        outs = " ".join("[" + ",".join(map(repr, p)) + "]" for p in self.outputs)
        return f"{ins} -> {outs}"


def _needs_norm_partial(c: Candidate, in_specs: Sequence[TensorSpec]) -> bool:
    """NormPartial is a source only: no plan reaches it from another placement."""
    return any(isinstance(t, NormPartial) and t != s for spec, tgt in zip(in_specs, c.inputs) for s, t in zip(spec.placements, tgt))


def _mixed_partials(c: Candidate) -> bool:
    return any(len({p for p in pl if p.is_partial()}) > 1 for pl in c.outputs + c.inputs)


def _pending(c: Candidate) -> bool:
    return any(p.is_partial() for o in c.outputs for p in o)


def _sharding(c: Candidate, mesh_shape: Sequence[int]) -> int:
    return sum(math.prod(n for n, p in zip(mesh_shape, pl) if p.is_shard()) for pl in c.inputs + c.outputs)


def row_options(rows: Sequence[Row], n_inputs: int, n_outputs: int) -> list[Row]:
    """The rows every mesh dim chooses from: the rule's, then the implicit all-Replicate row."""
    return list(rows) + [Row((R,) * max(n_outputs, 1), (R,) * n_inputs)]


def expand(
    rows: Sequence[Row],
    n_inputs: int,
    n_outputs: int,
    mesh_ndim: int,
) -> list[tuple[Row, ...]]:
    """Every combination of one row per mesh dim (the implicit all-R row included)."""
    combos = []
    for combo in itertools.product(row_options(rows, n_inputs, n_outputs), repeat=mesh_ndim):
        algos = {r.algorithm for r in combo if r.algorithm is not None}
        if len(algos) <= 1 and all(fits_mesh_dim(r, i) for i, r in enumerate(combo)):
            combos.append(combo)
    return combos


def fits_mesh_dim(r: Row, i: int) -> bool:
    """A row made for one mesh dim (a view's exact layout) is offered on that dim only."""
    return r.mesh_dim is None or r.mesh_dim == i


def _source_local_bytes(spec: TensorSpec) -> float:
    return spec.numel * spec.itemsize / max(math.prod(n for n, p in zip(spec.mesh.shape, spec.placements) if p.is_shard()), 1)


def _redistribution_term(a: Placement, b: Placement, local: float, n: int, link: cost.Link) -> float:
    """One mesh dim's share of moving a tensor from `a` to `b` (see estimate_redistribution)."""
    if a == b or a.is_replicate():
        return 0.0
    if a.is_shard():
        kind, nbytes = ("all_to_all", local) if b.is_shard() else ("all_gather", local * n)
    else:
        kind, nbytes = ("reduce_scatter", local) if b.is_shard() else ("all_reduce", local)
    return cost.collective_time(kind, nbytes, n, link)


def estimate_redistribution(spec: TensorSpec, target: Sequence[Placement], links: tuple[cost.Link, ...]) -> float:
    """Per-mesh-dim estimate of moving `spec` to `target`: each dim priced on its own, plus
    the gathers that nesting forces.

    Shards nest left to right, so a move on mesh dim i that touches tensor dim d waits
    until no later mesh dim shards d: a later mesh dim j that keeps its shard of d must be
    gathered first (and sliced again after, which is free). That gather is priced at the
    source's local size (`_unblock_term`). Exact when no two mesh dims shard the same
    tensor dim; the executed plan is the exact shortest path (redistribute.plan). Linear
    in mesh ndim, so pricing a candidate stays cheap on large meshes.
    """
    mesh_shape = spec.mesh.shape
    local = _source_local_bytes(spec)
    total = 0.0
    guarded: frozenset[int] = frozenset()
    for i, (a, b) in enumerate(zip(spec.placements, target)):
        total += _redistribution_term(a, b, local, mesh_shape[i], links[i]) + _unblock_term(guarded, a, b, local, mesh_shape[i], links[i])
        guarded |= _move_guard(a, b)
    return total


def _move_guard(a: Placement, b: Placement) -> frozenset[int]:
    """Tensor dims a one-mesh-dim move a -> b touches (no later mesh dim may shard them then)."""
    if a == b:
        return frozenset()
    return frozenset(p.dim for p in (a, b) if p.is_shard())


def _unblock_term(guarded: frozenset[int], a: Placement, b: Placement, local: float, n: int, link: cost.Link) -> float:
    """A mesh dim that keeps its shard of a tensor dim an earlier mesh dim's move touches: gathered first."""
    if a == b and a.is_shard() and a.dim in guarded:
        return cost.collective_time("all_gather", local * n, n, link)
    return 0.0


def _gathered(kind: str, nbytes: float, group_size: int) -> float:
    """A row declares what one rank puts in; the cost model takes the full (gathered) size."""
    return nbytes * group_size if kind == "all_gather" else nbytes


def comm_time(combo: Sequence[Row], mesh_shape: Sequence[int], links: Sequence[cost.Link]) -> float:
    """The op's own collectives. A sharded algorithm whose dim is sharded over several mesh
    dims issues ONE collective over the group spanning them (ops/common.py), so equal
    entries of its rows merge into one joint collective (cost.joint_collective_time),
    issued as many times as the most any one row declares it."""
    total = 0.0
    joint: dict[tuple[str, float], tuple[list[int], int]] = {}
    for i, r in enumerate(combo):
        if r.algorithm is None:  # a plain per-mesh-dim declaration
            n = mesh_shape[i]
            total += sum(cost.collective_time(kind, _gathered(kind, b, n), n, links[i]) for kind, b in r.comm)
            continue
        counts: dict[tuple[str, float], int] = {}
        for kind, b in r.comm:
            counts[(kind, float(b))] = counts.get((kind, float(b)), 0) + 1
        for key, count in counts.items():
            dims, most = joint.get(key, ([], 0))
            joint[key] = (dims + [i], max(most, count))
    for (kind, b), (dims, count) in joint.items():
        sizes = [mesh_shape[i] for i in dims]
        total += count * cost.joint_collective_time(kind, _gathered(kind, b, math.prod(sizes)), sizes, [links[i] for i in dims])
    return total


def price(
    combo: tuple[Row, ...],
    in_specs: Sequence[TensorSpec],
    out_shapes: Sequence[tuple[Sequence[int], int]],
    links: tuple[cost.Link, ...],
    order: int,
) -> Candidate:
    n_in = len(in_specs)
    inputs = tuple(tuple(r.inputs[k] for r in combo) for k in range(n_in))
    outputs = tuple(tuple(r.outputs[min(k, len(r.outputs) - 1)] for r in combo) for k in range(len(out_shapes)))
    algos = [r.algorithm for r in combo if r.algorithm is not None]
    redist = sum(estimate_redistribution(spec, target, links) for spec, target in zip(in_specs, inputs))
    mesh_shape = in_specs[0].mesh.shape
    internal = comm_time(combo, mesh_shape, links)
    pending = 0.0
    for (shape, itemsize), pl in zip(out_shapes, outputs):
        local = math.prod(shape) * itemsize / max(math.prod(n for n, p in zip(mesh_shape, pl) if p.is_shard()), 1)
        pending += sum(resolve_time(shape, local, mesh_shape[i], links[i]) for i, p in enumerate(pl) if p.is_partial())
    changes = sum(a != b for spec, target in zip(in_specs, inputs) for a, b in zip(spec.placements, target))
    compute = _compute_time(in_specs, inputs, out_shapes, outputs, links)
    return Candidate(inputs, outputs, algos[0] if algos else None, combo, (), redist, internal, pending, order, changes, compute)


def _local_bytes(shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int], placements: Sequence[Placement]) -> float:
    return math.prod(shape) * itemsize / max(math.prod(n for n, p in zip(mesh_shape, placements) if p.is_shard()), 1)


def _compute_time(in_specs, inputs, out_shapes, outputs, links) -> float:
    """The redundant local work a candidate creates by gathering a sharded input.

    After a Shard -> Replicate move every rank runs the kernel on the whole gathered
    data: priced at the device's streaming rate. Layouts kept as they are (shards,
    pending partials, replicas) add nothing here, so the design's tie rules stand.
    """
    mesh_shape = in_specs[0].mesh.shape
    total = 0.0
    for spec, target in zip(in_specs, inputs):
        if any(a.is_shard() and b.is_replicate() for a, b in zip(spec.placements, target)):
            total += _local_bytes(spec.shape, spec.itemsize, mesh_shape, target)
    return total / min(link.compute for link in links)


def with_plans(c: Candidate, in_specs: Sequence[TensorSpec], links=None) -> Candidate:
    """The candidate with its exact redistribution plans (and their estimated time)."""
    plans = tuple(plan(spec, target, links) for spec, target in zip(in_specs, c.inputs))
    c.plans = plans
    c.redistribute_time = sum(p.time for p in plans)
    return c


def resolve_time(shape: Sequence[int], local_bytes: float, n: int, link: cost.Link) -> float:
    """Cheapest later resolution of a pending output, priced by its bytes only.

    reduce_scatter onto a dim that can take it, else all_reduce. The latency is left
    out: a deferred resolution is not issued yet, and is often shared with other
    pending values or absorbed by a later linear op.
    """
    wire = cost.Link(0.0, link.bandwidth, link.compute)
    return cost.collective_time("reduce_scatter" if len(shape) > 0 else "all_reduce", local_bytes, n, wire)


def rank_key(c: Candidate, mesh_shape: Sequence[int]) -> tuple:
    # NOTE: times are rounded so that float noise cannot split ties differently on different ranks.
    return (round(c.time, 12), c.changes, 0 if _pending(c) else 1, -_sharding(c, mesh_shape), c.order)


_search_key = rank_key  # the search's own reference: tests may patch rank_key to force a divergence

DEFAULT_LIMIT = 1  # candidates kept when the search space is large and no limit is asked: the runtime uses the first
EXHAUSTIVE_MAX = 256  # search spaces this small are simply enumerated


class Ranked(list):
    """Candidates, cheapest first, with the size of the space they were chosen from."""

    total: int = 0  # combinations that satisfy the structural rules (filter_fn not applied)
    replicate: "Candidate | None" = None  # the all-Replicate candidate, priced, if allowed
    exhaustive: bool = False  # True: every candidate is in the list


def _check_rows(rows: Sequence[Row], n_in: int, n_out: int) -> None:
    for r in rows:
        if len(r.inputs) != n_in or (len(r.outputs) != n_out and len(r.outputs) != 1):
            raise ShardingError(f"strategy row {r} has {len(r.inputs)} inputs/{len(r.outputs)} outputs, the op has {n_in}/{n_out}")


def candidates(
    rows: Sequence[Row],
    in_specs: Sequence[TensorSpec],
    out_shapes: Sequence[tuple[Sequence[int], int]],
    links: tuple[cost.Link, ...] | None = None,
    filter_fn: Callable[[Candidate], bool] | None = None,
    limit: int | None = None,
) -> Ranked:
    """The best candidates, cheapest first (by `rank_key`).

    limit None: every candidate when the space is small (<= EXHAUSTIVE_MAX combinations),
    else the best DEFAULT_LIMIT. limit k: exactly the first k of the exhaustive ranking,
    found by the pruned search however large the mesh.
    """
    mesh = in_specs[0].mesh
    links = cost.resolve_links(links, mesh.ndim)
    _check_rows(rows, len(in_specs), len(out_shapes))
    space = (len(rows) + 1) ** mesh.ndim
    if CHOICE_HOOKS:  # verify forces algorithms: the hooks choose among every candidate
        return _hooked(all_candidates(rows, in_specs, out_shapes, links, filter_fn))
    if limit is None and space <= EXHAUSTIVE_MAX:
        return all_candidates(rows, in_specs, out_shapes, links, filter_fn)
    search = _Search(rows, in_specs, out_shapes, links)
    out = Ranked(sorted(search.best(DEFAULT_LIMIT if limit is None else limit, filter_fn), key=lambda c: rank_key(c, mesh.shape)))
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


def all_candidates(
    rows: Sequence[Row],
    in_specs: Sequence[TensorSpec],
    out_shapes: Sequence[tuple[Sequence[int], int]],
    links: tuple[cost.Link, ...] | None = None,
    filter_fn: Callable[[Candidate], bool] | None = None,
) -> Ranked:
    """Every candidate, priced and ranked: the exhaustive reference the search must equal."""
    mesh = in_specs[0].mesh
    links = cost.resolve_links(links, mesh.ndim)
    _check_rows(rows, len(in_specs), len(out_shapes))
    options = row_options(rows, len(in_specs), len(out_shapes))
    out, total, replicate = [], 0, None
    for indices in itertools.product(range(len(options)), repeat=mesh.ndim):
        combo = tuple(options[r] for r in indices)
        if len({r.algorithm for r in combo if r.algorithm is not None}) > 1 or not all(fits_mesh_dim(r, i) for i, r in enumerate(combo)):
            continue
        c = price(combo, in_specs, out_shapes, links, _order(indices, len(options)))
        if _mixed_partials(c) or _needs_norm_partial(c, in_specs):
            continue
        total += 1
        if filter_fn is None or filter_fn(c):
            out.append(c)
            if all(r == len(options) - 1 for r in indices):
                replicate = c
    ranked = Ranked(sorted(out, key=lambda c: rank_key(c, mesh.shape)))
    ranked.total, ranked.replicate, ranked.exhaustive = total, replicate, True
    return ranked


def _order(indices: Sequence[int], radix: int) -> int:
    """The combination's index in the product of row options (mesh dim 0 most significant)."""
    order = 0
    for r in indices:
        order = order * radix + r
    return order


# ------------------------------------------------------------------ the pruned search


_NO_COMM = Row((), ())  # stands in for a row whose per-dim collectives are already in the separable sum


class _Search:
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

    def __init__(self, rows, in_specs, out_shapes, links):
        self.in_specs, self.out_shapes, self.links = tuple(in_specs), tuple(out_shapes), tuple(links)
        self.mesh_shape = tuple(in_specs[0].mesh.shape)
        self.n_in, self.n_out = len(in_specs), len(out_shapes)
        self.options = row_options(rows, self.n_in, self.n_out)
        self.radix = len(self.options)
        ndim = len(self.mesh_shape)
        self.tuples = [r.inputs + tuple(r.outputs[min(k, len(r.outputs) - 1)] for k in range(self.n_out)) for r in self.options]
        src_local = self.src_local = [_source_local_bytes(spec) for spec in in_specs]
        self.in_bytes = [math.prod(spec.shape) * spec.itemsize for spec in in_specs]
        self.out_bytes = [math.prod(shape) * itemsize for shape, itemsize in out_shapes]
        self.compute_rate = min(link.compute for link in links)
        self._comm_memo: dict[tuple, float] = {}
        # per mesh dim, per row option
        self.valid, self.sep, self.floor, self.changes, self.pend_coef = [], [], [], [], []
        for i in range(ndim):
            n, link = self.mesh_shape[i], links[i]
            valid, sep, floor, changes, pend = [], [], [], [], []
            for index, r in enumerate(self.options):
                srcs = [spec.placements[i] for spec in in_specs]
                valid.append(fits_mesh_dim(r, i) and not any(isinstance(t, NormPartial) and t != a for a, t in zip(srcs, r.inputs)))
                moves = sum(_redistribution_term(a, t, loc, n, link) for a, t, loc in zip(srcs, r.inputs, src_local))
                lat = 0.0
                if r.algorithm is None:
                    moves += sum(cost.collective_time(kind, _gathered(kind, b, n), n, link) for kind, b in r.comm)
                elif n > 1:
                    lat = sum((2 if kind == "all_reduce" else 1) * (n - 1) * link.latency for kind, _ in {(k, float(b)) for k, b in r.comm})
                sep.append(moves)
                floor.append(lat)
                changes.append(sum(a != t for a, t in zip(srcs, r.inputs)))
                # resolve_time per byte of a pending output on this dim
                pend.append([
                    (2 if len(shape) == 0 else 1) * (n - 1) / n / link.bandwidth if n > 1 and p.is_partial() else 0.0
                    for (shape, _), p in zip(out_shapes, self.tuples[index][self.n_in :])
                ])
            self.valid.append(valid)
            self.sep.append(sep)
            self.floor.append(floor)
            self.changes.append(changes)
            self.pend_coef.append(pend)
        # suffix bounds: index j covers mesh dims j..ndim-1
        n_tuples = self.n_in + self.n_out
        self.rest_time = [0.0] * (ndim + 1)
        self.rest_changes = [0] * (ndim + 1)
        self.rest_shard = [[1] * n_tuples for _ in range(ndim + 1)]
        self.rest_pending = [False] * (ndim + 1)
        for i in reversed(range(ndim)):
            ok = [r for r in range(self.radix) if self.valid[i][r]]
            self.rest_time[i] = self.rest_time[i + 1] + min((self.sep[i][r] + self.floor[i][r] for r in ok), default=0.0)
            self.rest_changes[i] = self.rest_changes[i + 1] + min((self.changes[i][r] for r in ok), default=0)
            self.rest_pending[i] = self.rest_pending[i + 1] or any(p.is_partial() for r in ok for p in self.tuples[r][self.n_in:])
            self.rest_shard[i] = [
                m * (self.mesh_shape[i] if any(self.tuples[r][t].is_shard() for r in ok) else 1) for t, m in enumerate(self.rest_shard[i + 1])
            ]

    # ---------------------------------------------------------------- states

    def _child(self, state, r: int):
        """The prefix `state` extended by row r on the next mesh dim; None if no completion is valid."""
        indices, sep, changes, algo, partials, shards, gathers, pend, guarded = state
        i = len(indices)
        if not self.valid[i][r]:
            return None
        row = self.options[r]
        if row.algorithm is not None:
            if algo is not None and algo != row.algorithm:
                return None
            algo = row.algorithm
        placed = self.tuples[r]
        new_partials = list(partials)
        for t, p in enumerate(placed):
            if p.is_partial():
                if partials[t] is None:
                    new_partials[t] = p
                elif partials[t] != p:
                    return None
        n = self.mesh_shape[i]
        new_shards = tuple(m * n if p.is_shard() else m for m, p in zip(shards, placed))
        new_gathers = tuple(g or (spec.placements[i].is_shard() and p.is_replicate()) for g, spec, p in zip(gathers, self.in_specs, placed))
        new_pend = tuple(a + b for a, b in zip(pend, self.pend_coef[i][r]))
        # nesting: earlier mesh dims' moves are known now, so this dim's forced gathers are exact
        unblock, new_guarded = 0.0, []
        for k, (spec, g, b) in enumerate(zip(self.in_specs, guarded, row.inputs)):
            a = spec.placements[i]
            unblock += _unblock_term(g, a, b, self.src_local[k], n, self.links[i])
            new_guarded.append(g | _move_guard(a, b))
        return (indices + (r,), sep + self.sep[i][r] + unblock, changes + self.changes[i][r], algo, tuple(new_partials), new_shards, new_gathers,
                new_pend, tuple(new_guarded))

    def _bound(self, state) -> tuple:
        indices, sep, changes, algo, partials, shards, gathers, pend, _ = state
        j = len(indices)
        rest = self.rest_shard[j]
        time = sep + self.rest_time[j]
        time += self._joint_comm(indices)
        for k in range(self.n_out):
            t = self.n_in + k
            time += pend[k] * self.out_bytes[k] / (shards[t] * rest[t])
        time += sum(b / (shards[k] * rest[k]) for k, b in enumerate(self.in_bytes) if gathers[k]) / self.compute_rate
        pending = 0 if any(p is not None for p in partials[self.n_in :]) or self.rest_pending[j] else 1
        sharding = sum(m * rest[t] for t, m in enumerate(shards))
        order = _order(indices + (0,) * (len(self.mesh_shape) - j), self.radix)
        return (round(time * (1 - 1e-9), 12), changes + self.rest_changes[j], pending, -sharding, order)

    def _joint_comm(self, indices) -> float:
        """The joint collectives of the prefix's algorithm rows (memoised: most prefixes share them)."""
        key = tuple((i, r) for i, r in enumerate(indices) if self.options[r].algorithm is not None and self.options[r].comm)
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
        n_tuples = self.n_in + self.n_out
        root = ((), 0.0, 0, None, (None,) * n_tuples, (1,) * n_tuples, (False,) * self.n_in, (0.0,) * self.n_out, (frozenset(),) * self.n_in)
        tick = itertools.count()
        heap = [(self._bound(root), 1, next(tick), root)]
        out: list[Candidate] = []
        while heap and len(out) < limit:
            _, kind, _, item = heapq.heappop(heap)
            if kind == 0:  # a priced candidate: nothing left in the heap can rank before it
                out.append(item)
                continue
            if len(item[0]) == ndim:
                c = self._price(item[0])
                if filter_fn is None or filter_fn(c):
                    heapq.heappush(heap, (_search_key(c, self.mesh_shape), 0, next(tick), c))
                continue
            for r in range(self.radix):
                child = self._child(item, r)
                if child is not None:
                    heapq.heappush(heap, (self._bound(child), 1, next(tick), child))
        return out

    def _price(self, indices: Sequence[int]) -> Candidate:
        combo = tuple(self.options[r] for r in indices)
        return price(combo, self.in_specs, self.out_shapes, self.links, _order(indices, self.radix))

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
                    if not self.valid[i][r] or (row.algorithm is not None and algo is not None and row.algorithm != algo):
                        continue
                    new = list(partials)
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
