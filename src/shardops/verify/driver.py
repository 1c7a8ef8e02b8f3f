"""Driving a verify run: plan the cases of every op and mesh, run them, fill the report.

    samples (samples.py)  x  dtypes  x  meshes (4,), (2,2), (2,2,2)
      x  input layouts (layouts.py): one placement per mesh dim for every tensor operand,
         Shard(d), Replicate and the pending kinds P(sum/avg/max/min/product), NormP(2)
      +  one case per sharded algorithm of the op and mesh, with that algorithm forced (forcing.py)

The default run is a seeded sample (a budget of cases per op and mesh, see
layouts.DEFAULT_BUDGET); `full=True` runs every layout combination of every
sample and dtype, plus the forced cases.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Sequence
from itertools import groupby
from typing import Any

import torch

from .. import caches
from .._torch import pytree
from .._torch.dispatch import OpOverload
from ..dispatch import core, registry
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..notation import mesh_name, parse_mesh_shape
from ..placements import Replicate
from ..spec import TensorMeta, TensorSpec, contiguous_stride
from ..world import run
from ..wrapping import wrap
from . import forcing, runner
from .cases import build, replace_tensors
from .layouts import DEFAULT_BUDGET, Case, all_cases, describe_layouts, sampled_cases
from .references import Prepared, call, prepare, seed_key
from .report import Failure, OpRow, VerifyReport, print_report, repro_line
from .runner import run_cases
from .targets import Target, discover, select

MESHES = {"4": (4,), "2x2": (2, 2), "2x2x2": (2, 2, 2)}
PROBE_RANKS = 4  # the 1-D mesh on which an op's algorithms are listed
TORCH_FUNCTION_BUDGET_SHARE = 0.5  # torch-level entries mostly re-run the aten ops they wrap


def parse_mesh(mesh: str | Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """(name, shape) of a mesh given as "2x2" or (2, 2)."""
    shape = parse_mesh_shape(mesh, "verify")
    return mesh_name(shape), shape


def parse_part(part: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """(K, N) of a part given as "K/N" or (K, N), 0 <= K < N."""
    if part is None:
        return None
    try:
        k, n = (int(v) for v in (part.split("/") if isinstance(part, str) else part))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise ShardingError(f"verify: --part {part!r} is not K/N with 0 <= K < N (e.g. 0/4 ... 3/4)")
    return k, n


# ------------------------------------------------------------------ the sharded algorithms an op can run


def algorithm_labels(target: Target, prepared: Sequence[Prepared]) -> list[set[str]]:
    """Per prepared sample, the labels of the sharded algorithms the op can run on it.

    An aten op with a rule: its rows, planned on a 1-D mesh of 4 (each candidate is one row).
    A torch-level entry (torch.cumsum, F.rms_norm, ...): the algorithms of the aten ops it reaches,
    found by a probe run of its float64 samples (values only, Replicate inputs).
    """
    fn = target.fn
    if isinstance(fn, OpOverload):
        return _planned_labels(fn, prepared) if fn in registry.RULES else [set() for _ in prepared]
    return _probed_labels(target, prepared)


def _specs_on(mesh: DeviceMesh, prep: Prepared) -> list[TensorSpec]:
    replicate = (Replicate(),) * mesh.ndim
    return [
        TensorSpec(mesh, replicate, TensorMeta(tuple(t.shape), contiguous_stride(t.shape), t.dtype))
        for t in prep.tensors
    ]


def _planned_labels(fn, prepared: Sequence[Prepared]) -> list[set[str]]:
    mesh = DeviceMesh("cpu", torch.arange(PROBE_RANKS))
    found: list[set[str]] = []
    for prep in prepared:
        args, kwargs = pytree.tree_unflatten(replace_tensors(prep.leaves, _specs_on(mesh, prep)), prep.tree)
        try:
            report = core.plan_op(fn, args, kwargs)
        except Exception:  # noqa: BLE001 - the rule refuses this sample: it offers no algorithm for it
            found.append(set())
            continue
        found.append(forcing.labels_of(report.candidates))
    return found


def _probed_labels(target: Target, prepared: Sequence[Prepared]) -> list[set[str]]:
    mesh = DeviceMesh("cpu", torch.arange(PROBE_RANKS))
    found: list[set[str]] = [set() for _ in prepared]
    with forcing.forcing(None):  # the planner's hook, which sees what is offered
        for i, prep in enumerate(prepared):
            _probe_one(target, prep, mesh, found[i])
    return found


def _probe_one(target: Target, prep: Prepared, mesh: DeviceMesh, found: set[str]) -> None:
    if prep.dtype != torch.float64:
        return
    specs = _specs_on(mesh, prep)

    def probe() -> None:
        leaves = replace_tensors(prep.leaves, [wrap(t.clone(), s) for t, s in zip(prep.tensors, specs)])
        with forcing.offering() as offered:
            call(target.fn, prep.tree, leaves)
        found.update(offered)

    caches.invalidate()  # a cached decision is not offered again
    try:
        run(probe, PROBE_RANKS, timeout=runner.CASE_TIMEOUT)
    except Exception:  # noqa: BLE001 - the sample fails on DTensors: its cases report that
        pass


def forced_cases(
    prepared: Sequence[Prepared], labels: Sequence[set[str]], mesh_shape, first_index: int, seed: int
) -> list[Case]:
    """One case per sharded algorithm: a sampled layout of a sample whose rows offer it, the algorithm forced."""
    cases: list[Case] = []
    for label in sorted(set().union(*labels)) if labels else []:
        fits = [i for i, found in enumerate(labels) if label in found]
        picked = sampled_cases([prepared[i] for i in fits], mesh_shape, 1, seed_key(label, mesh_shape, seed))
        cases += [Case(first_index + len(cases), fits[c.prepared], c.layouts, force=label) for c in picked]
    return cases


# ------------------------------------------------------------------ planning the cases


def _budget_for(target: Target, mesh_shape, budget: int | None) -> int:
    base = budget if budget is not None else DEFAULT_BUDGET.get(len(mesh_shape), 3)
    if target.kind == "torch_function" and budget is None:
        return max(2, int(base * TORCH_FUNCTION_BUDGET_SHARE))
    return base


def plan_cases(
    target: Target, prepared, labels, mesh: str, mesh_shape, full: bool, budget: int | None, seed: int
) -> list[Case]:
    if not prepared:
        return []
    if full:
        cases = list(all_cases(prepared, mesh_shape))
    else:
        cases = sampled_cases(
            prepared, mesh_shape, _budget_for(target, mesh_shape, budget), seed_key(target.name, mesh, seed)
        )
    return cases + forced_cases(prepared, labels, mesh_shape, len(cases), seed_key(target.name, mesh, seed))


# ------------------------------------------------------------------ the run


def verify(
    ops: str | Sequence[str] | None = None,
    meshes: Sequence[str | Sequence[int]] | None = None,
    *,
    full: bool = False,
    budget: int | None = None,
    seed: int = 0,
    case: int | None = None,
    part: str | tuple[int, int] | None = None,
    json_path: str | None = None,
    progress: bool = True,
    console: Any = None,
) -> VerifyReport:
    """Check registered ops against single-device torch; see the module docstring. Prints as it goes.

    `part` (K, N) or "K/N" keeps the cases whose index is K mod N: N such runs make the whole run.
    """
    from rich.console import Console

    console = console or Console()
    filters = [ops] if isinstance(ops, str) else list(ops or [])
    mesh_list = [parse_mesh(m) for m in (meshes or list(MESHES))]
    targets_all, skipped = discover()
    targets = select(targets_all, filters)
    if filters and not targets:
        raise ShardingError(f"verify: no registered op matches {filters}; `shardops verify --list` shows them")
    if case is not None and (len(targets) != 1 or len(mesh_list) != 1):
        raise ShardingError("verify: --case needs exactly one op (--op NAME) and one mesh (--mesh ...)")
    settings = {
        "ops": filters,
        "meshes": [m for m, _ in mesh_list],
        "full": full,
        "budget": budget,
        "seed": seed,
        "case": case,
        "part": parse_part(part),
    }
    t0 = time.perf_counter()
    with warnings.catch_warnings(), forcing.installed():  # a fresh decision cache before and after: tests patch rules
        warnings.simplefilter("ignore")
        report = _verify_targets(targets, mesh_list, settings, console, progress)
    report.skipped = skipped
    report.elapsed = time.perf_counter() - t0
    print_report(report, console)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report.to_dict(), f, indent=1, default=str)
    return report


def _verify_targets(targets, mesh_list, settings, console, progress) -> VerifyReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    rows: dict[str, OpRow] = {}
    failures: list[Failure] = []
    plans = []
    for t in targets:
        prepared, reason = prepare(t, settings["seed"])
        labels = algorithm_labels(t, prepared)
        row = rows.setdefault(t.group, OpRow(t.group))
        row.overloads.append(t.name)
        row.algorithms_registered.update(
            *labels, registry.ALGORITHMS.get(t.fn, ())
        )  # what its rows offer, and what its rule declares
        row.check_coverage = settings["case"] is None and settings["part"] is None  # a part may miss an algorithm
        if not prepared:
            row.no_samples.append(f"{t.name}: {reason}")
        for mesh, shape in mesh_list:
            cases = plan_cases(t, prepared, labels, mesh, shape, settings["full"], settings["budget"], settings["seed"])
            if settings["case"] is not None:
                if not 0 <= settings["case"] < len(cases):
                    raise ShardingError(
                        f"verify: {t.name} on mesh {mesh} has cases 0..{len(cases) - 1}, not {settings['case']}"
                    )
                cases = [cases[settings["case"]]]
            elif settings["part"] is not None:
                k, n = settings["part"]
                cases = [c for c in cases if c.index % n == k]
            plans.append((t, prepared, mesh, shape, cases))
    total = sum(len(p[-1]) for p in plans)
    mode = "every layout combination (--full)" if settings["full"] else "a seeded sample"
    if settings["part"] is not None:
        mode += f", part {settings['part'][0]}/{settings['part'][1]}"
    console.print(
        f"verify: {total} cases over {len(targets)} registered ops on meshes {', '.join(settings['meshes'])}: {mode}, "
        "plus each sharded algorithm forced",
        highlight=False,
    )
    columns = [TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not progress, transient=True) as bar:
        task = bar.add_task("verify", total=total)
        for t, prepared, mesh, shape, cases in plans:
            bar.update(task, description=f"{t.name} [{mesh}]")
            t0 = time.perf_counter()
            _run_unit(t, prepared, mesh, shape, cases, rows[t.group], failures, settings)
            rows[t.group].seconds += time.perf_counter() - t0
            bar.advance(task, len(cases))
    return VerifyReport(rows, failures, {}, settings)


def _run_unit(
    t: Target, prepared, mesh_name_: str, shape, cases: list[Case], row: OpRow, failures: list[Failure], settings
) -> None:
    if not cases:
        return
    mesh = DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape))
    built = []
    for c in cases:
        try:
            built.append(build(t, prepared[c.prepared], c, mesh, settings["seed"]))
        except Exception as e:  # noqa: BLE001 - a verify bug must not hide the other results
            row.cases += 1
            row.failed += 1
            failures.append(
                Failure(
                    t.name,
                    mesh_name_,
                    c.index,
                    _layouts_text(prepared[c.prepared], c),
                    prepared[c.prepared].label,
                    f"could not build the case: {type(e).__name__}: {e}",
                    "",
                    repro_line(t.name, mesh_name_, c.index, settings),
                )
            )
    by_force = lambda b: b.case.force or ""  # noqa: E731
    for force, same_force in groupby(sorted(built, key=by_force), key=by_force):
        group = list(same_force)
        with forcing.forcing(force or None):
            outcomes = run_cases(group, mesh.size())
        for b, o in zip(group, outcomes):
            _record(b, o, t, mesh_name_, row, failures, settings)


def _record(b, o, t: Target, mesh: str, row: OpRow, failures: list[Failure], settings) -> None:
    row.cases += 1
    row.grad_cases += o.grad_error is not None
    row.worst = max(row.worst, o.error, o.grad_error or 0.0)
    row.algorithms_run.update(
        o.algorithms & row.algorithms_registered
    )  # the op's own; the ops it reaches have their rows
    if o.problem is None:
        row.passed += 1
        return
    row.failed += 1
    failures.append(
        Failure(
            t.name,
            mesh,
            b.case.index,
            _layouts_text(b.prep, b.case),
            b.prep.label,
            o.problem,
            o.out_placements,
            repro_line(t.name, mesh, b.case.index, settings),
        )
    )


def _layouts_text(prep: Prepared, case: Case) -> str:
    forced = f" [forced: {case.force}]" if case.force else ""
    return describe_layouts(prep, case.layouts) + forced
