"""What shardops does on the benchmark cases (the counterpart of `dtensor_side`).

Each case of `benchmarks.cases`, on each mesh, runs in its own `shardops.run(...,
4)` threads world: the inputs are laid out with `so.distribute_tensor`, the
case's `fn` runs inside `so.CommDebugMode` on every rank, and rank 0's figures
(collectives by kind, bytes it put in, rounds) are reported, as on the DTensor
side. The result (values and gradients) is compared with single-device torch
on every rank.

Whatever the op families under `shardops/ops/` cover at the time of the run is
what gets measured: an op without a strategy falls back to
replicate-and-run-locally, which shows as its real bytes plus the op's name in
`fallbacks`; an op that raises shows as an error row, never a crash.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

import shardops as so
from benchmarks.cases import MESH_SHAPES, Case, materialize, parse_placements, select_cases
from benchmarks.dtensor_side import _reference, _short_error

WORLD_SIZE = 4
# Generous: a case takes milliseconds; the timeout only bounds a broken op family.
RUN_TIMEOUT_S = 120.0

_FALLBACK_OP = re.compile(r"shardops: (\S+) has no sharded strategy")


def _distribute(case: Case, mesh: Any) -> list[Any]:
    dts = []
    for i, (t, spec) in enumerate(zip(case.inputs(), case.placement_specs(tuple(mesh.shape)))):
        dt = so.distribute_tensor(t, mesh, parse_placements(spec, so.Shard, so.Replicate))
        if i in case.grad_inputs:
            dt = dt.detach().requires_grad_(True)
        dts.append(dt)
    return dts


def _run_case_on_rank(case: Case, mesh_shape: tuple[int, ...], reference: tuple[list, list]) -> dict[str, Any]:
    """One rank's figures for one case (inside `so.run`)."""
    mesh = so.init_device_mesh("cpu", mesh_shape)
    dts = _distribute(case, mesh)
    with torch.enable_grad(), so.CommDebugMode() as comm:
        out = case.fn(*dts)
    # Materialising the results for the check is outside the counted region.
    ref_outs, ref_grads = reference
    outs = [materialize(t) for t in pytree.tree_leaves(out)]
    grads = [None if dts[i].grad is None else materialize(dts[i].grad) for i in case.grad_inputs]
    correct = len(outs) == len(ref_outs) and all(
        case.close(None if a is None else a.detach(), b) for a, b in zip(outs + grads, ref_outs + ref_grads)
    )
    return {
        "counts": comm.get_comm_counts(),
        # compared with torch's bytes, which are its c10d inputs (uneven gathers padded): the wire figure
        "bytes": comm.get_wire_bytes(),
        "logical_bytes": comm.get_total_bytes(),
        "rounds": comm.get_rounds(),
        "calls": [{"kind": k, "bytes": b} for k, b in comm.wire_log],
        "correct": correct,
    }


def fallback_ops(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    """The aten ops named by shardops' FallbackWarnings, first-seen order, no repeats."""
    names: dict[str, None] = {}
    for w in caught:
        if issubclass(w.category, so.FallbackWarning):
            m = _FALLBACK_OP.search(str(w.message))
            names[m.group(1) if m else str(w.message)[:80]] = None
    return list(names)


def measure_case(case: Case, mesh_shape: Sequence[int], reference: tuple[list, list] | None = None) -> dict[str, Any]:
    """One (case, mesh) row; see `measure_shardops`."""
    mesh_shape = tuple(mesh_shape)
    reference = reference if reference is not None else _reference(case)
    row: dict[str, Any] = {
        "case": case.name,
        "mesh": mesh_shape,
        "placements": case.placement_specs(mesh_shape),
        "counts": {},
        "bytes": 0,
        "rounds": 0,
        "calls": [],
        "lower_bound_bytes": case.lower_bound_bytes(mesh_shape),
        "correct": None,
        "error": None,
        "fallbacks": [],
    }
    # Rank threads warn through the process-wide warnings machinery, so one
    # recorder in this thread sees every rank's FallbackWarnings.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            per_rank = so.run(_run_case_on_rank, WORLD_SIZE, case, mesh_shape, reference, timeout=RUN_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a raising op is a result here
            row["error"] = _short_error(e)
            per_rank = None
    row["fallbacks"] = fallback_ops(caught)
    if per_rank is not None:
        row.update({k: per_rank[0][k] for k in ("counts", "bytes", "rounds", "calls")})
        row["correct"] = all(r["correct"] for r in per_rank)
    row["status"] = "raises" if row["error"] is not None else ("ok" if row["correct"] else "wrong")
    return row


def measure_shardops(
    case_names: Sequence[str] | None = None, mesh_shapes: Sequence[Sequence[int]] = MESH_SHAPES
) -> list[dict[str, Any]]:
    """Run each case with shardops on a 4-rank threads world.

    Returns one dict per (case, mesh), in case order then mesh order (the
    order of `measure_dtensor`), with keys: case, mesh, placements, counts
    (collectives by kind), bytes, rounds, calls (kind, bytes per call),
    lower_bound_bytes, correct (None when it raised), error, fallbacks (aten
    ops that ran replicated), status ("ok", "wrong" or "raises").
    """
    cases = select_cases(case_names)
    mesh_shapes = [tuple(s) for s in mesh_shapes]
    for s in mesh_shapes:
        if len(s) == 0 or torch.Size(s).numel() != WORLD_SIZE:
            raise ValueError(f"mesh shape {s} does not cover the {WORLD_SIZE}-rank world")
    rows = []
    for case in cases:
        reference = _reference(case)
        rows.extend(measure_case(case, s, reference) for s in mesh_shapes)
    return rows
