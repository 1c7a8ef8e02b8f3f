"""Strategy rows, their combinations across mesh dims, and the order candidates rank in.

A rule describes ONE mesh dim: a list of `Row`s, each giving the output placements,
then the input placements (one per tensor operand), and, for a sharded algorithm, the
collectives it issues inside the op on that mesh dim. The all-Replicate row is
implicit. A `Candidate` is one row per mesh dim, priced (pricing.py); candidates rank by
`rank_key`: the cheapest first; ties prefer leaving inputs as they are, then a pending
output (a later linear op may absorb it), then more sharding, then the rule's row order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ShardingError
from ..placements import NormPartial, Placement, Replicate
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
    plans: tuple[Any, ...] = ()  # each input's redistribute.Plan, once choice.with_plans has made them
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
        return (
            labels[0]
            if labels
            else ("local" if not any(p.is_partial() for o in self.outputs for p in o) else "pending")
        )

    def describe(self) -> str:
        ins = " ".join("[" + ",".join(map(repr, p)) + "]" for p in self.inputs)
        outs = " ".join("[" + ",".join(map(repr, p)) + "]" for p in self.outputs)
        return f"{ins} -> {outs}"


class Ranked(list):
    """Candidates, cheapest first, with the size of the space they were chosen from."""

    total: int = 0  # combinations that satisfy the structural rules (filter_fn not applied)
    replicate: Candidate | None = None  # the all-Replicate candidate, priced, if allowed
    exhaustive: bool = False  # True: every candidate is in the list


def rank_key(c: Candidate, mesh_shape: Sequence[int]) -> tuple:
    # NOTE: times are rounded so that float noise cannot split ties differently on different ranks.
    return (round(c.time, 12), c.changes, 0 if is_pending(c) else 1, -sharding(c, mesh_shape), c.order)


# ------------------------------------------------------------------ structural rules


def needs_norm_partial(c: Candidate, in_specs: Sequence[TensorSpec]) -> bool:
    """NormPartial is a source only: no plan reaches it from another placement."""
    return any(
        isinstance(t, NormPartial) and t != s
        for spec, tgt in zip(in_specs, c.inputs)
        for s, t in zip(spec.placements, tgt)
    )


def mixed_partials(c: Candidate) -> bool:
    return any(len({p for p in pl if p.is_partial()}) > 1 for pl in c.outputs + c.inputs)


def is_pending(c: Candidate) -> bool:
    return any(p.is_partial() for o in c.outputs for p in o)


def sharding(c: Candidate, mesh_shape: Sequence[int]) -> int:
    return sum(math.prod(n for n, p in zip(mesh_shape, pl) if p.is_shard()) for pl in c.inputs + c.outputs)


def row_options(rows: Sequence[Row], n_inputs: int, n_outputs: int) -> list[Row]:
    """The rows every mesh dim chooses from: the rule's, then the implicit all-Replicate row."""
    return list(rows) + [Row((R,) * max(n_outputs, 1), (R,) * n_inputs)]


def fits_mesh_dim(r: Row, i: int) -> bool:
    """A row made for one mesh dim (a view's exact layout) is offered on that dim only."""
    return r.mesh_dim is None or r.mesh_dim == i


def check_rows(rows: Sequence[Row], n_in: int, n_out: int) -> None:
    for r in rows:
        if len(r.inputs) != n_in or (len(r.outputs) != n_out and len(r.outputs) != 1):
            raise ShardingError(
                f"strategy row {r} has {len(r.inputs)} inputs/{len(r.outputs)} outputs, the op has {n_in}/{n_out}"
            )


def order_index(indices: Sequence[int], radix: int) -> int:
    """The combination's index in the product of row options (mesh dim 0 most significant)."""
    order = 0
    for r in indices:
        order = order * radix + r
    return order
