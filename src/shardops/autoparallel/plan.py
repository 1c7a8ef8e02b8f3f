"""Plan: the chosen parallelization, readable as the code a person would write, and applicable."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh, init_device_mesh
from ..parallel import data_parallel, parallelize_module
from .candidates import Candidate, PlanEntry
from .measure import PARTS, Measurement
from .timing import PARTS as TIMED_PARTS
from .timing import StepProfile, StepTime

__all__ = ["OBJECTIVES", "Plan", "apply_candidate", "mesh_names_for", "rank_key"]

OBJECTIVES = ("time", "bytes")


def mesh_names_for(c: Candidate) -> tuple[str, ...]:
    """Mesh dim names that say what each dim does: ("dp", "tp"), or ("dp0", "dp1") for two dp dims."""
    names = []
    for d, kind in enumerate(c.dims):
        names.append(kind if c.dims.count(kind) == 1 else f"{kind}{c.dims[:d].count(kind)}")
    return tuple(names)


def _global_batch_slicer(mesh: DeviceMesh, dp_dims: tuple[int, ...]):
    """The model takes the global batch (the same on every rank); each dp rank keeps its batch shard."""
    coord = mesh.own_coordinate()
    n = math.prod(mesh.shape[d] for d in dp_dims)
    index = 0
    for d in dp_dims:
        index = index * mesh.shape[d] + coord[d]

    def shard(x):
        if isinstance(x, torch.Tensor) and x.ndim > 0 and type(x) is torch.Tensor:
            if x.shape[0] % n:
                raise ShardingError(
                    f"autoparallel plan: the global batch of {x.shape[0]} does not split evenly over the {n} "
                    "data-parallel ranks"
                )
            return x.chunk(n)[index]
        return x

    def hook(module, args, kwargs):
        return tuple(shard(a) for a in args), {k: shard(v) for k, v in kwargs.items()}

    return hook


def apply_candidate(model: nn.Module, mesh: DeviceMesh, c: Candidate, entries: list[PlanEntry]) -> nn.Module:
    if mesh.ndim != len(c.dims):
        raise ShardingError(f"autoparallel plan: made for a {len(c.dims)}-d mesh, got {mesh}")
    if c.tp_dim is not None:
        names = mesh.mesh_dim_names
        if mesh.ndim > 1 and names is None:
            raise ShardingError(f"autoparallel plan: {mesh} has no mesh_dim_names; name its dims (see mesh_names_for)")
        tp_mesh = mesh if mesh.ndim == 1 or names is None else mesh[names[c.tp_dim]]
        parallelize_module(model, tp_mesh, {e.key: e.make() for e in entries})
    if c.dp_dims:
        model.register_forward_pre_hook(_global_batch_slicer(mesh, c.dp_dims), with_kwargs=True, prepend=True)
        data_parallel(model, mesh, mode=c.dp_mode)
    return model


@dataclass
class Scored:
    candidate: Candidate
    entries: list[PlanEntry]
    measurement: Measurement
    profile: StepProfile | None = None  # the dry step's collectives, kernels and FLOPs (objective "time")
    time: StepTime | None = None  # its predicted step time on one rank

    @property
    def seconds(self) -> float:
        return math.inf if self.time is None else self.time.total


def rank_key(objective: str):
    """The order of feasible candidates: predicted step time first ("time"), or bytes first ("bytes")."""
    if objective == "time":
        return lambda s: (s.seconds, s.measurement.total_bytes, s.measurement.total_rounds)
    return lambda s: (s.measurement.total_bytes, s.measurement.total_rounds, s.measurement.memory_per_rank)


@dataclass
class Plan:
    """What `so.autoparallel` returns. `apply(model)` parallelizes in place; `print(plan)` shows the code."""

    mesh_shape: tuple[int, ...]
    chosen: Scored
    considered: list[Scored] = field(default_factory=list)
    model_name: str = "model"
    compute_share: float = 1.0
    pricing: str = "measured: one step on the threads world, counted with so.CommDebugMode"
    timings: dict = field(default_factory=dict)  # plan_s (the search), warmup_s (torch's one-time meta warm-up)
    objective: str = "bytes"
    models: tuple = ()  # (per-mesh-dim Links, Compute) the times were predicted under

    @property
    def predicted_time(self) -> float | None:
        """Seconds of one training step on the busiest rank, predicted (objective "time"), else None."""
        return None if self.chosen.time is None else self.chosen.time.total

    # -- the contract
    @property
    def predicted_bytes(self) -> int:
        """Bytes the busiest rank sends in one forward + loss + backward + gradient resolution."""
        return self.chosen.measurement.total_bytes

    @property
    def predicted_rounds(self) -> int:
        return self.chosen.measurement.total_rounds

    @property
    def candidate(self) -> Candidate:
        return self.chosen.candidate

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return mesh_names_for(self.candidate)

    @property
    def parallelize_plan(self) -> dict:
        """The {module path: style} dict (fresh style objects), for parallelize_module."""
        return {e.key: e.make() for e in self.chosen.entries}

    def apply(self, model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
        """Parallelize `model` in place (call on every rank); `mesh` defaults to a new one over the world."""
        if mesh is None:
            mesh = init_device_mesh("cpu", self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        elif tuple(mesh.shape) != self.mesh_shape:
            raise ShardingError(f"autoparallel plan: planned for mesh {self.mesh_shape}, got {tuple(mesh.shape)}")
        elif mesh.ndim > 1 and mesh.mesh_dim_names is None:
            raise ShardingError("autoparallel plan: a multi-dim mesh needs mesh_dim_names (or pass no mesh)")
        return apply_candidate(model, mesh, self.candidate, self.chosen.entries)

    # -- reading it
    def __str__(self) -> str:
        c, m = self.candidate, self.chosen.measurement
        names = self.mesh_dim_names
        lines = [f"autoparallel plan for {self.model_name} on mesh {self.mesh_shape} {names}"]
        for d, kind in enumerate(c.dims):
            what = (
                f"data parallel (mode={c.dp_mode!r}, batch split)" if kind == "dp" else "tensor parallel (plan below)"
            )
            lines.append(f"  mesh dim {d} {names[d]!r} (size {self.mesh_shape[d]}): {what}")
        lines.append("")
        lines.append(f'mesh = so.init_device_mesh("cpu", {self.mesh_shape}, mesh_dim_names={names})')
        if c.tp_dim is not None:
            target = "mesh" if len(names) == 1 else f"mesh[{names[c.tp_dim]!r}]"
            lines.append(f"parallelize_module(model, {target}, {{")
            for e in self.chosen.entries:
                lines.append(f"    {e.key!r}: {e.text},")
            lines.append("})")
        if c.dp_dims:
            lines.append(
                f'data_parallel(model, mesh, mode="{c.dp_mode}")  # after slicing the global batch over '
                + ", ".join(repr(names[d]) for d in c.dp_dims)
            )
        lines.append("")
        lines.append(f"predicted per step, busiest rank ({self.pricing}):")
        lines.append(f"  {'part':<16}{'bytes':>14}{'rounds':>8}")
        for part in PARTS:
            lines.append(f"  {part:<16}{m.bytes_per_part[part]:>14,}{m.rounds_per_part[part]:>8}")
        lines.append(f"  {'optimizer step':<16}{0:>14,}{0:>8}   (gradients already resolved above)")
        lines.append(f"  {'total':<16}{m.total_bytes:>14,}{m.total_rounds:>8}")
        lines.extend(self._time_lines())
        lines.append(f"  matmul work on the busiest rank: {self.compute_share:.2f}x an even share")
        lines.append(
            f"  peak memory per rank (parameters + gradients + AdamW states, no activations): {m.memory_per_rank:,} B"
        )
        lines.append(f"  parameters per rank: {m.parameter_bytes:,} B")
        feasible = sum(1 for s in self.considered if s.measurement.feasible)
        took = f" in {self.timings['plan_s']:.1f} s" if "plan_s" in self.timings else ""
        lines.append(f"  searched {len(self.considered)} candidates ({feasible} feasible){took}")
        return "\n".join(lines)

    __repr__ = __str__

    def _time_lines(self) -> list[str]:
        t, prof = self.chosen.time, self.chosen.profile
        if t is None or prof is None:
            return []
        links, compute = self.models
        lines = [
            f"predicted step time, one rank (links {', '.join(map(repr, links))}; {compute!r}): {t.total * 1e3:.3f} ms",
            f"  {'part':<16}{'compute ms':>12}{'comm ms':>10}{'GFLOP':>9}{'kernels':>9}{'collectives':>13}",
        ]
        for part in TIMED_PARTS:
            p = prof.parts[part]
            lines.append(
                f"  {part:<16}{t.compute[part] * 1e3:>12.3f}{t.comm[part] * 1e3:>10.3f}{p.flops / 1e9:>9.3f}"
                f"{p.kernels:>9}{p.rounds:>13}"
            )
        lines.append(f"  activations kept for backward, per rank: {prof.activation_bytes:,} B")
        return lines

    def explain(self) -> str:
        """Per mesh dim and per module (a repeated block's modules once, under `blocks.*`): the chosen
        layout, the runner-up (the best feasible plan, by the plan's objective, that does otherwise
        there) and what it would cost more or less: predicted step time and bytes per step on the
        busiest rank."""
        chosen = self.chosen
        mine = {e.key: e.text for e in chosen.entries}
        feasible = [s for s in self.considered if s.measurement.feasible and s is not chosen]
        key = rank_key(self.objective)
        lines = [f"chosen plan: {_cost_text(chosen)} ({len(feasible)} feasible alternatives, by {self.objective})"]

        def runner_up(differs) -> Scored | None:
            others = [s for s in feasible if differs(s)]
            return min(others, key=key) if others else None

        names = self.mesh_dim_names
        for d, kind in enumerate(chosen.candidate.dims):
            r = runner_up(lambda s, d=d, kind=kind: s.candidate.dims[d] != kind)
            head = f"mesh dim {d} {names[d]!r}: {kind}"
            lines.append(
                f"{head}; runner-up: none feasible"
                if r is None
                else f"{head}; runner-up {r.candidate.dims[d]} ({_delta(r, chosen)})"
            )
        keys = list(mine) + sorted({e.key for s in feasible for e in s.entries} - set(mine))
        for k in keys:
            r = runner_up(lambda s, k=k: {e.key: e.text for e in s.entries}.get(k) != mine.get(k))
            chosen_text = mine.get(k, "(not in plan)")
            if r is None:
                lines.append(f"{k}: {chosen_text}; runner-up: none feasible")
            else:
                theirs = {e.key: e.text for e in r.entries}.get(k, "(not in plan)")
                lines.append(f"{k}: {chosen_text}\n    runner-up ({_delta(r, chosen)}): {theirs}")
        return "\n".join(lines)


def _cost_text(s: Scored) -> str:
    b = f"{s.measurement.total_bytes:,} B per step on the busiest rank"
    return b if s.time is None else f"{s.time.total * 1e3:.3f} ms predicted, {b}"


def _delta(other: Scored, chosen: Scored) -> str:
    """What the runner-up costs beside the chosen plan: time (where predicted) and bytes."""
    b = f"{other.measurement.total_bytes - chosen.measurement.total_bytes:+,} B"
    if other.time is None or chosen.time is None:
        return b
    return f"{(other.time.total - chosen.time.total) * 1e3:+.3f} ms, {b}"
