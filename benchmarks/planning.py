"""Planning time vs mesh ndim: uncached sharding propagation + redistribution planning.

    python -m benchmarks.planning [--quick]

Metadata only: no world, no data, no collectives. For each mesh (1 to 4 dims,
up to 4096 ranks) and op, the op is planned on `TensorSpec` operands with
`shardops.dispatch.core.plan_op` (the best-first search over the rule rows of
each mesh dim, as the runtime plans) and the cheapest candidate's input redistributions are
planned exactly with `shardops.redistribute.plan` (Dijkstra over placement
states). The caches (plans and searches, the dispatch decision cache) are cleared
before every measurement, so each figure is a cold plan: the cost of the
first call of an op on a new layout.

Layouts: the first tensor dim is sharded on mesh dim 0 and the op's reduced
dim (dim 1) on every other mesh dim (a 1-D mesh shards dim 1), so the
reducing ops plan their sharded algorithms, and the redistribution to the
chosen input layout is non-trivial wherever the cost model moves an input.
Separately, `redistribute.plan` alone from that layout to all-Replicate and
to the transposed layout (dims 0 and 1 swapped) shows the planner's own curve.

A second table plans cold through the public `so.explain` (a new shape on
every call, so nothing is cached): the EXPLAIN_OPS (sum, add, softmax, var, cumsum, layer_norm) on x = f32[1024, 32768]
sharded S(1) on (4096,) and S(0),S(1),S(1),S(1) on (8, 8, 8, 8), the 4-D time
over the 1-D time, and the choice. Times are this process's CPU time, the
minimum over a few calls (the least disturbed by other work on the machine);
they are never asserted.

torch.distributed.tensor has no public metadata-only planning entry point, so
this benchmark has no DTensor column.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardops import Replicate, Shard, caches
from shardops.dispatch import core
from shardops.mesh import DeviceMesh
from shardops.planner.choice import with_plans
from shardops.redistribute import plan
from shardops.spec import TensorMeta, TensorSpec, contiguous_stride

aten = torch.ops.aten
ROWS, COLS = 1024, 32768  # f32[1024, 32768]: the size only enters the cost model

MESHES_FULL: tuple[tuple[int, ...], ...] = (
    (4,),
    (4096,),
    (2, 2),
    (64, 64),
    (2, 2, 2),
    (16, 16, 16),
    (2, 2, 2, 2),
    (8, 8, 8, 8),
)
MESHES_QUICK: tuple[tuple[int, ...], ...] = ((4096,), (64, 64), (16, 16, 16), (8, 8, 8, 8))


def _spec(mesh: DeviceMesh, shape: Sequence[int], placements: Sequence[Any], dtype=torch.float32) -> TensorSpec:
    return TensorSpec(mesh, tuple(placements), TensorMeta(tuple(shape), contiguous_stride(shape), dtype))


def layout(ndim: int) -> tuple[Any, ...]:
    """S(0) on mesh dim 0 and S(1) on the others; S(1) on a 1-D mesh."""
    if ndim == 1:
        return (Shard(1),)
    return (Shard(0),) + (Shard(1),) * (ndim - 1)


def transposed(ndim: int) -> tuple[Any, ...]:
    return tuple(Shard(1 - p.dim) for p in layout(ndim))


def op_calls(mesh: DeviceMesh) -> dict[str, tuple[Any, tuple, dict]]:
    """name -> (aten overload, args with TensorSpec operands, kwargs)."""
    pl = layout(mesh.ndim)
    rep = (Replicate(),) * mesh.ndim
    x = _spec(mesh, (ROWS, COLS), pl)
    y = _spec(mesh, (ROWS, COLS), pl)
    w = _spec(mesh, (COLS,), rep)
    b = _spec(mesh, (COLS,), rep)
    return {
        "add": (aten.add.Tensor, (x, y), {}),
        "sum(dim=1)": (aten.sum.dim_IntList, (x, [1]), {}),
        "softmax(dim=1)": (aten._softmax.default, (x, 1, False), {}),
        "layer_norm": (aten.native_layer_norm.default, (x, [COLS], w, b, 1e-5), {}),
    }


EXPLAIN_OPS: tuple[tuple[str, str, str], ...] = (  # name, expression, its tensors
    ("sum(x, dim=1)", "sum(x, dim=1)", "x"),
    ("add(x, y)", "add(x, y)", "xy"),
    ("softmax(x, dim=1)", "softmax(x, dim=1)", "x"),
    ("var(x, dim=1)", "var(x, dim=1)", "x"),
    ("cumsum(x, dim=1)", "cumsum(x, dim=1)", "x"),
    ("layer_norm(x, [H], w, b)", "layer_norm(x, [{cols}], w, b)", "xwb"),
)
EXPLAIN_MESHES: tuple[tuple[tuple[int, ...], str], ...] = (((4096,), "S(1)"), ((8, 8, 8, 8), "S(0),S(1),S(1),S(1)"))


def measure_explain(reps: int = 5) -> list[dict[str, Any]]:
    """Cold `so.explain` per (op, mesh): a new column count on every call, so no cache can answer."""
    import shardops as so

    so.explain("sum(x, dim=1)", mesh=(4,), x="f32[8,8]:S(1)")  # one-time torch meta warm-up is not planning
    fresh = iter(range(1, 10**6))
    rows = []
    for name, template, tensors in EXPLAIN_OPS:
        per_mesh = {}
        for shape, layout in EXPLAIN_MESHES:
            times, last = [], None
            for _ in range(reps):
                cols = COLS + next(fresh)
                specs = {
                    "x": f"f32[{ROWS},{cols}]:{layout}",
                    "y": f"f32[{ROWS},{cols}]:{layout}",
                    "w": f"f32[{cols}]",
                    "b": f"f32[{cols}]",
                }
                kw = {k: specs[k] for k in tensors}
                expr = template.format(cols=cols)
                start = time.process_time()  # CPU time: other work on a shared machine does not count
                last = so.explain(expr, mesh=shape, **kw)
                times.append(time.process_time() - start)
            step = last.steps[-1]
            per_mesh[len(shape)] = (min(times), step)
        (t1, _), (t4, s4) = per_mesh[1], per_mesh[4]
        rows.append(
            {
                "op": name,
                "one_d_us": t1 * 1e6,
                "four_d_us": t4 * 1e6,
                "ratio": t4 / t1,
                "candidates_4d": s4.total,
                "choice_4d": " ".join("[" + ",".join(map(repr, pl)) + "]" for pl in s4.chosen.inputs)
                + f" ({s4.chosen.label})",
            }
        )
    return rows


def format_explain_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| op | (4096,) S(1) (µs) | (8,8,8,8) S(0),S(1),S(1),S(1) (µs) | 4-D / 1-D | 4-D candidates | 4-D choice "
        "(inputs) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['one_d_us']:.0f} | {r['four_d_us']:.0f} | {r['ratio']:.1f}× | {r['candidates_4d']} | "
            f"{r['choice_4d']} |"
        )
    return "\n".join(lines)


def clear_caches() -> None:
    caches.invalidate()


def _median_time(fn: Callable[[], Any], min_reps: int, max_reps: int, budget_s: float) -> tuple[float, Any]:
    """Median seconds of `fn` over cold runs (caches cleared before each), and its last result."""
    times, out = [], None
    deadline = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < deadline):
        clear_caches()
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _plan_op_cold(func, args, kwargs) -> tuple[float, float, Any]:
    """(propagation s, redistribution planning s, report) of one cold plan."""
    clear_caches()
    t0 = time.perf_counter()
    report = core.plan_op(func, args, kwargs, limit=1)  # what the runtime needs: the best candidate
    t1 = time.perf_counter()
    if report.candidates:
        specs = report.schema.tensor_specs
        with_plans(report.candidates[0], specs)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, report


def measure_planning(
    meshes: Sequence[Sequence[int]] = MESHES_FULL, min_reps: int = 3, max_reps: int = 30, budget_s: float = 0.3
) -> list[dict[str, Any]]:
    """One row per (mesh, op), plus rows for `redistribute.plan` alone (op "redistribute -> R",
    "redistribute -> transposed"). Times in µs (medians of cold runs)."""
    rows = []
    for shape in meshes:
        shape = tuple(shape)
        mesh = DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape))
        base = {
            "mesh": shape,
            "mesh_ndim": len(shape),
            "ranks": math.prod(shape),
            "layout": ",".join(map(repr, layout(len(shape)))),
        }
        for name, (func, args, kwargs) in op_calls(mesh).items():
            _plan_op_cold(func, args, kwargs)  # one-time costs (imports, first meta kernels) are not planning
            props, redists, report = [], [], None
            deadline = time.perf_counter() + budget_s
            while len(props) < max_reps and (len(props) < min_reps or time.perf_counter() < deadline):
                p, r, report = _plan_op_cold(func, args, kwargs)
                props.append(p)
                redists.append(r)
            best = report.candidates[0] if report.candidates else None
            rows.append(
                {
                    **base,
                    "op": name,
                    "propagation_us": statistics.median(props) * 1e6,
                    "redistribution_us": statistics.median(redists) * 1e6,
                    "total_us": statistics.median(p + r for p, r in zip(props, redists)) * 1e6,
                    "candidates": getattr(report.candidates, "total", len(report.candidates)),  # the space searched
                    "fallback": report.fallback,
                    "choice": best.describe() if best else "replicate fallback",
                    "choice_label": best.label if best else "",
                    "reps": len(props),
                }
            )
        x = _spec(mesh, (ROWS, COLS), layout(mesh.ndim))
        for name, dst in (
            ("redistribute -> R", (Replicate(),) * mesh.ndim),
            ("redistribute -> transposed", transposed(mesh.ndim)),
        ):
            t, p = _median_time(lambda: plan(x, dst), min_reps, max_reps, budget_s)  # noqa: B023 - timed at once
            rows.append(
                {
                    **base,
                    "op": name,
                    "propagation_us": 0.0,
                    "redistribution_us": t * 1e6,
                    "total_us": t * 1e6,
                    "candidates": None,
                    "fallback": False,
                    "choice": " ; ".join(map(repr, p.steps)),
                    "choice_label": "",
                    "reps": None,
                }
            )
    clear_caches()
    return rows


def growth(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """op -> {mesh ndim: total µs} on the largest mesh of each ndim (4096 ranks where measured)."""
    out: dict[str, dict[int, tuple[int, float]]] = {}
    for r in rows:
        cur = out.setdefault(r["op"], {}).get(r["mesh_ndim"])
        if cur is None or r["ranks"] >= cur[0]:
            out[r["op"]][r["mesh_ndim"]] = (r["ranks"], r["total_us"])
    return {op: {nd: v[1] for nd, v in sorted(d.items())} for op, d in out.items()}


def _fmt_mesh(shape: Sequence[int]) -> str:
    return "(" + ",".join(map(str, shape)) + (",)" if len(shape) == 1 else ")")


def format_planning_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| op | mesh | ranks | propagation (µs) | redistribution planning (µs) | total (µs) | candidates | choice |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        cands = "—" if r["candidates"] is None else str(r["candidates"])
        choice = r["choice"] + (f" ({r['choice_label']})" if r["choice_label"] else "")
        if r["fallback"]:
            choice = "no strategy: replicate fallback"
        lines.append(
            f"| {r['op']} | {_fmt_mesh(r['mesh'])} | {r['ranks']} | {r['propagation_us']:.0f} | "
            f"{r['redistribution_us']:.0f} | {r['total_us']:.0f} | {cands} | {choice} |"
        )
    return "\n".join(lines)


def format_growth_table(rows: Sequence[dict[str, Any]]) -> str:
    g = growth(rows)
    ndims = sorted({nd for d in g.values() for nd in d})
    lines = [
        "| op | " + " | ".join(f"{nd}-D (µs)" for nd in ndims) + " | growth per added mesh dim |",
        "|---|" + "---:|" * len(ndims) + "---|",
    ]
    for op, d in g.items():
        vals = [d.get(nd) for nd in ndims]
        steps = [b / a for a, b in zip(vals, vals[1:]) if a and b]
        per_dim = "×" + ", ×".join(f"{s:.1f}" for s in steps) if steps else "—"
        lines.append(f"| {op} | " + " | ".join("—" if v is None else f"{v:.0f}" for v in vals) + f" | {per_dim} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the 4096-rank meshes, fewer repetitions")
    args = parser.parse_args(argv)
    rows = measure_planning(MESHES_QUICK if args.quick else MESHES_FULL, max_reps=10 if args.quick else 30)
    print("## Planning time per op, uncached (median of cold runs)\n")
    print(format_planning_table(rows))
    print("\n## Growth with mesh ndim (largest mesh of each ndim)\n")
    print(format_growth_table(rows))
    print(
        "\n## Cold planning through so.explain, f32[1024, 32768] (CPU time, minimum of 5 calls; target 4-D <= 6x 1-D)\n"
    )
    print(format_explain_table(measure_explain(3 if args.quick else 5)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
