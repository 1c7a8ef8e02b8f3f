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

__all__ = ["Plan", "apply_candidate", "mesh_names_for"]


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

    def explain(self) -> str:
        """Per mesh dim and per module: the chosen style, the runner-up (the cheapest feasible plan
        that does otherwise there) and the difference in bytes per step on the busiest rank."""
        chosen = self.chosen
        mine = {e.key: e.text for e in chosen.entries}
        feasible = [s for s in self.considered if s.measurement.feasible and s is not chosen]
        cost = chosen.measurement.total_bytes
        lines = [f"chosen plan: {cost:,} B per step on the busiest rank ({len(feasible)} feasible alternatives)"]

        def runner_up(differs) -> str | tuple[str, Scored]:
            others = [s for s in feasible if differs(s)]
            if not others:
                return "runner-up: none feasible"
            best = min(others, key=lambda s: (s.measurement.total_bytes, s.measurement.total_rounds))
            return f"{best.measurement.total_bytes - cost:+,} B", best

        names = self.mesh_dim_names
        for d, kind in enumerate(chosen.candidate.dims):
            r = runner_up(lambda s, d=d, kind=kind: s.candidate.dims[d] != kind)
            if isinstance(r, str):
                lines.append(f"mesh dim {d} {names[d]!r}: {kind}; {r}")
            else:
                lines.append(f"mesh dim {d} {names[d]!r}: {kind}; runner-up {r[1].candidate.dims[d]} ({r[0]})")
        keys = list(mine) + sorted({e.key for s in feasible for e in s.entries} - set(mine))
        for key in keys:
            r = runner_up(lambda s, key=key: {e.key: e.text for e in s.entries}.get(key) != mine.get(key))
            chosen_text = mine.get(key, "(not in plan)")
            if isinstance(r, str):
                lines.append(f"{key}: {chosen_text}; {r}")
            else:
                theirs = {e.key: e.text for e in r[1].entries}.get(key, "(not in plan)")
                lines.append(f"{key}: {chosen_text}\n    runner-up ({r[0]}): {theirs}")
        return "\n".join(lines)
