"""Every time the planner compares, in one place: collectives, moves, an op's own collectives,
pending outputs and redundant work.

Times come from the link model (cost.py: latency, bandwidth and compute rate per mesh
dim, from fixed presets), never from measurement, so every rank prices alike. A
candidate's time:

    cost = redistributing the inputs (estimated here; redistribute.plan is exact)
         + the op's own collectives (joint over the mesh dims a sharded algorithm spans)
         + resolving any pending (Partial) output later (an eager planner must price
           what it defers)
         + the redundant local work a gather creates (every rank then runs the kernel
           on the whole gathered data)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..cost import Link, collective_time, joint_collective_time, step_time  # noqa: F401 (the planner's formulas, priced here)
from ..placements import Placement, Shard, StridedShard
from ..spec import TensorSpec
from .rows import Candidate, Row

# ------------------------------------------------------------------ moving an input


def source_local_bytes(spec: TensorSpec) -> float:
    return (
        spec.numel
        * spec.itemsize
        / max(math.prod(n for n, p in zip(spec.mesh.shape, spec.placements) if p.is_shard()), 1)
    )


def redistribution_term(a: Placement, b: Placement, local: float, n: int, link: Link) -> float:
    """One mesh dim's share of moving a tensor from `a` to `b` (see estimate_redistribution)."""
    if a == b or a.is_replicate():
        return 0.0
    if a.is_shard():
        kind, nbytes = ("all_to_all", local) if b.is_shard() else ("all_gather", local * n)
    else:
        kind, nbytes = ("reduce_scatter", local) if b.is_shard() else ("all_reduce", local)
    return collective_time(kind, nbytes, n, link)


def estimate_redistribution(spec: TensorSpec, target: Sequence[Placement], links: tuple[Link, ...]) -> float:
    """Per-mesh-dim estimate of moving `spec` to `target`: each dim priced on its own, plus
    the gathers that nesting forces.

    Shards nest left to right, so a move on mesh dim i that touches tensor dim d waits
    until no later mesh dim shards d: a later mesh dim j that keeps its shard of d must be
    gathered first (and sliced again after, which is free). That gather is priced at the
    source's local size (`unblock_term`). Exact when no two mesh dims shard the same
    tensor dim; the executed plan is the exact shortest path (redistribute.plan). Linear
    in mesh ndim, so pricing a candidate stays cheap on large meshes.
    """
    mesh_shape = spec.mesh.shape
    local = source_local_bytes(spec)
    total = 0.0
    guarded: frozenset[int] = frozenset()
    for i, (a, b) in enumerate(zip(spec.placements, target)):
        total += redistribution_term(a, b, local, mesh_shape[i], links[i]) + unblock_term(
            guarded, a, b, local, mesh_shape[i], links[i]
        )
        guarded |= move_guard(a, b)
    return total


def move_guard(a: Placement, b: Placement) -> frozenset[int]:
    """Tensor dims a one-mesh-dim move a -> b touches (no later mesh dim may shard them then)."""
    if a == b:
        return frozenset()
    return frozenset(p.dim for p in (a, b) if isinstance(p, (Shard, StridedShard)))


def unblock_term(guarded: frozenset[int], a: Placement, b: Placement, local: float, n: int, link: Link) -> float:
    """A mesh dim that keeps its shard of a tensor dim an earlier mesh dim's move touches: gathered first."""
    if a == b and isinstance(a, (Shard, StridedShard)) and a.dim in guarded:
        return collective_time("all_gather", local * n, n, link)
    return 0.0


# ------------------------------------------------------------------ the op's own collectives


def gathered_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """A row declares what one rank puts in; the cost model takes the full (gathered) size."""
    return nbytes * group_size if kind == "all_gather" else nbytes


def comm_time(combo: Sequence[Row], mesh_shape: Sequence[int], links: Sequence[Link]) -> float:
    """The op's own collectives. A sharded algorithm whose dim is sharded over several mesh
    dims issues ONE collective over the group spanning them (ops/common.py), so equal
    entries of its rows merge into one joint collective (joint_collective_time),
    issued as many times as the most any one row declares it."""
    total = 0.0
    joint: dict[tuple[str, float], tuple[list[int], int]] = {}
    for i, r in enumerate(combo):
        if r.algorithm is None:  # a plain per-mesh-dim declaration
            n = mesh_shape[i]
            total += sum(collective_time(kind, gathered_bytes(kind, b, n), n, links[i]) for kind, b in r.comm)
            continue
        counts: dict[tuple[str, float], int] = {}
        for kind, b in r.comm:
            counts[(kind, float(b))] = counts.get((kind, float(b)), 0) + 1
        for key, count in counts.items():
            dims, most = joint.get(key, ([], 0))
            joint[key] = (dims + [i], max(most, count))
    for (kind, b), (dims, count) in joint.items():
        sizes = [mesh_shape[i] for i in dims]
        total += count * joint_collective_time(
            kind, gathered_bytes(kind, b, math.prod(sizes)), sizes, [links[i] for i in dims]
        )
    return total


# ------------------------------------------------------------------ pending outputs and redundant work


def resolve_time(shape: Sequence[int], local_bytes: float, n: int, link: Link) -> float:
    """Cheapest later resolution of a pending output, priced by its bytes only.

    reduce_scatter onto a dim that can take it, else all_reduce. The latency is left
    out: a deferred resolution is not issued yet, and is often shared with other
    pending values or absorbed by a later linear op.
    """
    wire = Link(0.0, link.bandwidth, link.compute)
    return collective_time("reduce_scatter" if len(shape) > 0 else "all_reduce", local_bytes, n, wire)


def local_bytes(
    shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> float:
    return math.prod(shape) * itemsize / max(math.prod(n for n, p in zip(mesh_shape, placements) if p.is_shard()), 1)


def compute_time(in_specs, inputs, out_shapes, outputs, links) -> float:
    """The redundant local work a candidate creates by gathering a sharded input.

    After a Shard -> Replicate move every rank runs the kernel on the whole gathered
    data: priced at the device's streaming rate. Layouts kept as they are (shards,
    pending partials, replicas) add nothing here, so the design's tie rules stand.
    """
    mesh_shape = in_specs[0].mesh.shape
    total = 0.0
    for spec, target in zip(in_specs, inputs):
        if any(a.is_shard() and b.is_replicate() for a, b in zip(spec.placements, target)):
            total += local_bytes(spec.shape, spec.itemsize, mesh_shape, target)
    return total / min(link.compute for link in links)


# ------------------------------------------------------------------ a candidate


def price(
    combo: tuple[Row, ...],
    in_specs: Sequence[TensorSpec],
    out_shapes: Sequence[tuple[Sequence[int], int]],
    links: tuple[Link, ...],
    order: int,
) -> Candidate:
    """The candidate that runs `combo` (one row per mesh dim), with every term of its time."""
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
    compute = compute_time(in_specs, inputs, out_shapes, outputs, links)
    return Candidate(
        inputs, outputs, algos[0] if algos else None, combo, (), redist, internal, pending, order, changes, compute
    )
