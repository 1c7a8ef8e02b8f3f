"""Training-step benchmark: shardops vs torch DTensor on the same model, mesh and plan.

    python -m benchmarks.training [--quick] [--out DIR]

For each model (LLaMA-, GPT-2-style) x mesh ((4,) tp; (2, 2) dp x tp) x plan
(sequence-parallel norms or not): bytes per rank per step handed to the transport
(busiest rank, exact; shardops' wire figure) and step wall time, both systems
run as 4 gloo processes (4 threads under one
interpreter lock would not be a fair race); shardops' threads-world step time
separately. Every shardops run is in strict mode and checked against
single-device training. Bytes are asserted nowhere; `tests/test_training.py`
asserts the byte comparison on one configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardops.training import torch_side
from shardops.training.config import SIZES, RunSpec
from shardops.training.launch import run_gloo

MESHES = ((4,), (2, 2))


def _shardops_gloo_rank(spec: RunSpec) -> dict[str, Any]:
    import shardops as so
    from shardops.training.shardops_side import train_rank

    so.set_strict(True)
    result = train_rank(spec)
    import torch.distributed as dist

    if dist.get_rank() != 0:
        result["params"] = None
    return result


def _busiest(results: Sequence[dict[str, Any]]) -> tuple[int, float]:
    """(bytes per step, ms per step) on the busiest rank; times over steps after the first."""
    best = max(results, key=lambda r: sum(s.nbytes for s in r["records"]))
    records = best["records"]
    timed = records[1:] or records
    return records[-1].nbytes, 1e3 * sum(s.seconds for s in timed) / len(timed)


def _threads_ms(spec: RunSpec) -> float:
    import shardops as so
    from shardops.training.shardops_side import train_rank

    so.set_strict(True)
    try:
        results = so.run(train_rank, 4, spec, None, timeout=600)
    finally:
        so.set_strict(False)
    return _busiest(results)[1]


def configurations(quick: bool) -> list[RunSpec]:
    size = SIZES["tiny" if quick else "small"]
    steps = 3 if quick else 8
    specs = []
    for model in ("llama", "gpt2"):
        for mesh in MESHES[1:] if quick else MESHES:
            for sp in (True, False):
                specs.append(RunSpec(model=model, cfg=size, mesh_shape=mesh, steps=steps, sequence_parallel=sp))
    return specs


def measure(spec: RunSpec) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model": spec.model,
        "mesh": list(spec.mesh_shape),
        "sequence_parallel": spec.sequence_parallel,
    }
    for side, fn in (("shardops", _shardops_gloo_rank), ("torch", torch_side.train_rank)):
        start = time.perf_counter()
        try:
            results = run_gloo(fn, 4, spec, timeout=900)
            row[f"{side}_bytes"], row[f"{side}_ms"] = _busiest(results)
        except Exception as e:  # noqa: BLE001 - reported, the others still run
            row[f"{side}_error"] = _one_line(e)
            row[f"{side}_traceback"] = getattr(e, "rank_traceback", None)  # the failing rank's own (in the JSON)
        row[f"{side}_wall_s"] = round(time.perf_counter() - start, 1)
    try:
        row["shardops_threads_ms"] = _threads_ms(spec)
    except Exception as e:  # noqa: BLE001
        row["shardops_threads_error"] = f"{type(e).__name__}: {e}"
    return row


def _one_line(e: Exception) -> str:
    """A table cell for a failure: the first line names it (a RankFailure: the rank,
    and its exception's type and message)."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | mesh | plan | shardops bytes/step | torch DTensor bytes/step | ratio | shardops ms/step (gloo) | "
        "torch ms/step (gloo) | shardops ms/step (threads) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mesh = "x".join(map(str, r["mesh"]))
        plan = "TP+SP" if r["sequence_parallel"] else "TP"
        if len(r["mesh"]) == 2:
            plan = "DP+" + plan
        sb, tb = r.get("shardops_bytes"), r.get("torch_bytes")
        ratio = f"{sb / tb:.2f}" if sb is not None and tb else "-"
        fmt = lambda v, err: f"{v:,.0f}" if v is not None else f"error: {err}"  # noqa: E731
        lines.append(
            f"| {r['model']} | {mesh} | {plan} | {fmt(sb, r.get('shardops_error'))} | {fmt(tb, r.get('torch_error'))} "
            f"| {ratio} | {fmt(r.get('shardops_ms'), '-')} | {fmt(r.get('torch_ms'), '-')} | "
            f"{fmt(r.get('shardops_threads_ms'), r.get('shardops_threads_error'))} |"
        )
    return "\n".join(lines)


def measure_all(quick: bool = True) -> list[dict[str, Any]]:
    return [measure(spec) for spec in configurations(quick)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.training", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, 3 steps, mesh (2, 2) only")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    rows = measure_all(args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    (out / "training.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
