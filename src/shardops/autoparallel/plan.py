"""Plan: the chosen parallelization, readable as the code a person would write, and applicable."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..fsdp import fully_shard, replicate
from ..mesh import DeviceMesh, init_device_mesh
from ..parallel import parallelize_module
from ..world import current_comm
from .candidates import Candidate, PlanEntry
from .measure import PARTS, Measurement
from .timing import PARTS as TIMED_PARTS
from .timing import StepProfile, StepTime

__all__ = [
    "OBJECTIVES",
    "Plan",
    "apply_candidate",
    "batch_feed",
    "local_inputs",
    "mesh_names_for",
    "rank_key",
    "working_mesh",
]

OBJECTIVES = ("time", "bytes")


def mesh_names_for(c: Candidate) -> tuple[str, ...]:
    """Mesh dim names that say what each dim does: ("dp", "tp"), or ("dp0", "dp1") for two dp dims."""
    names = []
    for d, kind in enumerate(c.dims):
        names.append(kind if c.dims.count(kind) == 1 else f"{kind}{c.dims[:d].count(kind)}")
    return tuple(names)


def _dp_names(c: Candidate) -> tuple[str, ...]:
    names = mesh_names_for(c)
    return tuple(names[d] for d in c.dp_dims)


def working_mesh(mesh: DeviceMesh, c: Candidate) -> DeviceMesh:
    """The mesh the plan is applied on: `mesh` itself with at most one dp dim; with several, the same
    ranks with the dp dims flattened into one dim "dp" (then "tp" if any), as torch users flatten
    them for fully_shard (a 1-D data mesh) and replicate (one group)."""
    if len(c.dp_dims) <= 1:
        return mesh
    order = [*c.dp_dims, *([c.tp_dim] if c.tp_dim is not None else [])]
    dp = math.prod(mesh.shape[d] for d in c.dp_dims)
    shape = (dp,) if c.tp_dim is None else (dp, mesh.shape[c.tp_dim])
    ranks = mesh.mesh.permute(*order).reshape(shape)
    flat = DeviceMesh(mesh.device_type, ranks, ("dp",) if c.tp_dim is None else ("dp", "tp"))
    return flat


def _sub_mesh(mesh: DeviceMesh, dim: int) -> DeviceMesh:
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise ShardingError(f"autoparallel plan: {mesh} has no mesh_dim_names; name its dims (see mesh_names_for)")
    return mesh[names[dim]]


def _working_dims(c: Candidate) -> tuple[int | None, int | None]:
    """(dp dim, tp dim) of the working mesh."""
    if len(c.dp_dims) > 1:
        return 0, (1 if c.tp_dim is not None else None)
    return (c.dp_dims[0] if c.dp_dims else None), c.tp_dim


def fully_shard_units(model: nn.Module, blocks: str | None) -> list[nn.Module]:
    """torchtitan's apply_fsdp units: each repeated block, then the root."""
    stack = model.get_submodule(blocks) if blocks else None
    return [*(stack.children() if stack is not None else ()), model]


def apply_candidate(
    model: nn.Module, mesh: DeviceMesh, c: Candidate, entries: list[PlanEntry], blocks: str | None = None
) -> nn.Module:
    """Tensor parallelism on the tp sub-mesh, then torch's data parallelism (fully_shard per block and
    the root, or replicate) on the dp sub-mesh. The model then takes each rank's batch slice (local_batch)."""
    if mesh.ndim != len(c.dims):
        raise ShardingError(f"autoparallel plan: made for a {len(c.dims)}-d mesh, got {mesh}")
    if mesh.ndim > 1 and mesh.mesh_dim_names is None:
        raise ShardingError(f"autoparallel plan: {mesh} has no mesh_dim_names; name its dims (see mesh_names_for)")
    work = working_mesh(mesh, c)
    dp_dim, tp_dim = _working_dims(c)
    if tp_dim is not None:
        parallelize_module(model, _sub_mesh(work, tp_dim), {e.key: e.make() for e in entries if e.mesh == "tp"})
    if dp_dim is None:
        return model
    dp_mesh = _sub_mesh(work, dp_dim)
    experts = {e.key: e.make() for e in entries if e.mesh == "data"}
    if experts:  # sharded over the data mesh (and tp inside): fully_shard/replicate then leave them as they are
        parallelize_module(model, work if tp_dim is not None else dp_mesh, experts)
    if c.dp_mode == "replicate":
        replicate(model, device_mesh=dp_mesh)
    else:
        for unit in fully_shard_units(model, blocks):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=c.reshard_after_forward)
    return model


def dp_coordinate(mesh_shape: tuple[int, ...], coordinate: list[int], c: Candidate) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their number): row-major over the dp dims,
    the order of the flattened dp dim."""
    index, n = 0, 1
    for d in c.dp_dims:
        index = index * mesh_shape[d] + coordinate[d]
        n *= mesh_shape[d]
    return index, n


def local_inputs(inputs: tuple, index: int, n: int) -> tuple:
    """Each tensor input's batch slice `index` of `n` (dim 0, torch.chunk's cut); other inputs as given."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.ndim > 0 and n > 1:
            if x.shape[0] % n:
                raise ShardingError(
                    f"autoparallel plan: the global batch of {x.shape[0]} does not split evenly over the {n} "
                    "data-parallel ranks"
                )
            x = x.chunk(n)[index]
        out.append(x)
    return tuple(out)


def batch_feed(mesh_shape: tuple[int, ...], c: Candidate) -> Callable[[DeviceMesh, tuple], tuple]:
    """The feed of an applied candidate: `(mesh, global example) -> this rank's batch slice`."""
    return lambda mesh, example: local_inputs(example, *dp_coordinate(mesh_shape, mesh.own_coordinate(), c))


@dataclass
class Scored:
    candidate: Candidate
    entries: list[PlanEntry]
    measurement: Measurement
    profile: StepProfile | None = None  # the dry step's collectives, kernels and FLOPs (objective "time")
    time: StepTime | None = None  # its predicted step time on one rank
    time_error: str | None = None  # why the dry world could not time it (objective "time": ranked last)

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
    blocks: str | None = None  # the container of repeated blocks: one fully_shard unit each
    blocks_text: str = "model.layers"  # the same, as the code iterates it (model.layers, model.h.values())
    notes: list[str] = field(default_factory=list)  # printed under the code: what the plan's semantics are
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
        """The tensor-parallel {module path: style} dict (fresh style objects), for parallelize_module on
        the tp sub-mesh (the experts' ExpertParallel, on the data mesh, is in `expert_plan`)."""
        return {e.key: e.make() for e in self.chosen.entries if e.mesh == "tp"}

    @property
    def expert_plan(self) -> dict:
        """The experts' {module path: ExpertParallel} dict, applied on the data mesh (with tp: the whole mesh)."""
        return {e.key: e.make() for e in self.chosen.entries if e.mesh == "data"}

    def apply(self, model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
        """Parallelize `model` in place (call on every rank); `mesh` defaults to a new one over the world."""
        if mesh is None:
            mesh = init_device_mesh("cpu", self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        elif tuple(mesh.shape) != self.mesh_shape:
            raise ShardingError(f"autoparallel plan: planned for mesh {self.mesh_shape}, got {tuple(mesh.shape)}")
        elif mesh.ndim > 1 and mesh.mesh_dim_names is None:
            raise ShardingError("autoparallel plan: a multi-dim mesh needs mesh_dim_names (or pass no mesh)")
        return apply_candidate(model, mesh, self.candidate, self.chosen.entries, self.blocks)

    def local_batch(self, *inputs: torch.Tensor, mesh: DeviceMesh | None = None):
        """This rank's slice of the global batch (dim 0 of each tensor, over the data-parallel ranks):
        what the applied model takes, as under torch's fully_shard/replicate. One input: the tensor; several:
        a tuple. `mesh` defaults to the one `apply()` makes (row-major over the world)."""
        if mesh is not None:
            coordinate = mesh.own_coordinate()
        else:
            rank, flat = current_comm().rank, []
            for size in reversed(self.mesh_shape):
                flat.append(rank % size)
                rank //= size
            coordinate = flat[::-1]
        index, n = dp_coordinate(self.mesh_shape, coordinate, self.candidate)
        out = local_inputs(inputs, index, n)
        return out[0] if len(out) == 1 else out

    # -- reading it
    def __str__(self) -> str:
        c, m = self.candidate, self.chosen.measurement
        names = self.mesh_dim_names
        lines = [f"autoparallel plan for {self.model_name} on mesh {self.mesh_shape} {names}"]
        for d, kind in enumerate(c.dims):
            what = f"data parallel ({c.dp_mode}, batch split)" if kind == "dp" else "tensor parallel (plan below)"
            what += ", experts expert-parallel" if kind == "dp" and c.expert_parallel else ""
            lines.append(f"  mesh dim {d} {names[d]!r} (size {self.mesh_shape[d]}): {what}")
        lines.append("")
        lines.extend(self._code())
        lines.extend(f"# {note}" for note in self.notes)
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
            "  peak memory per rank (parameters + gradients + AdamW states"
            + (" + gathered fully_shard units" if c.dp_dims and c.dp_mode == "fully_shard" else "")
            + f" + activations kept for backward): {m.memory_per_rank:,} B"
        )
        lines.append(f"  parameters per rank: {m.parameter_bytes:,} B")
        lines.append(f"  activations kept for backward per rank: {m.activation_bytes:,} B")
        feasible = sum(1 for s in self.considered if s.measurement.feasible)
        took = f" in {self.timings['plan_s']:.1f} s" if "plan_s" in self.timings else ""
        lines.append(f"  searched {len(self.considered)} candidates ({feasible} feasible){took}")
        untimed = [s for s in self.considered if s.time_error is not None]
        if untimed:
            lines.append(
                f"  {len(untimed)} feasible candidate(s) could not be timed and were ranked last, e.g. "
                f"{untimed[0].candidate}: {untimed[0].time_error}"
            )
        return "\n".join(lines)

    __repr__ = __str__

    def _mesh_line(self) -> tuple[str, dict[str, str]]:
        """The mesh as the code makes it, and each role's sub-mesh expression ("dp", "tp")."""
        c, names, shape = self.candidate, self.mesh_dim_names, self.mesh_shape
        if len(c.dp_dims) <= 1:
            line = f'mesh = so.init_device_mesh("cpu", {shape}, mesh_dim_names={names})'
            subs = {kind: "mesh" if len(shape) == 1 else f"mesh[{names[d]!r}]" for d, kind in enumerate(c.dims)}
            return line, subs
        dp = math.prod(shape[d] for d in c.dp_dims)
        new_shape = (dp,) if c.tp_dim is None else (dp, shape[c.tp_dim])
        new_names = ("dp",) if c.tp_dim is None else ("dp", "tp")
        order = [*c.dp_dims, *([c.tp_dim] if c.tp_dim is not None else [])]
        flattened = ", ".join(repr(names[d]) for d in c.dp_dims)
        if order == sorted(order):  # the dp dims lead: row-major, a plain reshape of the mesh
            line = f'mesh = so.init_device_mesh("cpu", {new_shape}, mesh_dim_names={new_names})'
        else:
            line = (
                f'mesh = so.DeviceMesh("cpu", torch.arange({math.prod(shape)}).reshape({shape})'
                f".permute{tuple(order)}.reshape({new_shape}), mesh_dim_names={new_names})"
            )
        line += f"  # mesh dims {flattened} as one dp dim"
        subs = {"dp": "mesh" if c.tp_dim is None else "mesh['dp']", "tp": "mesh['tp']"}
        return line, subs

    def _code(self) -> list[str]:
        """The code a person writes for this plan: the mesh, the tensor-parallel plan, the data parallelism."""
        c = self.candidate
        line, subs = self._mesh_line()
        lines = [line]
        if c.tp_dim is not None:
            lines.append(f"parallelize_module(model, {subs['tp']}, {{")
            lines.extend(f"    {e.key!r}: {e.text}," for e in self.chosen.entries if e.mesh == "tp")
            lines.append("})")
        if not c.dp_dims:
            return lines
        dp = subs["dp"]
        experts = [e for e in self.chosen.entries if e.mesh == "data"]
        if experts:
            lines.append("# experts sharded over the data-parallel ranks (tokens routed by all_to_all), each tensor-")
            lines.append("# parallel over tp if any; fully_shard/replicate leave them as they are")
            lines.append(f"parallelize_module(model, {'mesh' if c.tp_dim is not None else dp}, {{")
            lines.extend(f"    {e.key!r}: {e.text}," for e in experts)
            lines.append("})")
        if c.dp_mode == "replicate":
            lines.append(f"replicate(model, device_mesh={dp})")
        else:
            args = f"mesh={dp}, reshard_after_forward={c.reshard_after_forward}"
            if self.blocks:
                lines.append(f"for block in {self.blocks_text}:")
                lines.append(f"    fully_shard(block, {args})")
            lines.append(f"fully_shard(model, {args})")
        lines.append("# each rank feeds its own slice of the global batch: plan.local_batch(batch), i.e.")
        lines.append(f"# batch.chunk({math.prod(self.mesh_shape[d] for d in c.dp_dims)})[this rank's index over {dp}]")
        return lines

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
        lines.extend(f"note: {note}" for note in self.notes)  # what the plan computes (BatchNorm's statistics)
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
