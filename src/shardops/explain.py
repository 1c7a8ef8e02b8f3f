"""`so.explain` / `shardops explain`: what an op costs on a layout, planned from metadata only.

    so.explain("softmax(x, dim=1)", mesh=(8, 8, 16), links="nvlink,ib,ib", x="f32[8,4096]:R,R,S(1)")
    so.explain(torch.softmax, x_spec, dim=1)

The call is traced once on META tensors of the global shapes (a TorchDispatchMode
records the aten ops torch dispatches to, after its own decompositions); each
recorded op is then planned in order with `dispatch.core.plan_op` exactly as
the runtime would plan it, and the chosen output layouts flow into the next op.
No data is allocated beyond metadata, no collective runs, and no world of ranks
is needed, so any mesh size can be asked about.

For every step the answer lists the candidates the runtime considers (cheapest
first, as the runtime ranks them): input redistributions, the op's internal
collectives, bytes one rank puts into collectives, rounds and estimated time
under the link model, and which one is chosen and why. Ops that replicate
(no rule, or registry.REPLICATE_ONLY) and callables intercepted at the torch
function level (registry.TORCH_FUNCTIONS) are named as such.
"""
from __future__ import annotations

import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import cost
from .dispatch import registry
from .dispatch.core import plan_op
from .dispatch.strategy import Candidate, with_plans
from .errors import ShardingError
from .mesh import DeviceMesh
from .placements import NormPartial, Partial, Placement, Replicate, Shard, StridedShard, normalize_placements
from .redistribute import Plan, plan, plan_bytes
from .spec import TensorMeta, TensorSpec, contiguous_stride

R = Replicate()
DEFAULT_TOP = 10
_WARM = {"done": False, "seconds": 0.0}


# ------------------------------------------------------------------ parsing specs, meshes, links

DTYPES = {
    "f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64,
    "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8,
    "b": torch.bool, "bool": torch.bool, "c64": torch.complex64, "c128": torch.complex128,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32, "float16": torch.float16,
    "float32": torch.float32, "float64": torch.float64, "double": torch.float64, "int": torch.int64,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "long": torch.int64,
    "uint8": torch.uint8, "complex64": torch.complex64, "complex128": torch.complex128,
}
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64", torch.int8: "i8",
               torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.bool: "bool",
               torch.complex64: "c64", torch.complex128: "c128"}
_SPEC_RE = re.compile(r"^\s*(?P<dtype>[A-Za-z0-9_]+)\s*\[(?P<shape>[0-9,\s]*)\]\s*(?::\s*(?P<placements>.*))?$")
_PLACEMENT_RE = re.compile(r"_S\(\s*-?\d+\s*,\s*\d+\s*\)|S\(\s*-?\d+\s*\)|NormP\(\s*[-+a-z0-9.]+\s*\)|P\(\s*[a-z]*\s*\)|P|R")
SPEC_HELP = 'a spec is DTYPE[SHAPE]:PLACEMENTS, e.g. "f32[8,4096]:R,S(1)" (placements R, S(d), P(sum|avg|max|min|product), NormP(p), _S(d,k); one per mesh dim)'


def parse_placement(text: str) -> Placement:
    t = text.replace(" ", "")
    if t == "R":
        return R
    if t == "P":
        return Partial("sum")
    inner = t[t.index("(") + 1 : -1] if "(" in t else ""
    if t.startswith("_S("):
        d, k = inner.split(",")
        return StridedShard(int(d), int(k))
    if t.startswith("S("):
        return Shard(int(inner))
    if t.startswith("NormP("):
        return NormPartial(float(inner))
    if t.startswith("P("):
        return Partial(inner or "sum")
    raise ShardingError(f"explain: placement {text!r} not understood; {SPEC_HELP}")


def parse_placements(text: str) -> tuple[Placement, ...]:
    compact = text.replace(" ", "")
    tokens = _PLACEMENT_RE.findall(compact)
    if ",".join(tokens) != compact:
        raise ShardingError(f"explain: placements {text!r} not understood; {SPEC_HELP}")
    return tuple(parse_placement(t) for t in tokens)


def parse_spec(text: str | TensorSpec, mesh: DeviceMesh, what: str = "tensor") -> TensorSpec:
    """A TensorSpec from "f32[8,4096]:R,S(1)" (no placements: Replicate everywhere)."""
    if isinstance(text, TensorSpec):
        if text.mesh.shape != mesh.shape:
            raise ShardingError(f"explain: {what} lives on a mesh of shape {text.mesh.shape}, the others on {mesh.shape}")
        return text
    m = _SPEC_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ShardingError(f"explain: {what} = {text!r} is not a tensor spec; {SPEC_HELP}")
    dtype = DTYPES.get(m["dtype"].lower())
    if dtype is None:
        raise ShardingError(f"explain: {what}: unknown dtype {m['dtype']!r}; use one of f16, bf16, f32, f64, i32, i64, bool, ...")
    shape = tuple(int(s) for s in m["shape"].split(",") if s.strip())
    raw = m["placements"]
    placements = parse_placements(raw) if raw and raw.strip() else (R,) * mesh.ndim
    placements = normalize_placements(placements, len(shape), mesh.ndim, f"explain: {what} = {text!r}")
    return TensorSpec(mesh, placements, TensorMeta(shape, contiguous_stride(shape), dtype))


def spec_text(spec: TensorSpec) -> str:
    return f"{DTYPE_NAMES.get(spec.dtype, str(spec.dtype))}[{','.join(map(str, spec.shape))}]:{','.join(map(repr, spec.placements))}"


def parse_mesh(mesh: Any) -> DeviceMesh:
    """A planning-only mesh from 4096, (8, 8, 16), "8x8x16" or a DeviceMesh (no world needed)."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if mesh is None:
        raise ShardingError("explain: give the mesh, e.g. mesh=(2, 2) or --mesh 8x8x16")
    try:
        if isinstance(mesh, str):
            shape = tuple(int(s) for s in mesh.lower().replace(",", "x").split("x") if s.strip())
        elif isinstance(mesh, int):
            shape = (mesh,)
        else:
            shape = tuple(int(s) for s in mesh)
    except (TypeError, ValueError):
        raise ShardingError(f"explain: mesh {mesh!r} not understood; use e.g. 4096, (8, 8, 16) or '8x8x16'") from None
    if not shape or any(s < 1 for s in shape):
        raise ShardingError(f"explain: mesh {mesh!r} needs positive sizes")
    return DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape))


def parse_links(links: Any, mesh_ndim: int) -> tuple[cost.Link, ...]:
    """Per-mesh-dim links: None (the runtime's current model), "nvlink,ib,ib", a preset, a Link, or a list."""
    if isinstance(links, str) and "," in links:
        links = [s.strip() for s in links.split(",")]
    return cost.resolve_links(links, mesh_ndim)


def _link_names(links: Sequence[cost.Link]) -> list[str]:
    by_value = {v: k for k, v in reversed(list(cost.PRESETS.items()))}
    return [by_value.get(link, repr(link)) for link in links]


# ------------------------------------------------------------------ the result


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


@dataclass
class Option:
    """One candidate strategy of a step, with its exact redistribution plans."""

    number: int  # 1-based, in the runtime's ranking
    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]
    label: str
    plans: tuple[Plan, ...]
    comm: list[tuple[tuple[int, ...], str, float]]  # (mesh dims of the group, kind, bytes this rank puts in) inside the op
    in_specs: tuple[TensorSpec, ...]
    time: float
    redistribute_time: float
    comm_time: float
    pending_time: float
    chosen: bool = False
    replicate: bool = False  # the implicit all-Replicate candidate (replicate-then-local)

    def bytes_at(self, coordinate: Sequence[int]) -> int:
        """Bytes the rank at `coordinate` puts into collectives (as so.CommDebugMode counts them)."""
        moved = sum(plan_bytes(s, p, coordinate) for s, p in zip(self.in_specs, self.plans))
        return int(moved + sum(b for dims, _, b in self.comm if self._group_size(dims) > 1))

    def _group_size(self, dims: Sequence[int]) -> int:
        return math.prod(self.in_specs[0].mesh.shape[i] for i in dims)

    @property
    def bytes(self) -> int:
        return self.bytes_at([0] * self.in_specs[0].mesh.ndim)

    @property
    def rounds(self) -> int:
        return sum(p.rounds for p in self.plans) + sum(1 for dims, _, _ in self.comm if self._group_size(dims) > 1)

    def moves(self, names: Sequence[str]) -> list[str]:
        return [f"{n} {s!r}" for n, p in zip(names, self.plans) for s in p.steps]

    def to_dict(self, names: Sequence[str]) -> dict[str, Any]:
        return {
            "number": self.number, "chosen": self.chosen, "label": self.label,
            "inputs": [_pl(p) for p in self.inputs], "outputs": [_pl(p) for p in self.outputs],
            "input_moves": self.moves(names),
            "internal_comm": [{"mesh_dims": list(d), "kind": k, "bytes": b} for d, k, b in self.comm],
            "bytes_per_rank": self.bytes, "rounds": self.rounds, "time_s": self.time,
            "redistribute_time_s": self.redistribute_time, "comm_time_s": self.comm_time, "pending_time_s": self.pending_time,
        }


def _pl(placements: Sequence[Placement]) -> str:
    return ",".join(map(repr, placements))


@dataclass
class Step:
    """One aten op of the traced call, planned."""

    index: int
    op: str
    call: str
    input_names: list[str]
    in_specs: tuple[TensorSpec, ...]
    out_specs: list[TensorSpec]
    options: list[Option]  # shown (best N, runtime order)
    total: int  # candidates considered
    chosen: Option | None
    reason: str
    fallback: bool = False
    replicate_only: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "op": self.op, "call": self.call,
            "inputs": {n: spec_text(s) for n, s in zip(self.input_names, self.in_specs)},
            "outputs": [spec_text(s) for s in self.out_specs],
            "fallback": self.fallback, "replicate_only": self.replicate_only,
            "candidates_total": self.total, "reason": self.reason,
            "candidates": [o.to_dict(self.input_names) for o in self.options],
        }


@dataclass
class Explanation:
    expression: str
    mesh_shape: tuple[int, ...]
    links: list[str]
    inputs: dict[str, TensorSpec]
    steps: list[Step]
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    top: int = DEFAULT_TOP

    @property
    def chosen(self) -> list[Option]:
        return [s.chosen for s in self.steps if s.chosen is not None]

    def bytes_at(self, coordinate: Sequence[int]) -> int:
        """Bytes the rank at `coordinate` puts into collectives over every step (the chosen plans)."""
        return sum(o.bytes_at(coordinate) for o in self.chosen)

    @property
    def bytes(self) -> int:
        return self.bytes_at([0] * len(self.mesh_shape))

    @property
    def rounds(self) -> int:
        return sum(o.rounds for o in self.chosen)

    @property
    def time(self) -> float:
        return sum(o.time for o in self.chosen)

    @property
    def outputs(self) -> list[TensorSpec]:
        return self.steps[-1].out_specs if self.steps else []

    def to_dict(self) -> dict[str, Any]:
        return {
            "expression": self.expression, "mesh": list(self.mesh_shape), "ranks": math.prod(self.mesh_shape),
            "links": self.links, "inputs": {k: spec_text(v) for k, v in self.inputs.items()},
            "steps": [s.to_dict() for s in self.steps], "notes": self.notes,
            "total": {"bytes_per_rank": self.bytes, "rounds": self.rounds, "time_s": self.time},
            "timings_s": self.timings,
        }

    def __str__(self) -> str:
        return render(self)


# ------------------------------------------------------------------ rendering


def render(e: Explanation) -> str:
    ranks = math.prod(e.mesh_shape)
    lines = [f"explain {e.expression}", f"  mesh {'x'.join(map(str, e.mesh_shape))} ({ranks} ranks), links {', '.join(e.links)}"]
    lines += [f"  {name} = {spec_text(spec)}" for name, spec in e.inputs.items()]
    lines += [f"  note: {n}" for n in e.notes]
    for s in e.steps:
        lines += [""] + _render_step(s)
    lines += ["", f"total: {len(e.steps)} step(s), {fmt_bytes(e.bytes)} per rank (rank 0), {e.rounds} round(s), est. {fmt_time(e.time)}"]
    t = e.timings
    warm = f"; one-time torch meta warm-up {fmt_time(t['warmup_s'])}" if t.get("warmup_s") else ""
    lines.append(f"planned in {fmt_time(t.get('plan_s', 0.0))} (+ tracing {fmt_time(t.get('trace_s', 0.0))}){warm}")
    return "\n".join(lines)


def _render_step(s: Step) -> list[str]:
    outs = ", ".join(spec_text(o) for o in s.out_specs)
    head = [f"[{s.index}] {s.call} -> {outs}"]
    if s.fallback:
        why = "replicated on purpose (registry.REPLICATE_ONLY)" if s.replicate_only else "no sharded strategy: replicate fallback (the runtime warns)"
        head.append(f"    {why}: inputs gathered to Replicate, the op runs locally on every rank")
    shown = f"best {len(s.options)} shown" if len(s.options) < s.total else "all shown"
    head.append(f"    {s.total} candidate(s), {shown}; bytes and rounds per rank (rank 0)")
    rows = [("", "#", "inputs -> outputs", "strategy", "input moves", "internal comm", "bytes", "rounds", "time")]
    for o in s.options:
        io = " ".join(f"{n}:{_pl(p)}" for n, p in zip(s.input_names, o.inputs)) + " -> " + " ".join(_pl(p) for p in o.outputs)
        comm = "; ".join(f"{k} {fmt_bytes(b)} @mesh{'+'.join(map(str, d))}" for d, k, b in o.comm) or "-"
        moves = "; ".join(o.moves(s.input_names)) or "-"
        rows.append(("*" if o.chosen else "", str(o.number), io, o.label, moves, comm, fmt_bytes(o.bytes), str(o.rounds), fmt_time(o.time)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {1, 6, 7, 8}
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        head.append("    " + "  ".join(cells).rstrip())
    head.append(f"    chosen: {s.reason}")
    return head


# ------------------------------------------------------------------ tracing on meta tensors


class _Recorder(TorchDispatchMode):
    """Records every aten op (after torch's own decompositions), running it on meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []
        self.decomposed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        decomposition = registry.DECOMPOSITIONS.get(func)
        if decomposition is not None:  # the runtime rewrites it into other ops: plan those
            self.decomposed.append(str(func))
            with self:
                return decomposition(*args, **kwargs)
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


class _Intercepts(TorchFunctionMode):
    """Notes torch-level callables that DTensor hands to registry.TORCH_FUNCTIONS."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            hit = func in registry.TORCH_FUNCTIONS
        except TypeError:  # unhashable callable
            hit = False
        if hit and func not in self.seen:
            self.seen.append(func)
        return func(*args, **(kwargs or {}))


def warm_up() -> float:
    """torch's first meta-kernel call imports torch._dynamo (seconds); pay it once, and say how long it took."""
    if not _WARM["done"]:
        t0 = time.perf_counter()
        x = torch.empty(2, 3, device="meta")
        (x.exp() + x).sum(1)
        _WARM["seconds"] = time.perf_counter() - t0
        _WARM["done"] = True
        return _WARM["seconds"]
    return 0.0


def _meta(spec: TensorSpec) -> torch.Tensor:
    return torch.empty_strided(spec.shape, spec.meta.stride, dtype=spec.dtype, device="meta")


def _trace(fn: Callable[[], Any]) -> tuple[_Recorder, _Intercepts]:
    rec, intercepts = _Recorder(), _Intercepts()
    try:
        with torch.no_grad(), intercepts, rec:
            fn()
    except ShardingError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. an op without a meta kernel, or .item()
        raise ShardingError(f"explain: torch cannot trace this call on meta tensors: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return rec, intercepts


# ------------------------------------------------------------------ planning the recorded ops


class _Names:
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


def _call_text(func, args, kwargs, names: _Names) -> str:
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
        return [((i,), kind, b) for i, counts in enumerate(per_dim) for (kind, b), n in counts.items() for _ in range(n)]
    merged = []
    for key in dict.fromkeys(k for counts in per_dim for k in counts):
        dims = tuple(i for i, counts in enumerate(per_dim) if key in counts)
        merged += [(dims, key[0], key[1])] * max(counts[key] for counts in per_dim)
    return merged


def _option(number: int, c: Candidate, specs: tuple[TensorSpec, ...], links) -> Option:
    with_plans(c, specs, links)
    comm = internal_collectives(c)
    label = "replicate-then-local" if _is_replicate(c) else c.label
    return Option(number, c.inputs, c.outputs, label, c.plans, comm, specs, c.time, c.redistribute_time, c.comm_time, c.pending_time,
                  replicate=_is_replicate(c))


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
        text += (f"; tied with {len(tied)} other(s) (e.g. {_name(tied[0])}): ties prefer fewer input changes, "
                 "then a pending output, then more sharding, then the rule's order")
    cheaper = [o for o in rest if o.time < chosen.time * 0.99]  # a 1% margin: estimates are not exact
    if cheaper:
        text += (f"; note {_name(cheaper[0])} is cheaper with its exact plan ({fmt_time(cheaper[0].time)}): "
                 "the runtime ranks candidates by a per-mesh-dim estimate")
    return text


def _plan_step(index: int, func, args, kwargs, out, names: _Names, links, top: int) -> Step:
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
    return Step(index, str(func), call, input_names, specs, out_specs, shown, total, chosen, _reason(chosen, others))


def _fallback_step(index, func, call, input_names, specs, out_tensors, replicate_only: bool, links) -> Step:
    mesh = specs[0].mesh
    plans = tuple(plan(s, (R,) * mesh.ndim, links) for s in specs)
    opt = Option(1, tuple((R,) * mesh.ndim for _ in specs), tuple((R,) * mesh.ndim for _ in out_tensors), "replicate-then-local",
                 plans, [], specs, sum(p.time for p in plans), sum(p.time for p in plans), 0.0, 0.0, chosen=True, replicate=True)
    out_specs = [TensorSpec(mesh, (R,) * mesh.ndim, TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype)) for t in out_tensors]
    why = "replicated on purpose" if replicate_only else "no sharded strategy"
    return Step(index, str(func), call, input_names, specs, out_specs, [opt], 1, opt, f"#1 {why}: replicate-then-local, {fmt_time(opt.time)}",
                fallback=True, replicate_only=replicate_only)


def _plan_all(rec: _Recorder, names: _Names, links, top: int) -> list[Step]:
    steps = []
    for func, args, kwargs, out in rec.calls:
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not any(names.known(t) for t in tensors):
            continue  # only plain tensors: the runtime never sees this op
        step = _plan_step(len(steps) + 1, func, args, kwargs, out, names, links, top)
        for k, (t, spec) in enumerate(zip(outs, step.out_specs)):
            names.add(t, spec, f"%{step.index}" + (f".{k}" if len(outs) > 1 else ""))
        steps.append(step)
    return steps


# ------------------------------------------------------------------ entry points


def _namespace(tensors: dict[str, torch.Tensor]):
    """Names an expression may use: its tensors, then torch.nn.functional, then torch (no Python builtins)."""
    import torch.nn.functional as F

    class Lookup(dict):
        def __missing__(self, key):
            for owner in (F, torch):
                if not key.startswith("_") and hasattr(owner, key):
                    return getattr(owner, key)
            raise NameError(key)

    return Lookup(tensors, torch=torch, F=F, math=math)


def _is_spec_like(v: Any) -> bool:
    return isinstance(v, TensorSpec) or (isinstance(v, str) and _SPEC_RE.match(v) is not None)


def explain(op: Any, *args: Any, mesh: Any = None, links: Any = None, top: int = DEFAULT_TOP, **kwargs: Any) -> Explanation:
    """Plan `op` without data or a world: an expression string with named tensors, or a callable with specs.

        so.explain("softmax(x, dim=1)", mesh=(8, 8, 16), links="nvlink,ib,ib", x="f32[8,4096]:R,R,S(1)")
        so.explain(torch.softmax, x_spec, dim=1)            # x_spec: a TensorSpec (its mesh is used)
        so.explain(torch.add, "f32[8,6]:S(0)", "f32[8,6]:S(1)", mesh=4)

    Specs are TensorSpec or strings "DTYPE[SHAPE]:PLACEMENTS". Returns an Explanation
    (readable str(), .to_dict(), .steps with every candidate, .bytes_at(coordinate)).
    """
    t_start = time.perf_counter()
    warm = warm_up()
    mesh_obj = _mesh_from(mesh, args, kwargs)
    link_tuple = parse_links(links, mesh_obj.ndim)
    names = _Names(mesh_obj)
    if isinstance(op, str):
        inputs = {k: parse_spec(v, mesh_obj, k) for k, v in kwargs.items()}
        if args:
            raise ShardingError(f"explain: an expression takes its tensors by name (x=...), not positionally; got {len(args)} positional")
        metas = {k: _meta(s) for k, s in inputs.items()}
        for k, t in metas.items():
            names.add(t, inputs[k], k)
        expression = op.strip()
        thunk = lambda: _eval(expression, metas)  # noqa: E731
    else:
        inputs, call_args, call_kwargs = _callable_inputs(args, kwargs, mesh_obj, names)
        expression = _callable_text(op, args, kwargs)
        thunk = lambda: op(*call_args, **call_kwargs)  # noqa: E731
    t_trace = time.perf_counter()
    rec, intercepts = _trace(thunk)
    t_plan = time.perf_counter()
    steps = _plan_all(rec, names, link_tuple, top)
    t_end = time.perf_counter()
    notes = _notes(rec, intercepts, steps)
    timings = {"trace_s": t_plan - t_trace, "plan_s": t_end - t_plan, "warmup_s": warm, "total_s": t_end - t_start}
    return Explanation(expression, mesh_obj.shape, _link_names(link_tuple), inputs, steps, notes, timings, top)


def _mesh_from(mesh: Any, args, kwargs) -> DeviceMesh:
    if mesh is not None:
        return parse_mesh(mesh)
    for v in pytree.tree_leaves((args, kwargs)):
        if isinstance(v, TensorSpec):
            return v.mesh
    raise ShardingError("explain: give mesh=... (e.g. mesh=(2, 2) or mesh=4096) when the tensors are spec strings")


def _callable_inputs(args, kwargs, mesh: DeviceMesh, names: _Names):
    inputs: dict[str, TensorSpec] = {}

    def convert(v, name):
        if not _is_spec_like(v):
            return v
        spec = parse_spec(v, mesh, name)
        t = _meta(spec)
        names.add(t, spec, name)
        inputs[name] = spec
        return t

    call_args = [_convert_nested(v, f"arg{i}", convert) for i, v in enumerate(args)]
    call_kwargs = {k: _convert_nested(v, k, convert) for k, v in kwargs.items()}
    if not inputs:
        raise ShardingError(f"explain: no tensor among the arguments; {SPEC_HELP}")
    return inputs, call_args, call_kwargs


def _convert_nested(v, name: str, convert):
    """Specs inside lists (foreach ops, cat) are named name.0, name.1, ..."""
    if isinstance(v, (list, tuple)) and any(_is_spec_like(x) for x in v):
        return type(v)(convert(x, f"{name}.{i}") for i, x in enumerate(v))
    return convert(v, name)


def _callable_text(op, args, kwargs) -> str:
    from .verify import callable_name

    name = str(op) if isinstance(op, torch._ops.OpOverload) else callable_name(op)
    parts = [f"arg{i}" if _is_spec_like(a) else repr(a) for i, a in enumerate(args)]
    parts += [f"{k}={k if _is_spec_like(v) else repr(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _eval(expression: str, metas: dict[str, torch.Tensor]) -> Any:
    try:
        code = compile(expression, "<explain>", "eval")
    except SyntaxError as e:
        raise ShardingError(f"explain: {expression!r} is not a Python expression ({e.msg})") from None
    try:
        return eval(code, {"__builtins__": {}}, _namespace(metas))  # noqa: S307 - the user's own expression
    except NameError as e:
        have = ", ".join(metas) or "none"
        raise ShardingError(f"explain: unknown name {e} in {expression!r}; name each tensor (--x SPEC or x=SPEC); tensors given: {have}") from None
    except ShardingError:
        raise
    except Exception as e:  # noqa: BLE001 - torch rejected the call on these shapes
        raise ShardingError(f"explain: torch rejects {expression!r} on these inputs: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def _notes(rec: _Recorder, intercepts: _Intercepts, steps: list[Step]) -> list[str]:
    from .verify import callable_name

    notes = []
    for fn in intercepts.seen:
        impl = registry.TORCH_FUNCTIONS[fn]
        where = getattr(impl, "__module__", "?")
        notes.append(f"{callable_name(fn)} is intercepted at the torch-function level ({where}); "
                     "it carries its own sharded implementation/backward, and the plan below is for the aten ops it maps to")
    for name in dict.fromkeys(rec.decomposed):
        notes.append(f"{name} is rewritten by the runtime (registry.DECOMPOSITIONS); its parts are planned below")
    for s in steps:
        if s.fallback and not s.replicate_only:
            notes.append(f"{s.op} has no sharded strategy: it replicates its inputs (so.set_strict(True) makes that an error)")
    if not steps:
        notes.append("no op of this call touches a sharded tensor")
    return notes


# ------------------------------------------------------------------ command line


def add_arguments(parser) -> None:
    parser.add_argument("expression", help='a torch call on named tensors, e.g. "softmax(x, dim=1)" or "F.cross_entropy(x, t)"')
    parser.add_argument("--mesh", required=True, help="mesh shape: 4096, 8x8x16, 2x2")
    parser.add_argument("--links", default=None, help="link model per mesh dim: nvlink,ib,ib (presets: " + ", ".join(sorted(cost.PRESETS)) + ")")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="candidates shown per step (default 10)")
    parser.add_argument("--tensor", "-t", action="append", default=[], metavar="NAME=SPEC", help="a named tensor (also: --NAME SPEC)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", help="JSON instead of text (to PATH, or stdout)")


def main(args, extra: Sequence[str] = ()) -> int:
    """`shardops explain` with parsed arguments; `extra` holds the --NAME SPEC pairs."""
    import json

    tensors = dict(_named_tensors(args.tensor, extra))
    result = explain(args.expression, mesh=args.mesh, links=args.links, top=args.top, **tensors)
    if args.json is None:
        print(result)
    elif args.json == "-":
        print(json.dumps(result.to_dict(), indent=1))
    else:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0


def _named_tensors(pairs: Sequence[str], extra: Sequence[str]):
    for p in pairs:
        if "=" not in p:
            raise ShardingError(f"explain: --tensor {p!r} should be NAME=SPEC")
        name, spec = p.split("=", 1)
        yield name.strip(), spec.strip()
    extra = list(extra)
    i = 0
    while i < len(extra):
        flag = extra[i]
        name, eq, spec = flag[2:].partition("=")
        if not flag.startswith("--") or not name.isidentifier():
            raise ShardingError(f"explain: unexpected argument {flag!r}; name tensors as --NAME SPEC")
        if eq:
            yield name, spec
            i += 1
            continue
        if i + 1 >= len(extra):
            raise ShardingError(f"explain: {flag} needs a spec, e.g. {flag} 'f32[8,4096]:R,S(1)'")
        yield flag[2:], extra[i + 1]
        i += 2
