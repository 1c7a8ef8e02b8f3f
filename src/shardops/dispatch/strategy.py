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
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .. import cost
from ..errors import ShardingError
from ..placements import NormPartial, Placement, Replicate
from ..redistribute import Plan, plan
from ..spec import TensorSpec

R = Replicate()


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


def expand(
    rows: Sequence[Row],
    n_inputs: int,
    n_outputs: int,
    mesh_ndim: int,
) -> list[tuple[Row, ...]]:
    """Every combination of one row per mesh dim (the implicit all-R row included)."""
    replicate = Row((R,) * max(n_outputs, 1), (R,) * n_inputs)
    per_dim = [[r for r in rows if r.mesh_dim in (None, i)] + [replicate] for i in range(mesh_ndim)]
    combos = []
    for combo in itertools.product(*per_dim):
        algos = {r.algorithm for r in combo if r.algorithm is not None}
        if len(algos) <= 1:
            combos.append(combo)
    return combos


def estimate_redistribution(spec: TensorSpec, target: Sequence[Placement], links: tuple[cost.Link, ...]) -> float:
    """Per-mesh-dim estimate of moving `spec` to `target`: each dim priced on its own.

    Exact when no two mesh dims shard the same tensor dim; the executed plan is the
    exact shortest path (redistribute.plan). Linear in mesh ndim, so pricing every
    candidate stays cheap on large meshes.
    """
    mesh_shape = spec.mesh.shape
    local = spec.numel * spec.itemsize / max(math.prod(n for n, p in zip(mesh_shape, spec.placements) if p.is_shard()), 1)
    total = 0.0
    for i, (a, b) in enumerate(zip(spec.placements, target)):
        if a == b or a.is_replicate():
            continue
        n = mesh_shape[i]
        if a.is_shard():
            kind, nbytes = ("all_to_all", local) if b.is_shard() else ("all_gather", local * n)
        else:
            kind, nbytes = ("reduce_scatter", local) if b.is_shard() else ("all_reduce", local)
        total += cost.collective_time(kind, nbytes, n, links[i])
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
    comm_time = sum(
        cost.collective_time(kind, nbytes * (mesh_shape[i] if kind == "all_gather" else 1), mesh_shape[i], links[i])
        for i, r in enumerate(combo)
        for kind, nbytes in r.comm
    )
    pending = 0.0
    for (shape, itemsize), pl in zip(out_shapes, outputs):
        local = math.prod(shape) * itemsize / max(math.prod(n for n, p in zip(mesh_shape, pl) if p.is_shard()), 1)
        pending += sum(resolve_time(shape, local, mesh_shape[i], links[i]) for i, p in enumerate(pl) if p.is_partial())
    changes = sum(a != b for spec, target in zip(in_specs, inputs) for a, b in zip(spec.placements, target))
    compute = _compute_time(in_specs, inputs, out_shapes, outputs, links)
    return Candidate(inputs, outputs, algos[0] if algos else None, combo, (), redist, comm_time, pending, order, changes, compute)


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


def candidates(
    rows: Sequence[Row],
    in_specs: Sequence[TensorSpec],
    out_shapes: Sequence[tuple[Sequence[int], int]],
    links: tuple[cost.Link, ...] | None = None,
    filter_fn: Callable[[Candidate], bool] | None = None,
) -> list[Candidate]:
    mesh = in_specs[0].mesh
    links = cost.resolve_links(links, mesh.ndim)
    for r in rows:
        if len(r.inputs) != len(in_specs) or (len(r.outputs) != len(out_shapes) and len(r.outputs) != 1):
            raise ShardingError(
                f"strategy row {r} has {len(r.inputs)} inputs/{len(r.outputs)} outputs, the op has {len(in_specs)}/{len(out_shapes)}"
            )
    out = []
    for i, combo in enumerate(expand(rows, len(in_specs), len(out_shapes), mesh.ndim)):
        c = price(combo, in_specs, out_shapes, links, i)
        if _mixed_partials(c) or _needs_norm_partial(c, in_specs):
            continue
        if filter_fn is None or filter_fn(c):
            out.append(c)
    return sorted(out, key=lambda c: rank_key(c, mesh.shape))
