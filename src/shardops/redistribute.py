"""Redistribution: the cheapest sequence of one-mesh-dim steps between two layouts.

A state is a placement tuple. A step changes the placement of one mesh dim:

    S/_S -> R        all_gather          P -> R      all_reduce
    S(a) -> S(b)     all_to_all          P -> S(d)   reduce_scatter
    R -> S(d)        local slice         R -> P(op)  local (zeros/ones off the source)

A step that touches tensor dim d on mesh dim i is allowed only while no mesh dim
after i shards d: shards nest left to right, so the innermost level must be
undone first (this is also why torch gathers right to left). Dijkstra over these
states under the link model gives the plan; all-Replicate is always reachable,
so a plan always exists (NormPartial is a source only).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from . import cost
from .comm.base import CommDebugMode
from .errors import ShardingError
from .placements import NormPartial, Partial, Placement, Replicate, Shard, StridedShard, dim_positions, shard_positions
from .spec import TensorSpec


@dataclass(frozen=True)
class Step:
    kind: str  # all_gather | all_reduce | reduce_scatter | all_to_all | slice | partition
    mesh_dim: int
    src: Placement
    dst: Placement

    @property
    def collective(self) -> str | None:
        return None if self.kind in ("slice", "partition") else self.kind

    def __repr__(self) -> str:
        return f"{self.kind}[mesh {self.mesh_dim}] {self.src!r}->{self.dst!r}"


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


def _blocked(state: Sequence[Placement], mesh_dim: int, tensor_dim: int) -> bool:
    return any(p.is_shard(tensor_dim) for p in state[mesh_dim + 1 :])


def _step_kind(state: tuple[Placement, ...], i: int, dst: Placement) -> str | None:
    src = state[i]
    if src == dst:
        return None
    if src.is_shard():
        if _blocked(state, i, src.dim):
            return None
        if dst.is_replicate():
            return "all_gather"
        if dst.is_shard() and dst.dim != src.dim and not _blocked(state, i, dst.dim):
            return "all_to_all"
        return None
    if src.is_partial():
        if dst.is_replicate():
            return "all_reduce"
        if dst.is_shard() and not _blocked(state, i, dst.dim):
            return "reduce_scatter"
        return None
    # Replicate source
    if dst.is_shard():
        return None if _blocked(state, i, dst.dim) else "slice"
    if isinstance(dst, Partial):
        return "partition"
    return None


def _local_numel(shape: Sequence[int], mesh_shape: Sequence[int], state: Sequence[Placement]) -> float:
    """Average local element count: exact enough for costs, the same on every rank."""
    parts = math.prod(n for n, p in zip(mesh_shape, state) if p.is_shard())
    return math.prod(shape) / max(parts, 1)


def _step_time(kind: str, i: int, state, shape, mesh_shape, itemsize, links) -> float:
    n = mesh_shape[i]
    local = _local_numel(shape, mesh_shape, state) * itemsize
    if kind == "all_gather":
        return cost.collective_time(kind, local * n, n, links[i])
    if kind in ("all_reduce", "reduce_scatter", "all_to_all"):
        return cost.collective_time(kind, local, n, links[i])
    return 0.0


@lru_cache(maxsize=4096)
def _plan_cached(src, dst, shape, mesh_shape, itemsize, links, _epoch) -> Plan:
    ndim_mesh = len(mesh_shape)
    choices = []
    shard_dims = sorted({p.dim for p in src + dst if p.is_shard()})
    for i in range(ndim_mesh):
        opts = {src[i], dst[i], Replicate()} | {Shard(d) for d in shard_dims}
        choices.append(sorted(opts, key=repr))
    # Dijkstra; ties broken by step count then by the states' reprs (deterministic).
    start = (0.0, 0, repr(src), src, ())
    best: dict[tuple, tuple[float, int]] = {src: (0.0, 0)}
    heap = [start]
    while heap:
        t, nsteps, _, state, steps = heapq.heappop(heap)
        if state == dst:
            return Plan(src, dst, steps, t)
        if best.get(state, (math.inf, 0)) < (t, nsteps):
            continue
        for i in range(ndim_mesh):
            for p in choices[i]:
                kind = _step_kind(state, i, p)
                if kind is None:
                    continue
                nxt = state[:i] + (p,) + state[i + 1 :]
                nt = t + _step_time(kind, i, state, shape, mesh_shape, itemsize, links)
                key = (nt, nsteps + 1)
                if key < best.get(nxt, (math.inf, 0)):
                    best[nxt] = key
                    heapq.heappush(heap, (nt, nsteps + 1, repr(nxt), nxt, steps + (Step(kind, i, state[i], p),)))
    raise ShardingError(f"redistribute: no way from {list(src)} to {list(dst)} (NormPartial can only be a source)")


def plan(spec: TensorSpec, dst: Sequence[Placement], links=None) -> Plan:
    links = cost.resolve_links(links, spec.mesh.ndim)
    return _plan_cached(tuple(spec.placements), tuple(dst), tuple(spec.shape), tuple(spec.mesh.shape), spec.itemsize, links, cost._CACHE_EPOCH[0])


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

    index helper (issue 14): such a norm is resolved one canonical way whatever the plan (all_reduce
    dim by dim, or reduce_scatter first): p-th powers, one sum over the joint group, one root. Nested
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


def _norm_pre(x: torch.Tensor, p: NormPartial) -> tuple[torch.Tensor, str]:
    q = p.norm_type
    if q in (0.0, 1.0) or math.isinf(q):
        return x, p.combine_op
    return (x * x if q == 2.0 else x.pow(q)), "sum"


def _norm_post(x: torch.Tensor, p: NormPartial) -> torch.Tensor:
    q = p.norm_type
    if q in (0.0, 1.0) or math.isinf(q):
        return x
    return x.sqrt() if q == 2.0 else x.pow(1.0 / q)


def _partition(x: torch.Tensor, op: str, coord: int) -> torch.Tensor:
    if op in ("avg", "max", "min") or coord == 0:
        return x
    return torch.ones_like(x) if op == "product" else torch.zeros_like(x)


def execute(local: torch.Tensor, spec: TensorSpec, p: Plan) -> torch.Tensor:
    """Run plan `p` on this rank's shard of `spec`; returns the new local shard."""
    mesh = spec.mesh
    comm = mesh.comm
    coordinate = mesh.get_coordinate()
    x = materialize_lazy_bits(local) if p.steps else local
    joint = _joint_norm_resolution(spec, p)
    if joint is not None:
        norm_dims, p = joint
        pre, op = _norm_pre(x, spec.placements[norm_dims[0]])
        x = _norm_post(comm.all_reduce(pre, op, mesh.group(norm_dims)), spec.placements[norm_dims[0]])
    state = list(p.src)
    for step in p.steps:
        i, n = step.mesh_dim, mesh.shape[step.mesh_dim]
        group = mesh.group(i)
        me = coordinate[i]
        if step.kind == "slice":
            x = _take(x, step.dst.dim, shard_positions(step.dst, x.shape[step.dst.dim], n, me))
        elif step.kind == "partition":
            x = _partition(x, step.dst.reduce_op, me)
        elif step.kind == "all_gather":
            d = step.src.dim
            shapes = [_member_shape(spec, coordinate, state, i, c) for c in range(n)]
            x = _assemble(comm.all_gather(x, group, shapes), d, step.src)
        elif step.kind == "all_reduce":
            x = _all_reduce_partial(comm, x, step.src, group)
        elif step.kind == "reduce_scatter":
            chunks = _split(x, step.dst.dim, step.dst, n)
            x = _reduce_scatter_partial(comm, chunks, step.src, group)
        elif step.kind == "all_to_all":
            a, b = step.src.dim, step.dst.dim
            chunks = _split(x, b, step.dst, n)
            recv = []
            for c in range(n):
                s = list(_member_shape(spec, coordinate, state, i, c))
                s[b] = chunks[me].shape[b]
                recv.append(tuple(s))
            x = _assemble(comm.all_to_all(chunks, group, recv), a, step.src)
        state[i] = step.dst
    return x


def _member_shape(spec: TensorSpec, coordinate: Sequence[int], state: Sequence[Placement], mesh_dim: int, c: int) -> tuple[int, ...]:
    coord = list(coordinate)
    coord[mesh_dim] = c
    return tuple(_local_shape(spec.shape, spec.mesh.shape, coord, state))


def _all_reduce_partial(comm, x: torch.Tensor, src: Placement, group) -> torch.Tensor:
    if isinstance(src, NormPartial):
        pre, op = _norm_pre(x, src)
        return _norm_post(comm.all_reduce(pre, op, group), src)
    return comm.all_reduce(x, src.reduce_op, group)


def _reduce_scatter_partial(comm, chunks, src: Placement, group) -> torch.Tensor:
    if isinstance(src, NormPartial):
        pres = [_norm_pre(c, src)[0] for c in chunks]
        return _norm_post(comm.reduce_scatter(pres, _norm_pre(chunks[0], src)[1], group), src)
    return comm.reduce_scatter(chunks, src.reduce_op, group)


# ------------------------------------------------------------------ public


def redistribute_local(local: torch.Tensor, spec: TensorSpec, dst: Sequence[Placement]) -> torch.Tensor:
    if tuple(dst) == tuple(spec.placements):
        return local
    return execute(local, spec, plan(spec, dst))


__all__ = ["Plan", "Step", "plan", "plan_bytes", "execute", "redistribute_local", "CommDebugMode"]
