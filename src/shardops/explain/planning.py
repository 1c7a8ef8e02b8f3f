"""Planning the traced ops in order, exactly as the runtime plans them (dispatch.core.plan_op).

The chosen output layouts flow into the next op. For every step: the candidates
the runtime considers (cheapest first), with their input redistributions,
internal collectives, bytes, rounds and estimated time, and why one is chosen.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from .._torch import pytree
from ..dispatch.core import plan_op
from ..mesh import DeviceMesh
from ..placements import Replicate
from ..planner.choice import with_plans
from ..planner.rows import Candidate
from ..redistribute import plan
from ..spec import TensorMeta, TensorSpec
from .moe import is_routing
from .result import Option, Step, fmt_time
from .trace import Recorder

R = Replicate()


class Names:
    """Which meta tensor is which spec, and what to call it."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.spec: dict[int, TensorSpec] = {}
        self.name: dict[int, str] = {}
        self.keep: list[Any] = []  # keeps the meta tensors alive so ids stay unique

    def add(self, t: torch.Tensor, spec: TensorSpec, name: str) -> None:
        self.spec[id(t)], self.name[id(t)] = spec, name
        self.keep.append(t)

    def known(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.spec

    def spec_of(self, t: torch.Tensor) -> TensorSpec:
        """A tensor made inside the call (not from an input) is a plain tensor: Replicate, like the runtime takes it."""
        if id(t) not in self.spec:
            meta = TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype)
            self.add(t, TensorSpec(self.mesh, (R,) * self.mesh.ndim, meta), f"const{len(self.keep)}")
        return self.spec[id(t)]


def _call_text(func, args, kwargs, names: Names) -> str:
    def show(v):
        if isinstance(v, torch.Tensor):
            return names.name.get(id(v), "tensor")
        if isinstance(v, (list, tuple)):
            inner = ", ".join(show(x) for x in v)
            return f"[{inner}]"
        return repr(v)

    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    return f"{func}({', '.join(parts)})"


def _is_replicate(c: Candidate) -> bool:
    return c.algorithm is None and all(p.is_replicate() for pl in c.inputs + c.outputs for p in pl)


def internal_collectives(c: Candidate) -> list[tuple[tuple[int, ...], str, float]]:
    """The op's own collectives. A rule declares them per mesh dim; a sharded algorithm whose dim is
    sharded over several mesh dims issues ONE collective over the group spanning them (ops/common.py:
    all_gather_stacked, all_reduce), so equal entries of its rows merge into one over those mesh dims."""
    per_dim = [Counter((kind, float(b)) for kind, b in r.comm) for r in c.rows]
    if c.algorithm is None:
        return [
            ((i,), kind, b) for i, counts in enumerate(per_dim) for (kind, b), n in counts.items() for _ in range(n)
        ]
    merged = []
    for key in dict.fromkeys(k for counts in per_dim for k in counts):
        dims = tuple(i for i, counts in enumerate(per_dim) if key in counts)
        merged += [(dims, key[0], key[1])] * max(counts[key] for counts in per_dim)
    return merged


def _option(number: int, c: Candidate, specs: tuple[TensorSpec, ...], links) -> Option:
    with_plans(c, specs, links)
    comm = internal_collectives(c)
    label = "replicate-then-local" if _is_replicate(c) else c.label
    return Option(
        number,
        c.inputs,
        c.outputs,
        label,
        c.plans,
        comm,
        specs,
        c.time,
        c.redistribute_time,
        c.comm_time,
        c.pending_time,
        replicate=_is_replicate(c),
    )


def _name(o: Option) -> str:
    return f"#{o.number}" if o.number else o.label  # number 0: an option ranked below the ones shown


def _reason(chosen: Option, others: list[Option]) -> str:
    rep = next((o for o in others if o.replicate), None)
    rest = [o for o in others if o is not chosen]
    if not rest:
        return f"#{chosen.number} {chosen.label}: the only candidate ({fmt_time(chosen.time)})"
    head = f"#{chosen.number} {chosen.label}: "
    if chosen.replicate:
        best = min(rest, key=lambda o: o.time)
        return head + f"cheapest: {fmt_time(chosen.time)} vs {fmt_time(best.time)} for #{best.number} {best.label}"
    text = head + f"cheapest: {fmt_time(chosen.time)}"
    if rep is not None:
        text += f" vs {fmt_time(rep.time)} for replicate-then-local"
    tied = [o for o in rest if round(o.time, 12) == round(chosen.time, 12)]
    if tied:
        text += (
            f"; tied with {len(tied)} other(s) (e.g. {_name(tied[0])}): ties prefer fewer input changes, "
            "then a pending output, then more sharding, then the rule's order"
        )
    cheaper = [o for o in rest if o.time < chosen.time * 0.99]  # a 1% margin: estimates are not exact
    if cheaper:
        text += (
            f"; note {_name(cheaper[0])} is cheaper with its exact plan ({fmt_time(cheaper[0].time)}): "
            "the runtime ranks candidates by a per-mesh-dim estimate"
        )
    return text


def _plan_step(index: int, func, args, kwargs, out, names: Names, links, top: int) -> Step:
    flat, tree = pytree.tree_flatten((args, kwargs))
    leaves = [names.spec_of(a) if isinstance(a, torch.Tensor) else a for a in flat]
    specs = tuple(a for a in leaves if isinstance(a, TensorSpec))
    input_names = [names.name[id(a)] for a in flat if isinstance(a, torch.Tensor)]
    call = _call_text(func, args, kwargs, names)
    s_args, s_kwargs = pytree.tree_unflatten(leaves, tree)
    # The pruned search returns exactly the best `top` of the runtime's ranking, the count of the
    # whole space, and the all-Replicate candidate (compared with in the reason) wherever it ranks.
    report = plan_op(func, s_args, s_kwargs, links=links, limit=top)
    out_tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if report.fallback:
        return _fallback_step(index, func, call, input_names, specs, out_tensors, report.replicate_only, links)
    shown = [_option(k + 1, c, specs, links) for k, c in enumerate(report.candidates[:top])]
    others = list(shown)
    rep = getattr(report.candidates, "replicate", None)
    if rep is not None and not any(_is_replicate(c) for c in report.candidates[:top]):
        others.append(_option(0, rep, specs, links))  # number 0: ranked below the ones shown
    chosen = shown[0]
    chosen.chosen = True
    mesh = specs[0].mesh
    out_specs = [TensorSpec(mesh, pl, m) for pl, m in zip(chosen.outputs, report.out_metas)]
    total = getattr(report.candidates, "total", len(report.candidates))
    return Step(
        index,
        str(func),
        call,
        input_names,
        specs,
        out_specs,
        shown,
        total,
        chosen,
        _reason(chosen, others),
        gathers=report.gathers,
    )


def _fallback_step(index, func, call, input_names, specs, out_tensors, replicate_only: bool, links) -> Step:
    mesh = specs[0].mesh
    plans = tuple(plan(s, (R,) * mesh.ndim, links) for s in specs)
    opt = Option(
        1,
        tuple((R,) * mesh.ndim for _ in specs),
        tuple((R,) * mesh.ndim for _ in out_tensors),
        "replicate-then-local",
        plans,
        [],
        specs,
        sum(p.time for p in plans),
        sum(p.time for p in plans),
        0.0,
        0.0,
        chosen=True,
        replicate=True,
    )
    out_specs = [
        TensorSpec(mesh, (R,) * mesh.ndim, TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype)) for t in out_tensors
    ]
    why = "replicated on purpose" if replicate_only else "no sharded strategy"
    gathers = None
    if any(p.steps for p in plans):
        gathers = "is replicated on purpose (no sharded algorithm)" if replicate_only else "has no sharded strategy"
    return Step(
        index,
        str(func),
        call,
        input_names,
        specs,
        out_specs,
        [opt],
        1,
        opt,
        f"#1 {why}: replicate-then-local, {fmt_time(opt.time)}",
        fallback=True,
        replicate_only=replicate_only,
        gathers=gathers,
    )


def plan_all(rec: Recorder, names: Names, links, top: int) -> list[Step]:
    steps: list[Step] = []
    for func, args, kwargs, out in rec.calls:
        if is_routing(func):  # a mixture-of-experts routing (explain.moe): priced by its own rule
            step = func.plan(len(steps) + 1, names.spec_of(args[0]), links)
            names.add(out, step.out_specs[0], f"%{step.index}")
            steps.append(step)
            continue
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not any(names.known(t) for t in tensors):
            continue  # only plain tensors: the runtime never sees this op
        step = _plan_step(len(steps) + 1, func, args, kwargs, out, names, links, top)
        for k, (t, spec) in enumerate(zip(outs, step.out_specs)):
            names.add(t, spec, f"%{step.index}" + (f".{k}" if len(outs) > 1 else ""))
        steps.append(step)
    return steps
