"""shardops vs torch.distributed.tensor, side by side: `shardops bench` / `python -m benchmarks.run`.

    python -m benchmarks.run --quick            # < 3 min on 2 cores
    python -m benchmarks.run                    # larger sizes, more repetitions
    python -m benchmarks.run --only comm overhead --out /tmp/bench

Four benchmarks, each reported as a markdown table (case, shardops, DTensor,
ratio shardops/DTensor, lower bound where one applies) with its target met or
missed:

1. comm: collectives, bytes per rank and rounds of every anchor case of
   `benchmarks.cases` on meshes (4,) and (2,2), both systems, and whether
   each result equals single-device torch;
2. overhead: µs per op on a cache hit, fake process group (`benchmarks.overhead`);
3. end_to_end: the demo's transformer-step slice on 2 gloo processes
   (`benchmarks.end_to_end`);
4. planning: cold propagation + redistribution planning time vs mesh ndim
   (`benchmarks.planning`).

Written to the output dir (default `bench_out/`): `report.md` (every table),
`README_SNIPPET.md` (the same, with the command and the machine, to paste into
the README), `results.json` (every figure) and `bytes_per_case.png` (needs the
`plot` extra: `pip install 'shardops[plot]'`; skipped with a message without it).

A benchmark that crashes is reported as such and the others still run; the
exit code is 1 then, 0 otherwise (a missed target is a result, not a failure).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

BENCHMARKS = ("comm", "overhead", "end_to_end", "planning", "random")
TARGET_BYTES_RATIO = 1.0  # shardops bytes / DTensor bytes, every case
TARGET_GATHER_SAVING = 30.0  # DTensor bytes / shardops bytes where DTensor moves the sharded dim

QUICK = {"overhead": {"iters": 400, "repeats": 7}, "end_to_end": {"size": "quick"}, "planning": {"meshes": "quick", "max_reps": 10},
         "random": {"repeats": 3}}
FULL = {"overhead": {"iters": 2000, "repeats": 7}, "end_to_end": {"size": "full"}, "planning": {"meshes": "full", "max_reps": 30}, "random": {}}


# --- 1. communication ------------------------------------------------------------------------


def _local_input_bytes(case_name: str, mesh: Sequence[int]) -> int:
    """Bytes of rank 0's shard of the case's first input (the tensor whose dim is reduced)."""
    from benchmarks.cases import CASES_BY_NAME, _SHARD_RE

    case = CASES_BY_NAME[case_name]
    t = case.inputs()[0]
    parts = 1
    for size, p in zip(mesh, case.placement_specs(mesh)[0]):
        if _SHARD_RE.fullmatch(p):
            parts *= size
    return t.numel() * t.element_size() // parts


def dtensor_moves_sharded_dim(dt_row: dict[str, Any]) -> bool:
    """Whether DTensor all-gathers or all-to-alls whole shards (a call moving >= half of the input shard)."""
    threshold = _local_input_bytes(dt_row["case"], dt_row["mesh"]) / 2
    return any(c["kind"] in ("all_gather", "all_to_all") and c["bytes"] >= threshold for c in dt_row["calls"])


def compare_comm(so_rows: Sequence[dict[str, Any]], dt_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join the two sides by (case, mesh) and judge the byte targets per row."""
    dt_by_key = {(r["case"], tuple(r["mesh"])): r for r in dt_rows}
    out = []
    for s in so_rows:
        d = dt_by_key[(s["case"], tuple(s["mesh"]))]
        both_ran = s["error"] is None and d["error"] is None
        ratio = None
        if both_ran:
            ratio = s["bytes"] / d["bytes"] if d["bytes"] else (1.0 if s["bytes"] == 0 else math.inf)
        row = {
            "case": s["case"],
            "mesh": tuple(s["mesh"]),
            "placements": s["placements"],
            "shardops": s,
            "DTensor": d,
            "ratio": ratio,
            "lower_bound_bytes": s["lower_bound_bytes"],
            "dtensor_moves_sharded_dim": d["error"] is None and dtensor_moves_sharded_dim(d),
        }
        row["bytes_target"] = _judge_bytes(s, d, ratio)
        row["gather_target"] = _judge_gather(row)
        out.append(row)
    return out


def _judge_bytes(s: dict, d: dict, ratio: float | None) -> str:
    if s["error"] is not None:
        return "missed: shardops raises"
    if d["error"] is not None:
        return "n/a: DTensor raises"
    return "met" if ratio <= TARGET_BYTES_RATIO else "missed"


def _judge_gather(row: dict[str, Any]) -> str:
    """The ≥30× target, where DTensor moves the sharded dim; 'n/a' elsewhere."""
    if not row["dtensor_moves_sharded_dim"]:
        return "n/a"
    s, d = row["shardops"], row["DTensor"]
    if s["error"] is not None:
        return "missed: shardops raises"
    if s["bytes"] * TARGET_GATHER_SAVING <= d["bytes"]:
        return "met"
    if row["lower_bound_bytes"] * TARGET_GATHER_SAVING > d["bytes"]:
        return f"missed: the floor allows at most {d['bytes'] / row['lower_bound_bytes']:.1f}× less"
    if s.get("fallbacks"):
        return "missed: shardops falls back (" + ", ".join(s["fallbacks"]) + ")"
    return "missed"


def _fmt_mesh(shape: Sequence[int]) -> str:
    return "(" + ",".join(str(s) for s in shape) + (",)" if len(shape) == 1 else ")")


def _fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}×{v}" for k, v in sorted(counts.items())) or "none"


def _check(side: dict[str, Any]) -> str:
    return {"ok": "✓", "wrong": "✗ WRONG", "raises": "raises"}[side["status"]]


def _target_cell(judgement: str) -> str:
    return "**MISSED**" + judgement[len("missed") :] if judgement.startswith("missed") else judgement


def format_comm_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| case | mesh | layout | shardops bytes | DTensor bytes | ratio | lower bound | rounds so / DT | shardops collectives "
        "| DTensor collectives | correct so / DT | ≤ DTensor | ≥ 30× less |",
        "|---|---|---|---:|---:|---:|---:|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for r in rows:
        s, d = r["shardops"], r["DTensor"]
        cells = []
        for name, side in (("shardops", s), ("DTensor", d)):
            if side["error"] is not None:
                notes.append(f"{name} on {r['case']} {_fmt_mesh(r['mesh'])}: {side['error']}")
                cells.append(f"error [{len(notes)}]")
            else:
                cells.append(f"{side['bytes']:,}")
        so_coll = "—" if s["error"] else _fmt_counts(s["counts"])
        if s.get("fallbacks"):
            so_coll += " (fallback: " + ", ".join(s["fallbacks"]) + ")"
        dt_coll = "—" if d["error"] else _fmt_counts(d["counts"])
        if d.get("alltoall_fallbacks"):
            dt_coll += f" ({d['alltoall_fallbacks']} all_gather for all_to_all)"
        if r["ratio"] is None:
            ratio = "—"
        elif r["ratio"] == 0:
            ratio = "0"
        else:
            saving = 1 / r["ratio"]
            ratio = f"{r['ratio']:.3g} ({saving:.{0 if saving >= 10 else 1}f}× less)" if r["ratio"] < 1 else f"{r['ratio']:.3g}"
        lines.append(
            f"| {r['case']} | {_fmt_mesh(r['mesh'])} | [{','.join(r['placements'][0])}] | {cells[0]} | {cells[1]} | {ratio} | {r['lower_bound_bytes']:,} "
            f"| {s['rounds']} / {d['rounds']} | {so_coll} | {dt_coll} | {_check(s)} / {_check(d)} "
            f"| {_target_cell(r['bytes_target'])} | {_target_cell(r['gather_target'])} |"
        )
    text = "\n".join(lines)
    if notes:
        text += "\n\n" + "\n".join(f"[{i}] {n.replace('|', '/')}" for i, n in enumerate(notes, 1))
    return text


def measure_comm(cases: Sequence[str] | None = None) -> dict[str, Any]:
    from benchmarks.cases import MESH_SHAPES
    from benchmarks.dtensor_side import measure_dtensor
    from benchmarks.shardops_side import measure_shardops

    so_rows = measure_shardops(cases, MESH_SHAPES)
    dt_rows = measure_dtensor(cases, MESH_SHAPES)
    return {"rows": compare_comm(so_rows, dt_rows)}


# --- chart ---------------------------------------------------------------------------------------


def plot_bytes(rows: Sequence[dict[str, Any]], path: Path) -> str | None:
    """Grouped bars of bytes per case (log scale), one panel per mesh; None, or why no chart."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'shardops[plot]'): no chart"
    meshes = sorted({r["mesh"] for r in rows}, key=len)
    fig, axes = plt.subplots(len(meshes), 1, figsize=(14, 4.2 * len(meshes)), squeeze=False)
    series = (("shardops", "tab:blue"), ("DTensor", "tab:orange"), ("lower bound", "tab:gray"))
    for ax, mesh in zip(axes[:, 0], meshes):
        mrows = [r for r in rows if r["mesh"] == mesh]
        width = 0.27
        for k, (name, color) in enumerate(series):
            values = []
            for r in mrows:
                if name == "lower bound":
                    values.append(r["lower_bound_bytes"])
                else:
                    side = r[name]
                    values.append(float("nan") if side["error"] else max(side["bytes"], 1))  # log scale: 0 is labelled
            xs = [i + (k - 1) * width for i in range(len(mrows))]
            ax.bar(xs, values, width, label=name, color=color)
            for x, r in zip(xs, mrows):
                side = r.get(name)
                if side is not None and (side["error"] or side["bytes"] == 0):
                    label = "error" if side["error"] else "0"
                    ax.text(x, 1.3, label, rotation=90, ha="center", va="bottom", fontsize=7, color=color)
        ax.set_yscale("log")
        ax.set_ylim(bottom=1)
        ax.set_ylabel("bytes / rank (rank 0)")
        ax.set_title(f"mesh {_fmt_mesh(mesh)}: bytes rank 0 puts into collectives, per case (log scale)")
        ax.set_xticks(range(len(mrows)))
        ax.set_xticklabels([r["case"] for r in mrows], rotation=40, ha="right", fontsize=8)
        ax.grid(axis="y", which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --- targets -------------------------------------------------------------------------------------


def _count(items: Sequence[str]) -> tuple[int, int]:
    judged = [j for j in items if not j.startswith("n/a")]
    return sum(j == "met" for j in judged), len(judged)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target with its verdict ("met", "missed", "reported", "not run") and the evidence."""
    out = []
    comm = results.get("comm")
    if comm and "rows" in comm:
        rows = comm["rows"]
        wrong = [f"{r['case']} {_fmt_mesh(r['mesh'])}" for r in rows if r["shardops"]["status"] != "ok"]
        out.append({
            "target": "shardops result equals single-device torch on every case",
            "verdict": "met" if not wrong else "missed",
            "detail": f"{len(rows) - len(wrong)}/{len(rows)} ok" + (f"; not ok: {', '.join(wrong)}" if wrong else ""),
        })
        met, n = _count([r["bytes_target"] for r in rows])
        misses = [f"{r['case']} {_fmt_mesh(r['mesh'])}" for r in rows if r["bytes_target"].startswith("missed")]
        out.append({
            "target": "bytes/rank ≤ DTensor's on every case",
            "verdict": "met" if met == n else "missed",
            "detail": f"{met}/{n} rows" + (f"; missed: {', '.join(misses)}" if misses else ""),
        })
        met, n = _count([r["gather_target"] for r in rows])
        misses = [f"{r['case']} {_fmt_mesh(r['mesh'])} ({r['gather_target'][len('missed: '):] or 'algorithm moves more'})"
                  for r in rows if r["gather_target"].startswith("missed")]
        out.append({
            "target": "≥ 30× fewer bytes where DTensor gathers or all-to-alls the sharded dim",
            "verdict": "met" if met == n else "missed",
            "detail": f"{met}/{n} rows" + (f"; missed: {'; '.join(misses)}" if misses else ""),
        })
    ovh = results.get("overhead")
    if ovh and "us" in ovh:
        from benchmarks.overhead import overhead_rows

        rows = overhead_rows(ovh)
        for kind, bound in (("no communication", "1.0"), ("DTensor redistributes", "0.3")):
            sel = [r for r in rows if r["target_kind"] == kind]
            if not sel:
                continue
            out.append({
                "target": f"dispatch overhead ≤ {bound}× DTensor on ops where {kind}",
                "verdict": "met" if all(r["met"] for r in sel) else "missed",
                "detail": ", ".join(f"{r['op']} {r['ratio']:.2f}×" if r["ratio"] else f"{r['op']} error" for r in sel),
            })
    e2e = results.get("end_to_end")
    if e2e and "summary" in e2e:
        s = e2e["summary"]
        only = "; ".join(f"{name} only: {', '.join(steps)}" for name, steps in s["only"].items() if steps)
        out.append({
            "target": "end-to-end wall time ≤ 0.5× DTensor's",
            "verdict": "not run" if s["met"] is None else ("met" if s["met"] else "missed"),
            "detail": (f"{s['ratio']:.2f}× over the {len(s['common_steps'])} steps both run" if s["ratio"] is not None else "no common step")
            + (f" ({only})" if only else ""),
        })
    plan = results.get("planning")
    if plan and "rows" in plan:
        from benchmarks.planning import growth

        g = growth(plan["rows"])
        parts = []
        for op, d in g.items():
            nds = sorted(d)
            if len(nds) >= 2:
                parts.append(f"{op} {d[nds[0]]:.0f}→{d[nds[-1]]:.0f} µs ({nds[0]}-D→{nds[-1]}-D)")
        out.append({"target": "planning time growth with mesh ndim (report the curve)", "verdict": "reported", "detail": "; ".join(parts)})
    rnd = results.get("random")
    if rnd and "rows" in rnd:
        from benchmarks.random_ops import TARGET_RATIO

        out.append({
            "target": f"sharded dropout ≤ {TARGET_RATIO:g}× torch's bernoulli_ on the same shard size",
            "verdict": "met" if rnd["met"] else "missed",
            "detail": f"{rnd['dropout_ratio']:.2f}× on a {rnd['numel_per_shard']:,}-element f32 shard",
        })
    for name in BENCHMARKS:
        if name in results and "error" in results[name]:
            out.append({"target": f"{name} benchmark runs", "verdict": "missed", "detail": results[name]["error"].splitlines()[-1]})
    return out


def format_targets(items: Sequence[dict[str, Any]]) -> str:
    lines = ["| target | verdict | detail |", "|---|---|---|"]
    for t in items:
        verdict = "**MISSED**" if t["verdict"] == "missed" else t["verdict"]
        lines.append(f"| {t['target']} | {verdict} | {t['detail'].replace('|', '/')} |")
    return "\n".join(lines)


# --- machine -------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import shardops

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {
        "cpu": cpu,
        "cores": usable,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "shardops": shardops.__version__,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
    try:
        import matplotlib

        info["matplotlib"] = matplotlib.__version__
    except ImportError:
        info["matplotlib"] = None
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        info["git"] = commit + (" + uncommitted changes" if dirty else "") if commit else None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    return info


def format_machine(info: dict[str, Any]) -> str:
    load = info.get("load_average")
    load_s = f"; load average at start {load[0]:.1f}" if load else ""
    return (
        f"{info['cpu']}, {info['cores']} cores{load_s}; {info['os']}; Python {info['python']}, torch {info['torch']}, "
        f"shardops {info['shardops']}" + (f" (git {info['git']})" if info.get("git") else "") + f"; {info['date']}"
    )


# --- running and reporting ------------------------------------------------------------------------


def _run_section(name: str, fn, results: dict[str, Any], timings: dict[str, float]) -> None:
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others
        results[name] = {"error": traceback.format_exc()}
        print(f"[bench] {name} FAILED:\n{results[name]['error']}", file=sys.stderr, flush=True)
    timings[name] = time.perf_counter() - start
    print(f"[bench] {name}: {timings[name]:.1f} s", file=sys.stderr, flush=True)


def _overhead(cfg: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.overhead import measure_overhead

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add noise
    try:
        return measure_overhead(iters=cfg["iters"], repeats=cfg["repeats"])
    finally:
        torch.set_num_threads(threads)


def _planning(cfg: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.planning import MESHES_FULL, MESHES_QUICK, measure_planning

    meshes = cfg["meshes"]
    if isinstance(meshes, str):
        meshes = {"quick": MESHES_QUICK, "full": MESHES_FULL}[meshes]
    return {"rows": measure_planning(meshes, max_reps=cfg["max_reps"])}


def _end_to_end(cfg: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.end_to_end import measure_end_to_end

    return measure_end_to_end(cfg["size"], cfg.get("world_size", 2))


def run_benchmarks(only: Sequence[str], config: dict[str, Any], cases: Sequence[str] | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    # DTensor warns once per rank about its CPU all_to_all fallback and its sequential
    # all_reduces on 2-D meshes; both show in the tables instead.
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    results: dict[str, Any] = {}
    timings: dict[str, float] = {}
    sections = {
        "comm": lambda: measure_comm(cases),
        "overhead": lambda: _overhead(config["overhead"]),
        "end_to_end": lambda: _end_to_end(config["end_to_end"]),
        "planning": lambda: _planning(config["planning"]),
        "random": lambda: __import__("benchmarks.random_ops", fromlist=["measure_random"]).measure_random(**config["random"]),
    }
    for name in BENCHMARKS:
        if name in only:
            _run_section(name, sections[name], results, timings)
    return results, timings


def _section_error(name: str, results: dict[str, Any]) -> str | None:
    r = results.get(name)
    if r is not None and "error" in r:
        return f"The {name} benchmark failed:\n\n```\n{r['error'].strip()}\n```"
    return None


def render_report(results: dict[str, Any], command: str, machine: dict[str, Any], timings: dict[str, float], chart: str | None) -> str:
    """Every table, as markdown (the body of report.md and README_SNIPPET.md)."""
    from benchmarks.end_to_end import end_to_end_caption, format_end_to_end_table
    from benchmarks.overhead import format_overhead_table, overhead_caption
    from benchmarks.planning import format_growth_table, format_planning_table

    parts = [
        "## Benchmarks: shardops vs torch.distributed.tensor",
        f"Command: `{command}` (the same as `python -m benchmarks.run{command[len('shardops bench'):]}` from the repository root; "
        f"{sum(timings.values()):.0f} s).  \nMachine: {format_machine(machine)}.",
        "Ratios are shardops ÷ DTensor (lower is better for shardops).",
        "### Targets\n\n" + format_targets(targets(results)),
    ]
    if "comm" in results:
        err = _section_error("comm", results)
        parts.append(
            "### Communication per op\n\n"
            "Rank 0 of 4 (threads worlds: `so.run` for shardops, torch's threaded process group for DTensor). "
            "Bytes: what the rank puts into collectives; lower bound: the reduced per-row values one round must move "
            "(`Case.lower_bound_bytes`). Reductions include `.full_tensor()` of the small result; softmax, "
            "cross-entropy and norms are forward + backward to a scalar loss. "
            "layout: the first input's placements. \"≥ 30× less\" applies where DTensor all-gathers or all-to-alls whole shards. "
            "correct: equal to single-device torch (values and gradients, every rank).\n\n"
            + (err or format_comm_table(results["comm"]["rows"]))
            + ("\n\n![bytes per case](bytes_per_case.png)" if chart is None and not err else (f"\n\n({chart})" if chart else ""))
        )
    if "overhead" in results:
        r = results["overhead"]
        parts.append(
            "### Dispatch overhead per op (cache hit)\n\n"
            + (_section_error("overhead", results) or f"{overhead_caption(r)} floor: a do-nothing `__torch_dispatch__` "
               "wrapper; plain: eager torch on plain tensors.\n\n" + format_overhead_table(r))
        )
    if "end_to_end" in results:
        r = results["end_to_end"]
        parts.append(
            "### End to end: the demo's transformer-step slice\n\n"
            + (_section_error("end_to_end", results) or f"{end_to_end_caption(r)}.\n\n" + format_end_to_end_table(r))
        )
    if "planning" in results:
        r = results["planning"]
        err = _section_error("planning", results)
        parts.append(
            "### Planning time vs mesh ndim (cold: caches cleared)\n\n"
            + (err or "Propagation (`dispatch.core.plan_op`: rows crossed over mesh dims and priced) plus exact "
               "redistribution planning (`redistribute.plan`) of the chosen inputs, metadata only, f32[1024, 32768]; "
               "medians of cold runs. DTensor has no metadata-only planning entry point to compare.\n\n"
               + format_growth_table(r["rows"]) + "\n\n" + format_planning_table(r["rows"]))
        )
    if "random" in results:
        from benchmarks.random_ops import __doc__ as random_doc, format_random_table

        caption = " ".join(random_doc.split("\n\n")[2].split())
        parts.append("### Random ops: sharded dropout vs torch's bernoulli_\n\n"
                     + (_section_error("random", results) or f"{caption}\n\n" + format_random_table(results["random"])))
    return "\n\n".join(parts) + "\n"


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


def write_outputs(out_dir: Path, results: dict[str, Any], command: str, machine: dict[str, Any], timings: dict[str, float], plot: bool) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"report": out_dir / "report.md", "snippet": out_dir / "README_SNIPPET.md", "json": out_dir / "results.json"}
    chart: str | None = "chart not drawn (--no-plot)"
    comm_rows = results.get("comm", {}).get("rows")
    if comm_rows is None:
        chart = "no chart: the comm benchmark did not run"
    elif plot:
        chart = plot_bytes(comm_rows, out_dir / "bytes_per_case.png")
        if chart is None:
            paths["chart"] = out_dir / "bytes_per_case.png"
        else:
            print(f"[bench] {chart}", file=sys.stderr)
    report = render_report(results, command, machine, timings, chart)
    paths["report"].write_text(report)
    paths["snippet"].write_text(report)
    payload = {"command": command, "machine": machine, "seconds": timings, "targets": targets(results), "results": results}
    paths["json"].write_text(json.dumps(_jsonable(payload), indent=1))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardops bench", description="shardops vs torch.distributed.tensor, side by side.")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (< 3 min on 2 cores)")
    parser.add_argument("--out", default="bench_out", help="output dir (default: bench_out/)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument("--cases", nargs="+", help="comm benchmark: only these cases (default: all)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the bytes chart")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["shardops bench", *given])
    machine = machine_info()
    start = time.perf_counter()
    results, timings = run_benchmarks(args.only, config, args.cases)
    paths = write_outputs(Path(args.out), results, command, machine, timings, plot=not args.no_plot)
    print(paths["report"].read_text())
    print(f"[bench] wrote {', '.join(str(p) for p in paths.values())} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 1 if any("error" in results[n] for n in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
