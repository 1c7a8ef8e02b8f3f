"""`so.explain(op, *args, mesh=..., links=..., **kwargs)`: trace, plan every step, gather notes."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .._torch import pytree
from ..dispatch import core, registry
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..notation import callable_name
from ..spec import TensorSpec
from .planning import Names, plan_all
from .result import DEFAULT_TOP, Explanation, Step
from .specs import SPEC_HELP, SPEC_RE, link_names, parse_links, parse_mesh, parse_spec
from .trace import Intercepts, Recorder, meta_tensor, trace, warm_up


def _namespace(tensors: dict[str, torch.Tensor]):
    """Names an expression may use: its tensors, then torch.nn.functional, then torch (no Python builtins)."""
    import torch.nn.functional as F

    class Lookup(dict):
        def __missing__(self, key):
            for owner in (F, torch):
                if not key.startswith("_") and hasattr(owner, key):
                    return getattr(owner, key)
            raise NameError(key)

    from .moe import moe

    return Lookup(tensors, torch=torch, F=F, math=math, moe=moe)


def _is_spec_like(v: Any) -> bool:
    return isinstance(v, TensorSpec) or (isinstance(v, str) and SPEC_RE.match(v) is not None)


def explain(
    op: Any, *args: Any, mesh: Any = None, links: Any = None, top: int = DEFAULT_TOP, **kwargs: Any
) -> Explanation:
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
    names = Names(mesh_obj)
    if isinstance(op, str):
        inputs = {k: parse_spec(v, mesh_obj, k) for k, v in kwargs.items()}
        if args:
            raise ShardingError(
                f"explain: an expression takes its tensors by name (x=...), not positionally; got {len(args)} "
                "positional"
            )
        metas = {k: meta_tensor(s) for k, s in inputs.items()}
        for k, t in metas.items():
            names.add(t, inputs[k], k)
        expression = op.strip()
        thunk = lambda: _eval(expression, metas)  # noqa: E731
    else:
        inputs, call_args, call_kwargs = _callable_inputs(args, kwargs, mesh_obj, names)
        expression = _callable_text(op, args, kwargs)
        thunk = lambda: op(*call_args, **call_kwargs)  # noqa: E731
    t_trace = time.perf_counter()
    rec, intercepts = trace(thunk)
    t_plan = time.perf_counter()
    steps = plan_all(rec, names, link_tuple, top)
    t_end = time.perf_counter()
    notes = _notes(rec, intercepts, steps)
    timings = {"trace_s": t_plan - t_trace, "plan_s": t_end - t_plan, "warmup_s": warm, "total_s": t_end - t_start}
    return Explanation(expression, mesh_obj.shape, link_names(link_tuple), inputs, steps, notes, timings, top)


def _mesh_from(mesh: Any, args, kwargs) -> DeviceMesh:
    if mesh is not None:
        return parse_mesh(mesh)
    for v in pytree.tree_leaves((args, kwargs)):
        if isinstance(v, TensorSpec):
            return v.mesh
    raise ShardingError("explain: give mesh=... (e.g. mesh=(2, 2) or mesh=4096) when the tensors are spec strings")


def _callable_inputs(args, kwargs, mesh: DeviceMesh, names: Names):
    inputs: dict[str, TensorSpec] = {}

    def convert(v, name):
        if not _is_spec_like(v):
            return v
        spec = parse_spec(v, mesh, name)
        t = meta_tensor(spec)
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
    name = callable_name(op)
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
        raise ShardingError(
            f"explain: unknown name {e} in {expression!r}; name each tensor (--x SPEC or x=SPEC); tensors given: {have}"
        ) from None
    except ShardingError:
        raise
    except Exception as e:  # noqa: BLE001 - torch rejected the call on these shapes
        raise ShardingError(
            f"explain: torch rejects {expression!r} on these inputs: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from None


def _notes(rec: Recorder, intercepts: Intercepts, steps: list[Step]) -> list[str]:
    notes = []
    for fn in intercepts.seen:
        impl = registry.TORCH_FUNCTIONS[fn]
        where = getattr(impl, "__module__", "?")
        notes.append(
            f"{callable_name(fn)} is intercepted at the torch-function level ({where}); "
            "it carries its own sharded implementation/backward, and the plan below is for the aten ops it maps to"
        )
    for name in dict.fromkeys(rec.decomposed):
        notes.append(f"{name} is rewritten by the runtime (registry.DECOMPOSITIONS); its parts are planned below")
    for s in steps:
        if s.fallback and not s.replicate_only:
            notes.append(
                f"{s.op} has no sharded strategy: it replicates its inputs (so.set_strict(True) makes that an error)"
            )
    allowed = core.allowed_to_replicate()
    for s in steps:
        if s.gathers is not None:
            name = core.op_name(s.op)
            state = (
                "allowed now by so.allow_replicate"
                if name in allowed
                else f"strict mode raises unless so.allow_replicate({name!r})"
            )
            notes.append(f"{s.op} {s.gathers}: it moves sharded data; {state}")
    if allowed:
        notes.append("so.allow_replicate lets these ops replicate in strict mode: " + ", ".join(allowed))
    if not steps:
        notes.append("no op of this call touches a sharded tensor")
    return notes
