"""The dispatch path every op on a DTensor takes.

    parse (schema) -> rule -> candidates -> cheapest (same on every rank)
      -> redistribute inputs -> local kernel or sharded algorithm -> wrap outputs

Decisions are cached by everything that changes them: the overload, each tensor
operand's mesh/placements/shape/stride/dtype, and every static argument.
A cache hit does no parsing, no planning and builds no specs.
"""
from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .. import cost
from ..errors import ShardingError
from ..placements import Placement, Replicate
from ..redistribute import Plan, execute, materialize_lazy_bits, plan, plan_bytes
from ..spec import TensorMeta, TensorSpec, contiguous_stride
from .registry import DECOMPOSITIONS, REPLICATE_ONLY, RULES
from .schema import OpSchema, spec_key, static_key
from .strategy import Candidate, candidates, with_plans

aten = torch.ops.aten
_state = {"strict": False}
_CACHE: dict[tuple, "Decision"] = {}
_state["debug"] = os.environ.get("SHARDOPS_DEBUG", "") not in ("", "0")


def set_debug(enabled: bool = True) -> None:
    """Check across ranks, at every dispatch, that plans and plain-tensor operands agree (SHARDOPS_DEBUG=1)."""
    _state["debug"] = bool(enabled)


class FallbackWarning(UserWarning):
    """An op ran replicated because it has no sharded strategy."""


def set_strict(strict: bool = True) -> None:
    """Strict mode: an op with no strategy raises instead of replicating."""
    _state["strict"] = bool(strict)
    _CACHE.clear()


def clear_cache() -> None:
    _CACHE.clear()


@dataclass
class AlgoContext:
    """What a sharded algorithm needs besides the local tensors."""

    schema: OpSchema
    in_specs: tuple[TensorSpec, ...]  # inputs as the algorithm receives them
    out_specs: tuple[TensorSpec, ...]
    func: Any

    @property
    def mesh(self):
        return self.in_specs[0].mesh


@dataclass
class Decision:
    func: Any
    in_specs: tuple[TensorSpec, ...]  # current layouts of the tensor operands
    plans: tuple[Plan, ...]
    out_specs: tuple[TensorSpec, ...] | None  # None: known only after running (fallback)
    algorithm: Callable[..., Any] | None
    context: AlgoContext | None
    candidate: Candidate | None
    fallback: bool = False
    inplace: bool = False

    @property
    def moves(self) -> tuple[int, ...]:
        """Indices of the operands that need redistributing (cached: read on every call)."""
        m = self.__dict__.get("_moves")
        if m is None:
            m = self.__dict__["_moves"] = tuple(k for k, p in enumerate(self.plans) if p.steps)
        return m


# ------------------------------------------------------------------ entry


def dispatch(func, args: tuple, kwargs: dict | None) -> Any:
    from ..tensor import DTensor

    kwargs = kwargs or {}
    decomposition = DECOMPOSITIONS.get(func)
    if decomposition is not None:
        return decomposition(*args, **kwargs)
    names = out_arg_names(func)
    if names and all(n in kwargs for n in names):
        return dispatch_out_variant(func, args, kwargs, names)
    flat, tree = flatten_args(args, kwargs)
    key_parts = []
    tensor_pos = []
    for i, a in enumerate(flat):
        if isinstance(a, DTensor):
            key_parts.append(a._key)
            tensor_pos.append(i)
        elif isinstance(a, torch.Tensor):
            key_parts.append(("plain", a.shape, a.dtype, a.device.type))
            tensor_pos.append(i)
        else:
            key_parts.append(static_key(a))
    key = (func, len(args), tuple(kwargs), tuple(key_parts), cost._CACHE_EPOCH[0])
    decision = _CACHE.get(key)
    if decision is None:
        decision = decide(func, flat, tree, tensor_pos)
        if not decision.fallback:
            _CACHE[key] = decision
    elif decision.fallback:
        _warn_fallback(decision, flat, tensor_pos)
    if _state["debug"]:
        from .debug import check_agreement

        check_agreement(decision, flat, tensor_pos)
    return run(decision, flat, tree, tensor_pos)


def flatten_args(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """Leaves of (args, kwargs); tree None marks the common flat case (no kwargs, no lists), which skips pytree."""
    if not kwargs and not any(isinstance(a, (list, tuple)) for a in args):
        return list(args), None
    return pytree.tree_flatten((args, kwargs))


def unflatten_args(leaves: list, tree: Any) -> tuple[tuple, dict]:
    if tree is None:
        return tuple(leaves), {}
    return pytree.tree_unflatten(leaves, tree)


# ------------------------------------------------------------------ deciding


def operand_specs(flat: Sequence[Any], tensor_pos: Sequence[int], func) -> tuple[TensorSpec, ...]:
    from ..tensor import DTensor

    mesh = None
    for i in tensor_pos:
        if isinstance(flat[i], DTensor):
            m = flat[i]._spec.mesh
            if mesh is None:
                mesh = m
            elif m != mesh:
                raise ShardingError(
                    f"{func}: operands live on different meshes ({mesh} and {m}); "
                    "redistribute them onto one mesh first (e.g. build both with the same DeviceMesh)."
                )
    specs = []
    for i in tensor_pos:
        a = flat[i]
        if isinstance(a, DTensor):
            specs.append(a._spec)
        else:  # a plain tensor is taken as Replicate on the DTensors' mesh
            meta = TensorMeta(tuple(a.shape), tuple(a.stride()), a.dtype)
            specs.append(TensorSpec(mesh, (Replicate(),) * mesh.ndim, meta))
    return tuple(specs)


def make_schema(func, flat, tree, tensor_pos, specs) -> OpSchema:
    leaves = list(flat)
    for i, s in zip(tensor_pos, specs):
        leaves[i] = s
    args, kwargs = unflatten_args(leaves, tree)
    return OpSchema(func, tuple(args), dict(kwargs), tuple(specs))


_last_meta_error = threading.local()


def meta_outputs(func, flat, tree, tensor_pos, specs) -> tuple[list[TensorMeta], Any] | None:
    """Global output metadata from running the op on meta tensors (None if meta can't run it)."""
    leaves = list(flat)
    for i, s in zip(tensor_pos, specs):
        leaves[i] = torch.empty_strided(s.shape, s.meta.stride, dtype=s.dtype, device="meta")
    leaves = [torch.empty_strided(a.shape, a.meta.stride, dtype=a.dtype, device="meta") if isinstance(a, TensorSpec) else a for a in leaves]
    args, kwargs = unflatten_args(leaves, tree)
    if "device" in kwargs and func is aten._to_copy.default:
        # index helper (issue 14): x.to(dtype) inside torch.softmax(x, d, dtype=...) passes device=cpu,
        # which a meta tensor cannot be copied to; the output's metadata does not depend on it.
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    try:
        out = func(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - ops without meta kernels fall back
        _last_meta_error.error = e  # torch's own refusal, if that is what it was: named by the fallback's errors
        return None
    metas = [TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return metas, out


def _inplace_index(func, flat, tensor_pos) -> int | None:
    s = func._schema
    if s.arguments and s.arguments[0].alias_info is not None and s.arguments[0].alias_info.is_write:
        return 0
    return None


_OUT_NAMES: dict[Any, tuple[str, ...]] = {}


def out_arg_names(func) -> tuple[str, ...]:
    """Names of out= arguments (kwarg-only, written to) of an overload; () for functional ops."""
    names = _OUT_NAMES.get(func)
    if names is None:
        names = _OUT_NAMES[func] = tuple(
            a.name for a in func._schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
        )
    return names


def dispatch_out_variant(func, args: tuple, kwargs: dict, names: tuple[str, ...]) -> Any:
    """out= overloads: run the functional op, then move each result into its out tensor."""
    from ..tensor import DTensor

    outs = [kwargs[n] for n in names]
    rest = {k: v for k, v in kwargs.items() if k not in names}
    packet = getattr(aten, func._schema.name.split("::")[-1])
    result = packet(*args, **rest)
    results = result if isinstance(result, (tuple, list)) else (result,)
    for res, out in zip(results, outs):  # every check before the first write: a refused call changes nothing
        if not isinstance(out, DTensor):
            raise ShardingError(f"{func}: out= must be a DTensor when the inputs are DTensors")
        if not torch.can_cast(res.dtype, out.dtype):
            raise ShardingError(f"{func}: result type {res.dtype} can't be cast to the desired output type {out.dtype} of out= (as torch refuses it)")
    for res, out in zip(results, outs):
        if not isinstance(res, DTensor):
            res = DTensor._make(res, TensorSpec(out._spec.mesh, (Replicate(),) * out._spec.mesh.ndim, TensorMeta(tuple(res.shape), tuple(res.stride()), res.dtype)))
        moved = res._redistribute_local(out._spec.placements) if res._spec.placements != out._spec.placements else res._local_tensor
        out._local_tensor.resize_(moved.shape).copy_(moved)
        out._set_spec(TensorSpec(out._spec.mesh, out._spec.placements, TensorMeta(res._spec.shape, res._spec.meta.stride, out._spec.dtype)))
    return outs[0] if len(outs) == 1 else tuple(outs)


def decide(func, flat, tree, tensor_pos) -> Decision:
    specs = operand_specs(flat, tensor_pos, func)
    schema = make_schema(func, flat, tree, tensor_pos, specs)
    inplace = _inplace_index(func, flat, tensor_pos) == 0 and bool(tensor_pos) and tensor_pos[0] == 0
    rule = RULES.get(func)
    metas = meta_outputs(func, flat, tree, tensor_pos, specs) if rule is not None else None
    if rule is not None and metas is None:
        rule(schema)  # a rule names user errors (dim out of range, bad k) that made the meta run fail
    if rule is None or metas is None:
        return _fallback_decision(func, schema, specs, flat, tensor_pos)
    out_metas = metas[0]
    rows = rule(schema)
    filt = _inplace_filter(specs) if inplace else None
    cands = candidates(rows, specs, [(m.shape, _itemsize(m.dtype)) for m in out_metas], filter_fn=filt)
    if not cands:
        raise ShardingError(
            f"{schema.name}: in-place op on {specs[0]!r} would need self in another layout; "
            "an in-place op never changes its tensor's local shape. Redistribute the tensor first, or use the out-of-place op."
        )
    best = with_plans(cands[0], specs)
    mesh = specs[0].mesh
    out_specs = tuple(TensorSpec(mesh, pl, m) for pl, m in zip(best.outputs, out_metas))
    in_after = tuple(s.with_placements(pl) for s, pl in zip(specs, best.inputs))
    ctx = AlgoContext(schema, in_after, out_specs, func) if best.algorithm is not None else None
    return Decision(func, specs, best.plans, out_specs, best.algorithm, ctx, best, inplace=inplace)


def _inplace_filter(specs):
    """An in-place op keeps self's layout; only resolving a pending partial in place is allowed."""
    mine = specs[0].placements

    def ok(c: Candidate) -> bool:
        target = c.inputs[0]
        out = c.outputs[0]
        if out != target:
            return False
        return all(t == m or (m.is_partial() and t.is_replicate()) for t, m in zip(target, mine))

    return ok


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _fallback_decision(func, schema, specs, flat, tensor_pos) -> Decision:
    if func in REPLICATE_ONLY:
        pass  # replicate on purpose: no warning about a missing strategy
    elif _state["strict"]:
        raise ShardingError(
            f"{schema.name} has no sharded strategy (strict mode) for inputs {list(specs)}; "
            "call so.set_strict(False) to replicate and run locally, or redistribute to Replicate yourself."
        )
    plans = tuple(plan(s, (Replicate(),) * s.mesh.ndim) for s in specs)
    d = Decision(func, specs, plans, None, None, None, None, fallback=True)
    d.inplace = _inplace_index(func, flat, tensor_pos) == 0
    if d.inplace and any(not p.is_replicate() and not p.is_partial() for p in specs[0].placements):
        meta_error = getattr(_last_meta_error, "error", None) if func in RULES else None
        if meta_error is not None and not isinstance(meta_error, NotImplementedError):
            # The op has a rule but torch refused the call itself (a dtype or shape error): say that, not "layout".
            raise ShardingError(f"{schema.name} on {list(specs)}: torch refuses this call: {meta_error}") from meta_error
        raise ShardingError(
            f"{schema.name}: in-place op with no sharded strategy on {specs[0]!r}; it would change self's "
            "layout. Redistribute self to Replicate first, or use the out-of-place op."
        )
    _warn_fallback(d, flat, tensor_pos)
    return d


def _warn_fallback(d: Decision, flat, tensor_pos) -> None:
    if d.func in REPLICATE_ONLY:
        return
    coord = d.in_specs[0].mesh.get_coordinate()
    moved = sum(plan_bytes(s, p, coord) for s, p in zip(d.in_specs, d.plans))
    warnings.warn(
        f"shardops: {d.func} has no sharded strategy; replicated its inputs and ran locally ({moved} bytes moved on this rank). "
        "so.set_strict(True) makes this an error.",
        FallbackWarning,
        stacklevel=4,
    )


# ------------------------------------------------------------------ running


def run(d: Decision, flat: list, tree, tensor_pos: Sequence[int]) -> Any:
    from ..tensor import DTensor

    leaves = list(flat)
    for i in tensor_pos:
        a = flat[i]
        if type(a) is DTensor:
            leaves[i] = a._local_tensor
    for k in d.moves:
        i = tensor_pos[k]
        new = execute(leaves[i], d.in_specs[k], d.plans[k])
        if d.inplace and k == 0:  # resolve self's pending partial in place, same local shape
            leaves[i].copy_(new)
            flat[i]._set_spec(d.in_specs[0].with_placements(d.plans[0].dst))
        else:
            leaves[i] = new
    if d.algorithm is not None:  # index helper (issue 14): algorithms read values, never lazy conj/neg bits
        leaves = [materialize_lazy_bits(t) if isinstance(t, torch.Tensor) else t for t in leaves]
    args, kwargs = unflatten_args(leaves, tree)
    if d.algorithm is not None:
        out = d.algorithm(d.context, *args, **kwargs)
    else:
        out = d.func(*args, **kwargs)
    if d.inplace:
        return flat[tensor_pos[0]]
    if type(out) is torch.Tensor and d.out_specs is not None:
        return DTensor._make(out, d.out_specs[0])
    out_leaves, out_tree = pytree.tree_flatten(out)
    specs = d.out_specs
    if specs is None:  # fallback: every output is replicated, shapes as they came out
        mesh = d.in_specs[0].mesh
        specs = tuple(
            TensorSpec(mesh, (Replicate(),) * mesh.ndim, TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype))
            for t in out_leaves
            if isinstance(t, torch.Tensor)
        )
    wrapped, j = [], 0
    for t in out_leaves:
        if isinstance(t, torch.Tensor):
            wrapped.append(DTensor._make(t, specs[j]))
            j += 1
        else:
            wrapped.append(t)
    return pytree.tree_unflatten(wrapped, out_tree)


# ------------------------------------------------------------------ planning only (explain, verify)


@dataclass
class PlanReport:
    schema: OpSchema
    candidates: list[Candidate]  # cheapest first; empty for a replicate fallback
    out_metas: list[TensorMeta]
    fallback: bool
    replicate_only: bool


def plan_op(func, args: tuple, kwargs: dict | None = None, links=None) -> PlanReport:
    """Every candidate for `func` on TensorSpec operands: metadata only, no data, no collectives, no rank needed."""
    kwargs = kwargs or {}
    flat, tree = pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, a in enumerate(flat) if isinstance(a, TensorSpec)]
    specs = tuple(flat[i] for i in tensor_pos)
    schema = make_schema(func, flat, tree, tensor_pos, specs)
    rule = RULES.get(func)
    metas = meta_outputs(func, flat, tree, tensor_pos, specs)
    out_metas = metas[0] if metas is not None else []
    if rule is None or metas is None:
        return PlanReport(schema, [], out_metas, True, func in REPLICATE_ONLY)
    rows = rule(schema)
    inplace = _inplace_index(func, flat, tensor_pos) == 0 and bool(tensor_pos) and tensor_pos[0] == 0
    cands = candidates(rows, specs, [(m.shape, _itemsize(m.dtype)) for m in out_metas], links=links, filter_fn=_inplace_filter(specs) if inplace else None)
    return PlanReport(schema, cands, out_metas, False, False)
