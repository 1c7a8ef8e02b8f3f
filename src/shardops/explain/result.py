"""What explain returns: per traced op a Step with its candidate Options, and the Explanation of the call."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..placements import Placement
from ..redistribute import Plan, plan_bytes
from ..spec import TensorSpec
from .render import render
from .specs import spec_text
from .text import fmt_bytes, fmt_time, placements_text  # noqa: F401  (re-exported)

DEFAULT_TOP = 10


@dataclass
class Option:
    """One candidate strategy of a step, with its exact redistribution plans."""

    number: int  # 1-based, in the runtime's ranking
    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]
    label: str
    plans: tuple[Plan, ...]
    comm: list[
        tuple[tuple[int, ...], str, float]
    ]  # (mesh dims of the group, kind, bytes this rank puts in) inside the op
    in_specs: tuple[TensorSpec, ...]
    time: float
    redistribute_time: float
    comm_time: float
    pending_time: float
    chosen: bool = False
    replicate: bool = False  # the implicit all-Replicate candidate (replicate-then-local)

    def bytes_at(self, coordinate: Sequence[int]) -> int:
        """Bytes the rank at `coordinate` puts into collectives (as so.CommDebugMode counts them)."""
        moved = sum(plan_bytes(s, p, coordinate) for s, p in zip(self.in_specs, self.plans))
        return int(moved + sum(b for dims, _, b in self.comm if self._group_size(dims) > 1))

    def _group_size(self, dims: Sequence[int]) -> int:
        return math.prod(self.in_specs[0].mesh.shape[i] for i in dims)

    @property
    def bytes(self) -> int:
        return self.bytes_at([0] * self.in_specs[0].mesh.ndim)

    @property
    def rounds(self) -> int:
        return sum(p.rounds for p in self.plans) + sum(1 for dims, _, _ in self.comm if self._group_size(dims) > 1)

    def moves(self, names: Sequence[str]) -> list[str]:
        return [f"{n} {s!r}" for n, p in zip(names, self.plans) for s in p.steps]

    def to_dict(self, names: Sequence[str]) -> dict[str, Any]:
        return {
            "number": self.number,
            "chosen": self.chosen,
            "label": self.label,
            "inputs": [placements_text(p) for p in self.inputs],
            "outputs": [placements_text(p) for p in self.outputs],
            "input_moves": self.moves(names),
            "internal_comm": [{"mesh_dims": list(d), "kind": k, "bytes": b} for d, k, b in self.comm],
            "bytes_per_rank": self.bytes,
            "rounds": self.rounds,
            "time_s": self.time,
            "redistribute_time_s": self.redistribute_time,
            "comm_time_s": self.comm_time,
            "pending_time_s": self.pending_time,
        }


@dataclass
class Step:
    """One aten op of the traced call, planned."""

    index: int
    op: str
    call: str
    input_names: list[str]
    in_specs: tuple[TensorSpec, ...]
    out_specs: list[TensorSpec]
    options: list[Option]  # shown (best N, runtime order)
    total: int  # candidates considered
    chosen: Option | None
    reason: str
    fallback: bool = False
    replicate_only: bool = False
    gathers: str | None = None  # how the chosen plan gathers sharded data (strict mode refuses it unless allowed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "op": self.op,
            "call": self.call,
            "inputs": {n: spec_text(s) for n, s in zip(self.input_names, self.in_specs)},
            "outputs": [spec_text(s) for s in self.out_specs],
            "fallback": self.fallback,
            "replicate_only": self.replicate_only,
            "gathers": self.gathers,
            "candidates_total": self.total,
            "reason": self.reason,
            "candidates": [o.to_dict(self.input_names) for o in self.options],
        }


@dataclass
class Explanation:
    expression: str
    mesh_shape: tuple[int, ...]
    links: list[str]
    inputs: dict[str, TensorSpec]
    steps: list[Step]
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    top: int = DEFAULT_TOP

    @property
    def chosen(self) -> list[Option]:
        return [s.chosen for s in self.steps if s.chosen is not None]

    def bytes_at(self, coordinate: Sequence[int]) -> int:
        """Bytes the rank at `coordinate` puts into collectives over every step (the chosen plans)."""
        return sum(o.bytes_at(coordinate) for o in self.chosen)

    @property
    def bytes(self) -> int:
        return self.bytes_at([0] * len(self.mesh_shape))

    @property
    def rounds(self) -> int:
        return sum(o.rounds for o in self.chosen)

    @property
    def time(self) -> float:
        return sum(o.time for o in self.chosen)

    @property
    def outputs(self) -> list[TensorSpec]:
        return self.steps[-1].out_specs if self.steps else []

    def to_dict(self) -> dict[str, Any]:
        return {
            "expression": self.expression,
            "mesh": list(self.mesh_shape),
            "ranks": math.prod(self.mesh_shape),
            "links": self.links,
            "inputs": {k: spec_text(v) for k, v in self.inputs.items()},
            "steps": [s.to_dict() for s in self.steps],
            "notes": self.notes,
            "total": {"bytes_per_rank": self.bytes, "rounds": self.rounds, "time_s": self.time},
            "timings_s": self.timings,
        }

    def __str__(self) -> str:
        return render(self)
