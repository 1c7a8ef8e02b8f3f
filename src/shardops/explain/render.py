"""An Explanation as text: one table of candidates per step, then the totals."""

from __future__ import annotations

import math
from typing import Any

from .specs import spec_text
from .text import fmt_bytes, fmt_time, placements_text


def render(e: Any) -> str:
    """`e`: an explain.result.Explanation (not imported: result imports this module)."""
    ranks = math.prod(e.mesh_shape)
    lines = [
        f"explain {e.expression}",
        f"  mesh {'x'.join(map(str, e.mesh_shape))} ({ranks} ranks), links {', '.join(e.links)}",
    ]
    lines += [f"  {name} = {spec_text(spec)}" for name, spec in e.inputs.items()]
    lines += [f"  note: {n}" for n in e.notes]
    for s in e.steps:
        lines += [""] + _render_step(s)
    lines += [
        "",
        f"total: {len(e.steps)} step(s), {fmt_bytes(e.bytes)} per rank (rank 0), {e.rounds} round(s), est. "
        f"{fmt_time(e.time)}",
    ]
    t = e.timings
    warm = f"; one-time torch meta warm-up {fmt_time(t['warmup_s'])}" if t.get("warmup_s") else ""
    lines.append(f"planned in {fmt_time(t.get('plan_s', 0.0))} (+ tracing {fmt_time(t.get('trace_s', 0.0))}){warm}")
    return "\n".join(lines)


def _render_step(s: Any) -> list[str]:
    outs = ", ".join(spec_text(o) for o in s.out_specs)
    head = [f"[{s.index}] {s.call} -> {outs}"]
    if s.fallback:
        why = (
            "replicated on purpose (registry.REPLICATE_ONLY)"
            if s.replicate_only
            else "no sharded strategy: replicate fallback (the runtime warns)"
        )
        head.append(f"    {why}: inputs gathered to Replicate, the op runs locally on every rank")
    shown = f"best {len(s.options)} shown" if len(s.options) < s.total else "all shown"
    head.append(f"    {s.total} candidate(s), {shown}; bytes and rounds per rank (rank 0)")
    rows = [("", "#", "inputs -> outputs", "strategy", "input moves", "internal comm", "bytes", "rounds", "time")]
    for o in s.options:
        io = (
            " ".join(f"{n}:{placements_text(p)}" for n, p in zip(s.input_names, o.inputs))
            + " -> "
            + " ".join(placements_text(p) for p in o.outputs)
        )
        comm = "; ".join(f"{k} {fmt_bytes(b)} @mesh{'+'.join(map(str, d))}" for d, k, b in o.comm) or "-"
        moves = "; ".join(o.moves(s.input_names)) or "-"
        rows.append(
            (
                "*" if o.chosen else "",
                str(o.number),
                io,
                o.label,
                moves,
                comm,
                fmt_bytes(o.bytes),
                str(o.rounds),
                fmt_time(o.time),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {1, 6, 7, 8}
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        head.append("    " + "  ".join(cells).rstrip())
    head.append(f"    chosen: {s.reason}")
    return head
