"""Redistribution: the cheapest sequence of one-mesh-dim steps between two layouts.

A state is a placement tuple. A step changes the placement of one mesh dim:

    S/_S -> R        all_gather          P -> R      all_reduce
    S(a) -> S(b)     all_to_all          P -> S(d)   reduce_scatter
    R -> S(d)        local slice         R -> P(op)  local (zeros/ones off the source)

and one step changes several: the same pending partial on mesh dims D -> R on all of
them is ONE all_reduce over the group spanning D (one round, the input sent once;
priced by cost.joint_collective_time), not one all_reduce per mesh dim.

A step that touches tensor dim d on mesh dim i is allowed only while no mesh dim
after i shards d: shards nest left to right, so the innermost level must be
undone first (this is also why torch gathers right to left). Dijkstra over these
states under the link model gives the plan; all-Replicate is always reachable,
so a plan always exists (NormPartial is a source only).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import caches, cost
from .comm.base import CommDebugMode
from .cost import joint_collective_time, step_time
from .errors import ShardingError
from .placements import (
    NormPartial,
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    as_partial,
    as_shard,
    dim_positions,
    shard_positions,
)
from .spec import TensorSpec


@dataclass(frozen=True)
class Step:
    kind: str  # all_gather | all_reduce | reduce_scatter | all_to_all | slice | partition
    mesh_dim: int
    src: Placement
    dst: Placement
    # A joint all_reduce: the same pending partial on several mesh dims resolved in ONE
    # collective over the group spanning them (all of them go src -> dst). Empty: just mesh_dim.
    joint: tuple[int, ...] = ()

    @property
    def collective(self) -> str | None:
        return None if self.kind in ("slice", "partition") else self.kind

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        return self.joint or (self.mesh_dim,)

    def __repr__(self) -> str:
        return f"{self.kind}[mesh {'+'.join(map(str, self.mesh_dims))}] {self.src!r}->{self.dst!r}"


@dataclass(frozen=True)
class Plan:
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    steps: tuple[Step, ...]
    time: float  # estimated seconds under the link model

    @property
    def rounds(self) -> int:
        return sum(1 for s in self.steps if s.collective)

    def collectives(self) -> list[str]:
        return [s.kind for s in self.steps if s.collective]


# ------------------------------------------------------------------ planning


def _joint_reductions(state: tuple[Placement, ...]) -> list[tuple[int, ...]]:
    """Sets of >= 2 mesh dims holding the same pending partial: each may resolve in one all_reduce."""
    by_partial: dict[Placement, list[int]] = {}
    for i, p in enumerate(state):
        if p.is_partial():
            by_partial.setdefault(p, []).append(i)
    out: list[tuple[int, ...]] = []
    for dims in by_partial.values():
        for size in range(2, len(dims) + 1):
            out += itertools.combinations(dims, size)
    return out


@lru_cache(maxsize=4096)
def _plan_cached(src, dst, shape, mesh_shape, itemsize, links, _epoch) -> Plan:
    """Dijkstra over placement states; ties broken by step count then by the states' reprs.

    The graph depends on the source and on the placements each mesh dim may take (its
    source and target placements, R, and a shard of every tensor dim either shards), not
    on the target itself. So one search per graph is kept and resumed: plans from one
    source to several targets (explain's candidates, an op's inputs) settle the states
    once, and each answer is what a fresh search for that target would return (the pop
    order does not depend on where a search stops).
    """
    shard_dims = sorted({p.dim for p in src + dst if p.is_shard()})
    choices = tuple(
        tuple(sorted({src[i], dst[i], Replicate()} | {Shard(d) for d in shard_dims}, key=repr))
        for i in range(len(mesh_shape))
    )
    key = (src, choices, math.prod(shape), itemsize, mesh_shape, links, _epoch)
    with _SEARCH_LOCK:  # the ranks of the threads world plan at the same time, and a search is resumed in place
        search = _SEARCHES.get(key)
        if search is None:
            if len(_SEARCHES) >= _MAX_SEARCHES:
                _SEARCHES.pop(next(iter(_SEARCHES)))  # the oldest: searches are cheap to redo
            search = _SEARCHES[key] = _PlanSearch(src, choices, math.prod(shape), itemsize, mesh_shape, links)
        return search.plan_to(dst)


_SEARCHES: dict[tuple, _PlanSearch] = {}
_MAX_SEARCHES = 256
_SEARCH_LOCK = threading.Lock()


def clear_plan_cache() -> None:
    """Forget every plan and search (caches.invalidate calls this)."""
    _plan_cached.cache_clear()
    _SEARCHES.clear()


caches.register("redistribution plans", clear_plan_cache)


class _PlanSearch:
    """A Dijkstra from one source over one graph, run only as far as the targets asked so far.

    Placements are numbered and every (from, to) pair's step kind is tabled once, so the
    inner loop is integer work: a 4-D mesh has a few hundred states and thousands of
    transitions. The per-state work (local size, which tensor dims later mesh dims shard,
    the repr for ties) is done once per state.
    """

    def __init__(self, src, choices, numel, itemsize, mesh_shape, links) -> None:
        self.src, self.mesh_shape, self.links, self.numel, self.itemsize = src, mesh_shape, links, numel, itemsize
        placements = sorted({p for c in choices for p in c}, key=repr)
        self.placements = placements
        self.index = {p: k for k, p in enumerate(placements)}
        self.choices = [sorted(self.index[p] for p in c) for c in choices]
        self.table = {
            (a, b): _kind_and_guard(placements[a], placements[b])
            for a in range(len(placements))
            for b in range(len(placements))
        }
        self.shard_of = [p.dim if p.is_shard() else None for p in placements]
        self.partial = [p.is_partial() for p in placements]
        self.texts = [repr(p) for p in placements]
        self.replicate = self.index[Replicate()]
        self.start = tuple(self.index[p] for p in src)
        self.best: dict[tuple, tuple[float, int]] = {self.start: (0.0, 0)}
        self.came_from: dict[tuple, tuple[tuple, tuple]] = {}
        self.settled: dict[tuple, float] = {}
        self.names: dict[tuple, str] = {}
        self.step_times: dict[tuple, float] = {}  # (kind, mesh dim, shard count): the same for many states
        self.heap = [(0.0, 0, self._name(self.start), self.start)]

    def _name(self, state: tuple[int, ...]) -> str:  # the repr of the placement tuple: ties break as they always have
        text = self.names.get(state)
        if text is None:
            text = self.names[state] = (
                "(" + ", ".join(self.texts[k] for k in state) + ("," if len(state) == 1 else "") + ")"
            )
        return text

    def plan_to(self, dst) -> Plan:
        goal = tuple(self.index[p] for p in dst)
        while goal not in self.settled:
            if not self.heap:
                raise ShardingError(
                    f"redistribute: no way from {list(self.src)} to {list(dst)} (NormPartial can only be a source)"
                )
            t, nsteps, _, state = heapq.heappop(self.heap)
            if state in self.settled or self.best[state] < (t, nsteps):
                continue
            self.settled[state] = t
            self._expand(state, t, nsteps)
        return Plan(self.src, tuple(dst), _path(self.came_from, self.start, goal, self.placements), self.settled[goal])

    def _expand(self, state, t, nsteps) -> None:
        mesh_shape, links = self.mesh_shape, self.links
        last = {}  # innermost mesh dim sharding each tensor dim: a step on mesh dim i touching d needs last[d] <= i
        parts = 1
        for i, k in enumerate(state):
            d = self.shard_of[k]
            if d is not None:
                last[d] = i
                parts *= mesh_shape[i]
        local = self.numel / parts * self.itemsize
        moves: list[tuple[str, tuple[int, ...], int, float]] = []
        times = self.step_times
        for i, options in enumerate(self.choices):
            a = state[i]
            for b in options:
                kind, guard = self.table[(a, b)]
                if kind is None or any(last.get(d, -1) > i for d in guard):
                    continue
                dt = times.get((kind, i, parts))
                if dt is None:
                    dt = times[(kind, i, parts)] = step_time(kind, local, mesh_shape[i], links[i])
                moves.append((kind, (i,), b, dt))
        if sum(self.partial[k] for k in state) >= 2:
            for dims in _joint_reductions(tuple(self.placements[k] for k in state)):
                sizes = [mesh_shape[i] for i in dims]
                moves.append(
                    (
                        "all_reduce",
                        dims,
                        self.replicate,
                        joint_collective_time("all_reduce", local, sizes, [links[i] for i in dims]),
                    )
                )
        best = self.best
        for kind, dims, b, dt in moves:
            moved = list(state)
            for i in dims:
                moved[i] = b
            nxt = tuple(moved)
            key = (t + dt, nsteps + 1)
            if key < best.get(nxt, (math.inf, 0)):
                best[nxt] = key
                self.came_from[nxt] = (state, (kind, dims))
                heapq.heappush(self.heap, (key[0], key[1], self._name(nxt), nxt))


def _kind_and_guard(src: Placement, dst: Placement) -> tuple[str | None, tuple[int, ...]]:
    """The one-mesh-dim step src -> dst, and the tensor dims no later mesh dim may shard for it
    (shards nest left to right: the innermost level is undone first)."""
    if src == dst:
        return None, ()
    if isinstance(src, (Shard, StridedShard)):
        if dst.is_replicate():
            return "all_gather", (src.dim,)
        if isinstance(dst, (Shard, StridedShard)) and dst.dim != src.dim:
            return "all_to_all", (src.dim, dst.dim)
        return None, ()
    if src.is_partial():
        if dst.is_replicate():
            return "all_reduce", ()
        if isinstance(dst, (Shard, StridedShard)):
            return "reduce_scatter", (dst.dim,)
        return None, ()
    if isinstance(dst, (Shard, StridedShard)):
        return "slice", (dst.dim,)
    if isinstance(dst, Partial) and dst.reachable:
        return "partition", ()
    return None, ()


def _path(came_from, start, goal, placements) -> tuple[Step, ...]:
    steps = []
    state = goal
    while state != start:
        prev, (kind, dims) = came_from[state]
        steps.append(
            Step(kind, dims[0], placements[prev[dims[0]]], placements[state[dims[0]]], dims if len(dims) > 1 else ())
        )
        state = prev
    return tuple(reversed(steps))


def plan(spec: TensorSpec, dst: Sequence[Placement], links=None) -> Plan:
    links = cost.resolve_links(links, spec.mesh.ndim)
    return _plan_cached(
        tuple(spec.placements),
        tuple(dst),
        tuple(spec.shape),
        tuple(spec.mesh.shape),
        spec.itemsize,
        links,
        caches.EPOCH[0],
    )


def materialize_lazy_bits(t: torch.Tensor) -> torch.Tensor:
    """`t` without a lazy conjugate / negative bit, values unchanged.

    Inside __torch_dispatch__ torch excludes its Conjugate and Negative keys, so a kernel that
    does not handle the bits itself (cat in a collective, index_select in an algorithm) would
    read the raw values. copy_ handles both bits in the kernel, whatever the dispatch state.
    """
    if not (t.is_conj() or t.is_neg()):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _joint_norm_resolution(spec: TensorSpec, p: Plan) -> tuple[tuple[int, ...], Plan] | None:
    """(mesh dims, plan for the rest) where a norm pending on several mesh dims is resolved at once.

    Such a norm is resolved one canonical way whatever the plan (all_reduce dim by dim, or
    reduce_scatter first): p-th powers, one sum over the joint group, one root. Nested
    roots would round differently on each path, and two reads of one pending norm would disagree.
    """
    norm_dims = tuple(i for i, s in enumerate(p.src) if isinstance(s, NormPartial))
    if len(norm_dims) < 2 or any(isinstance(d, NormPartial) for d in p.dst):
        return None
    resolved = tuple(Replicate() if i in norm_dims else s for i, s in enumerate(p.src))
    return norm_dims, plan(spec.with_placements(resolved), p.dst)


def plan_bytes(spec: TensorSpec, p: Plan, coordinate: Sequence[int]) -> int:
    """Logical bytes this coordinate puts into the plan's collectives (what CommDebugMode counts)."""
    mesh_shape = spec.mesh.shape
    joint = _joint_norm_resolution(spec, p)
    if joint is not None:
        norm_dims, rest = joint
        local = math.prod(_local_shape(spec.shape, mesh_shape, coordinate, list(p.src))) * spec.itemsize
        first = local if math.prod(mesh_shape[i] for i in norm_dims) > 1 else 0
        return first + plan_bytes(spec.with_placements(rest.src), rest, coordinate)
    total, state = 0, list(p.src)
    for step in p.steps:
        local = math.prod(_local_shape(spec.shape, mesh_shape, coordinate, state)) * spec.itemsize
        if step.joint:  # one all_reduce over the group spanning the dims: the input counted once
            total += local if math.prod(mesh_shape[i] for i in step.joint) > 1 else 0
            for i in step.joint:
                state[i] = step.dst
            continue
        if step.kind in ("all_gather", "all_reduce", "reduce_scatter"):
            total += local if mesh_shape[step.mesh_dim] > 1 else 0
        elif step.kind == "all_to_all" and mesh_shape[step.mesh_dim] > 1:
            nxt = state[: step.mesh_dim] + [step.dst] + state[step.mesh_dim + 1 :]
            kept = _a2a_kept_numel(spec.shape, mesh_shape, coordinate, state, nxt, step)
            total += local - kept * spec.itemsize
        state[step.mesh_dim] = step.dst
    return total


def _local_shape(shape, mesh_shape, coordinate, placements) -> list[int]:
    return [len(dim_positions(shape[d], d, mesh_shape, coordinate, placements)) for d in range(len(shape))]


def _a2a_kept_numel(shape, mesh_shape, coordinate, before, after, step) -> int:
    """Elements this rank keeps for itself in an all_to_all: its own chunk of its own shard."""
    local_after = _local_shape(shape, mesh_shape, coordinate, after)
    local_before = _local_shape(shape, mesh_shape, coordinate, before)
    kept = list(local_before)
    kept[step.dst.dim] = local_after[step.dst.dim]
    return math.prod(kept)


# ------------------------------------------------------------------ execution


def _take(x: torch.Tensor, dim: int, positions: range | list[int]) -> torch.Tensor:
    if isinstance(positions, range):
        return x.narrow(dim, positions.start, len(positions))
    return x.index_select(dim, torch.tensor(positions, dtype=torch.long, device=x.device))


def _split(x: torch.Tensor, dim: int, placement: Placement, n: int) -> list[torch.Tensor]:
    length = x.shape[dim]
    return [_take(x, dim, shard_positions(placement, length, n, c)) for c in range(n)]


def _assemble(pieces: Sequence[torch.Tensor], dim: int, placement: Placement) -> torch.Tensor:
    """Inverse of _split: concatenate member pieces, then undo a strided order."""
    out = torch.cat(list(pieces), dim=dim)
    if isinstance(placement, StridedShard) and placement.split_factor > 1:
        n, length = len(pieces), out.shape[dim]
        order = [i for c in range(n) for i in shard_positions(placement, length, n, c)]
        inverse = torch.empty(length, dtype=torch.long)
        inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(length)
        out = out.index_select(dim, inverse.to(out.device))
    return out


def execute(local: torch.Tensor, spec: TensorSpec, p: Plan) -> torch.Tensor:
    """Run plan `p` on this rank's shard of `spec`; returns the new local shard."""
    mesh = spec.mesh
    comm = mesh.comm
    coordinate = mesh.get_coordinate() or []  # [] off the mesh, where a plan has no step to run
    x = materialize_lazy_bits(local) if p.steps else local
    joint = _joint_norm_resolution(spec, p)
    if joint is not None:
        norm_dims, p = joint
        x = _all_reduce_partial(comm, x, as_partial(spec.placements[norm_dims[0]]), mesh.group(norm_dims))
    state = list(p.src)
    for step in p.steps:
        if step.joint:  # the same pending partial on several mesh dims: one all_reduce over their joint group
            x = _all_reduce_partial(comm, x, as_partial(step.src), mesh.group(step.joint))
            for i in step.joint:
                state[i] = step.dst
            continue
        i, n = step.mesh_dim, mesh.shape[step.mesh_dim]
        group = mesh.group(i)
        me = coordinate[i]
        if step.kind == "slice":
            dst = as_shard(step.dst)
            x = _take(x, dst.dim, shard_positions(dst, x.shape[dst.dim], n, me))
        elif step.kind == "partition":
            x = as_partial(step.dst).split(x, me)
        elif step.kind == "all_gather":
            d = as_shard(step.src).dim
            shapes = [_member_shape(spec, coordinate, state, i, c) for c in range(n)]
            x = _assemble(comm.all_gather(x, group, shapes), d, step.src)
        elif step.kind == "all_reduce":
            x = _all_reduce_partial(comm, x, as_partial(step.src), group)
        elif step.kind == "reduce_scatter":
            chunks = _split(x, as_shard(step.dst).dim, step.dst, n)
            x = _reduce_scatter_partial(comm, chunks, as_partial(step.src), group)
        elif step.kind == "all_to_all":
            a, b = as_shard(step.src).dim, as_shard(step.dst).dim
            chunks = _split(x, b, step.dst, n)
            recv = []
            for c in range(n):
                s = list(_member_shape(spec, coordinate, state, i, c))
                s[b] = chunks[me].shape[b]
                recv.append(tuple(s))
            x = _assemble(comm.all_to_all(chunks, group, recv), a, step.src)
        state[i] = step.dst
    # A slice of a non-leading dim leaves a strided view, and some of torch's CPU kernels
    # (native_layer_norm_backward's mean/rstd) read their inputs as contiguous, as torch's
    # DTensor shards are. The copy is paid only then: collectives already return fresh
    # contiguous tensors and a leading-dim slice is contiguous.
    return x if x.is_contiguous() else x.contiguous()


def _member_shape(
    spec: TensorSpec, coordinate: Sequence[int], state: Sequence[Placement], mesh_dim: int, c: int
) -> tuple[int, ...]:
    coord = list(coordinate)
    coord[mesh_dim] = c
    return tuple(_local_shape(spec.shape, spec.mesh.shape, coord, state))


def _all_reduce_partial(comm, x: torch.Tensor, src: Partial, group) -> torch.Tensor:
    return src.from_wire(comm.all_reduce(src.to_wire(x), src.wire_op, group))


def _reduce_scatter_partial(comm, chunks, src: Partial, group) -> torch.Tensor:
    return src.from_wire(comm.reduce_scatter([src.to_wire(c) for c in chunks], src.wire_op, group))


# ------------------------------------------------------------------ public


def redistribute_local(local: torch.Tensor, spec: TensorSpec, dst: Sequence[Placement]) -> torch.Tensor:
    if tuple(dst) == tuple(spec.placements):
        return local
    return execute(local, spec, plan(spec, dst))


__all__ = ["Plan", "Step", "plan", "plan_bytes", "execute", "redistribute_local", "CommDebugMode"]
