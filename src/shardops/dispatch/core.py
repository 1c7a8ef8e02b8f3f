"""Deciding and running an op on local tensors and their specs.

    operands' specs -> schema -> rule -> candidates -> cheapest (same on every rank)
      -> redistribute the local inputs -> local kernel or sharded algorithm -> local outputs

This module never sees a DTensor: tensor.py unwraps the operands, calls `decide`
(on a cache miss) and `run`, and wraps the outputs with `Decision.out_specs`.
explain plans through the same `decide` on specs alone (no data, no rank needed).

Decisions are cached by everything that changes them: the overload, each tensor
operand's mesh/placements/shape/stride/dtype, every static argument and the link
model. A cache hit does no parsing, no planning and builds no specs. A float argument
is the exception: it is data to most ops (AdamW's step size, new every step), so its key
is its type alone until a decision of the op reads it (`float_key`); then its value, or
the class the rule asked for (a scalar's sign, for the partials that pass through `mul`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import caches
from .._torch import pytree
from .._torch.dispatch import OpOverload, OpOverloadPacket
from ..errors import NoShardingStrategyError, ShardingError
from ..placements import Replicate
from ..planner.choice import caching_decisions, candidates, with_plans
from ..planner.rows import Candidate
from ..redistribute import Plan, execute, materialize_lazy_bits, plan, plan_bytes
from ..spec import TensorMeta, TensorSpec
from .registry import REPLICATE_ONLY, REPLICATE_WHEN, RULES
from .schema import EVERY, EXACTLY, OpSchema, _binding

aten = torch.ops.aten
_state = {"strict": False}
_CACHE: dict[tuple, Decision] = {}
# A decision holds its specs, plans and schema: about 2.5 KB each (tracemalloc over 1,185 decisions
# of add/sum/softmax on distinct shapes), so the bounded cache stays near 20 MB at most.
MAX_DECISIONS = 8192
_state["debug"] = os.environ.get("SHARDOPS_DEBUG", "") not in ("", "0")


def set_debug(enabled: bool = True) -> None:
    """Check across ranks, at every dispatch, that plans and plain-tensor operands agree (SHARDOPS_DEBUG=1)."""
    _state["debug"] = bool(enabled)


class FallbackWarning(UserWarning):
    """An op ran replicated because it has no sharded strategy."""


caches.register("decisions", _CACHE.clear)

# op -> {argument name: how its decisions read it (EXACTLY, or a classifier from OpSchema.arg_class)};
# EVERY: all arguments exactly. Learned from the decisions' reads; it only grows (invalidate clears it).
_FLOAT_READS: dict[Any, dict[str, Callable[[Any], Any] | None]] = {}
_LEAF_NAMES: dict[tuple, tuple[str | None, ...]] = {}
# the key of a float argument no decision of its op reads (typed Any: a sentinel, compared by identity)
_UNREAD: Any = ("float, unread",)
_CLASS = "class"


def _clear_float_reads() -> None:
    _FLOAT_READS.clear()
    _LEAF_NAMES.clear()


caches.register("float arguments read", _clear_float_reads)


def set_strict(strict: bool = True) -> None:
    """Strict mode: nothing is gathered. Any step that moves data of a sharded or pending dim that the
    op's own sharded algorithm would not move raises, naming the op and the bytes: an op with no
    strategy (inputs sharded or pending), an op replicated on purpose (svd, qr, ..., sort over a
    sharded dim), a plan that gathers a sharded input to run replicated on a mesh dim (a rule's
    implicit all-Replicate row); unless `allow_replicate` allows that op. An op whose inputs are
    all Replicate already runs locally (0 B) in either mode."""
    _state["strict"] = bool(strict)
    caches.invalidate()  # a decision made in the other mode may fall back where this one must raise


# op name -> how many allowances (global calls, open `with` blocks) let it replicate in strict mode
_ALLOWED: dict[str, int] = {}
# torch-level names of the replicate-on-purpose ops -> the aten op that gathers
_ALLOW_ALIASES = {
    "svd": "_linalg_svd",
    "linalg_svd": "_linalg_svd",
    "eigh": "_linalg_eigh",
    "linalg_eigh": "_linalg_eigh",
    "qr": "linalg_qr",
    "solve_triangular": "linalg_solve_triangular",
    "argsort": "sort",
    "orthogonal_": "linalg_qr",
}


def op_name(op: Any) -> str:
    """The name strict mode and `allow_replicate` know an op by: its aten name without overload
    (aten._linalg_svd.default -> "_linalg_svd"); torch-level names map to the aten op that gathers."""
    if isinstance(op, OpOverload):
        name = op._schema.name
    elif isinstance(op, OpOverloadPacket):
        name = op._qualified_op_name
    elif isinstance(op, str):
        name = op
    elif callable(op) and hasattr(op, "__name__"):
        name = op.__name__
    else:
        raise ShardingError(
            f"allow_replicate: {op!r} is not an op; give torch functions (torch.linalg.svd), aten ops or names ('sort')"
        )
    name = name.split("::")[-1]
    if name.startswith("aten."):
        name = name[len("aten.") :]
    name = name.split(".")[0]
    return _ALLOW_ALIASES.get(name, name)


class allow_replicate:
    """Let `ops` replicate (gather their sharded inputs) in strict mode.

        so.allow_replicate(torch.linalg.svd, "sort")      # from now on
        with so.allow_replicate(torch.linalg.qr):         # inside the block only
            q, r = torch.linalg.qr(w)

    An op is named by a torch function, an aten op or its name (what the strict-mode error
    names); all overloads of the op are allowed. Non-strict mode replicates anyway. The
    allowance is process-wide (every rank thread of the threads world sees it); so.explain
    lists the allowed ops.
    """

    def __init__(self, *ops: Any) -> None:
        self.names = tuple(dict.fromkeys(op_name(op) for op in ops))
        for name in self.names:
            _ALLOWED[name] = _ALLOWED.get(name, 0) + 1

    def __enter__(self) -> allow_replicate:
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self.names:
            left = _ALLOWED.get(name, 0) - 1
            if left > 0:
                _ALLOWED[name] = left
            else:
                _ALLOWED.pop(name, None)


def allowed_to_replicate() -> tuple[str, ...]:
    """The ops strict mode lets replicate now (allow_replicate), by name."""
    return tuple(sorted(_ALLOWED))


def replicate_allowed(func) -> bool:
    return bool(_ALLOWED) and op_name(func) in _ALLOWED


@dataclass
class AlgoContext:
    """What a sharded algorithm needs besides the local tensors."""

    schema: OpSchema
    in_specs: tuple[TensorSpec, ...]  # inputs as the algorithm receives them
    out_specs: tuple[TensorSpec, ...]
    func: Any
    keep: dict[str, Any] | None = None  # where a caller asks: what the algorithm keeps for its backward (attention)

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
    schema: OpSchema = field(kw_only=True)  # every decision has one (keyword: it follows defaults)
    candidates: list[Candidate] = field(default_factory=list)  # every candidate, cheapest first (explain reads it)
    out_metas: list[TensorMeta] = field(default_factory=list)
    replicate_only: bool = False
    meta_error: Exception | None = None  # torch's own refusal on meta tensors, if that is why there is no plan
    # Strict mode's subject: the chosen plan gathers sharded data the op's own algorithm would not
    # (replicated on purpose, or gathered to run replicated); its text names how. None: it does not.
    gathers: str | None = None

    def __post_init__(self) -> None:
        # read on every call: indices of the operands that need redistributing
        self.moves: tuple[int, ...] = tuple(k for k, p in enumerate(self.plans) if p.steps)


# ------------------------------------------------------------------ arguments


def flatten_args(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """Leaves of (args, kwargs) and how to rebuild them (`unflatten_args`).

    aten arguments nest at most one level (Tensor[], int[]), so a flat walk does, with no
    pytree: tree None for the common case (no kwargs, no lists), else a small hashable tuple
    (each argument a leaf or a list/tuple of n leaves; it is part of the cache key, so
    ([0, 1], []) and ([0], [1]) never share a decision). Anything deeper goes through pytree.
    """
    if not kwargs:
        for a in args:
            if isinstance(a, (list, tuple)):
                break
        else:
            return list(args), None
    leaves: list = []
    shape: list[Any] = []
    for a in (*args, *kwargs.values()):
        t = type(a)
        if t is list or t is tuple:
            for v in a:
                if isinstance(v, (list, tuple, dict)):
                    return _pytree_flatten(args, kwargs)
            shape.append((t, len(a)))
            leaves.extend(a)
        elif isinstance(a, (list, tuple, dict)):  # a named tuple, a dict: pytree knows them
            return _pytree_flatten(args, kwargs)
        else:
            shape.append(None)
            leaves.append(a)
    return leaves, (len(args), tuple(kwargs), tuple(shape))


def _pytree_flatten(args: tuple, kwargs: dict) -> tuple[list, Any]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return leaves, ("pytree", str(spec), spec)


def unflatten_args(leaves: list, tree: Any) -> tuple[tuple, dict]:
    if tree is None:
        return tuple(leaves), {}
    if type(tree) is not tuple:  # a pytree TreeSpec from a caller that flattened with pytree itself
        return pytree.tree_unflatten(leaves, tree)
    if tree[0] == "pytree":
        return pytree.tree_unflatten(leaves, tree[2])
    n_args, names, shape = tree
    values, i = [], 0
    for kind in shape:
        if kind is None:
            values.append(leaves[i])
            i += 1
        else:
            container, n = kind
            values.append(container(leaves[i : i + n]))
            i += n
    return tuple(values[:n_args]), dict(zip(names, values[n_args:]))


def tree_key(tree: Any) -> Any:
    """The hashable part of `flatten_args`'s tree: the call's shape in a cache key."""
    if type(tree) is not tuple:  # a pytree TreeSpec
        return None if tree is None else str(tree)
    return tree if tree[0] != "pytree" else tree[1]


def float_key(func, tree: Any, i: int, value: float) -> Any:
    """Cache key of a float argument, leaf `i` of a call flattened to `tree` (None: the positional
    arguments as they are): its value where a decision of `func` read it, the class a rule read
    with `OpSchema.arg_class`, or for an argument no decision reads (a pointwise op's scalar) one
    key for every value: a new step size each step reuses the decision."""
    reads = _FLOAT_READS.get(func)
    if reads is None:
        return _UNREAD
    how = reads.get(EVERY, _UNREAD)
    if how is _UNREAD:
        names = _leaf_names(func, tree)
        name = names[i] if i < len(names) else None
        how = reads.get(name, _UNREAD) if name is not None else EXACTLY
        if how is _UNREAD:
            return _UNREAD
    if how is EXACTLY:
        return value if value == value else "nan"  # NaN != NaN would never hit
    return (_CLASS, how(value))


def _leaf_names(func, tree: Any) -> tuple[str | None, ...]:
    """The argument name of each leaf of a call flattened to `tree` (None inside lists or a pytree)."""
    cache_key = (func, tree_key(tree))
    names = _LEAF_NAMES.get(cache_key)
    if names is None:
        arg_names = _binding(func)[0]
        if tree is None:
            names = tuple(arg_names)
        elif type(tree) is not tuple or tree[0] == "pytree":
            names = ()
        else:
            n_args, kw_names, shape = tree
            out: list[str | None] = []
            for j, kind in enumerate(shape):
                name = (arg_names[j] if j < len(arg_names) else None) if j < n_args else kw_names[j - n_args]
                out += [name] if kind is None else [None] * kind[1]
            names = tuple(out)
        _LEAF_NAMES[cache_key] = names
    return names


def _float_reads_keyed(func, schema: OpSchema, algorithm: Any) -> bool:
    """Whether `float_key` already keys on every float argument this decision read, as it read it;
    if not, learn it (the op's next call keys on it: this decision is not cached). A sharded
    algorithm reads its schema when it runs, after the key is built: its floats are keyed exactly."""
    values = schema._arguments()
    reads = {EVERY: EXACTLY} if algorithm is not None else schema.reads
    any_float = any(type(v) is float for v in values.values())
    wanted = {n: how for n, how in reads.items() if (any_float if n == EVERY else type(values.get(n)) is float)}
    if not wanted:
        return True
    known = _FLOAT_READS.setdefault(func, {})
    if known.get(EVERY, _UNREAD) is EXACTLY:
        return True
    keyed = True
    for name, how in wanted.items():
        seen = known.get(name, _UNREAD)
        if seen is EXACTLY or seen is how:
            continue
        known[name] = how if seen is _UNREAD else EXACTLY
        keyed = False
    return keyed


def plain_key(t: torch.Tensor) -> tuple:
    """Cache key of a plain tensor operand (taken as Replicate)."""
    return ("plain", t.shape, t.dtype, t.device.type)


_OUT_NAMES: dict[Any, tuple[str, ...]] = {}


def out_arg_names(func) -> tuple[str, ...]:
    """Names of out= arguments (kwarg-only, written to) of an overload; () for functional ops."""
    names = _OUT_NAMES.get(func)
    if names is None:
        names = _OUT_NAMES[func] = tuple(
            a.name
            for a in func._schema.arguments
            if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
        )
    return names


# ------------------------------------------------------------------ deciding


def make_schema(func, leaves, tree, specs) -> OpSchema:
    args, kwargs = unflatten_args(list(leaves), tree)
    return OpSchema(func, tuple(args), dict(kwargs), tuple(specs))


def meta_outputs(func, leaves, tree) -> tuple[list[TensorMeta], Any] | Exception:
    """Global output metadata from running the op on meta tensors (torch's error if meta can't run it)."""
    metas = [
        torch.empty_strided(a.shape, a.meta.stride, dtype=a.dtype, device="meta") if isinstance(a, TensorSpec) else a
        for a in leaves
    ]
    args, kwargs = unflatten_args(metas, tree)
    if "device" in kwargs and func is aten._to_copy.default:
        # x.to(dtype) inside torch.softmax(x, d, dtype=...) passes device=cpu,
        # which a meta tensor cannot be copied to; the output's metadata does not depend on it.
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    try:
        out = func(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - ops without meta kernels fall back
        return e
    return [
        TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype)
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor)
    ], out


def _writes_self(func) -> bool:
    s = func._schema
    return bool(s.arguments) and s.arguments[0].alias_info is not None and s.arguments[0].alias_info.is_write


def decide(
    func, leaves: Sequence[Any], tree, tensor_pos: Sequence[int], links=None, limit: int | None = None
) -> Decision:
    """Plan `func` on `leaves`, the call's flattened arguments with every tensor operand as its TensorSpec.

    Metadata only: no data, no collectives, no rank needed (explain calls it for any mesh size).
    An op with no rule, or one torch's meta kernels cannot run, gets a fallback Decision;
    what the runtime does with a fallback (warn, or raise in strict mode) is `checked_fallback`'s job.
    """
    specs = tuple(leaves[i] for i in tensor_pos)
    schema = make_schema(func, leaves, tree, specs)
    inplace = _writes_self(func) and bool(tensor_pos) and tensor_pos[0] == 0
    rule = RULES.get(func)
    metas = meta_outputs(func, leaves, tree) if rule is not None else None
    if rule is not None and isinstance(metas, Exception):
        rule(schema)  # a rule names user errors (dim out of range, bad k) that made the meta run fail
    if rule is None or isinstance(metas, Exception):
        plans = tuple(plan(s, (Replicate(),) * s.mesh.ndim, links) for s in specs)
        return Decision(
            func,
            specs,
            plans,
            None,
            None,
            None,
            None,
            fallback=True,
            inplace=_writes_self(func),
            schema=schema,
            replicate_only=func in REPLICATE_ONLY,
            meta_error=metas if isinstance(metas, Exception) else None,
        )
    assert metas is not None  # a rule's meta run returned outputs (its failure returned above)
    out_metas = metas[0]
    rows = rule(schema)
    filt = _inplace_filter(specs) if inplace else None
    out_shapes = [(m.shape, m.dtype.itemsize) for m in out_metas]
    on_purpose = func in REPLICATE_WHEN and REPLICATE_WHEN[func](schema)
    avoid = _state["strict"] and not on_purpose and not replicate_allowed(func)
    ranked = candidates(
        rows,
        specs,
        out_shapes,
        links=links,
        filter_fn=_without_replicating_gathers(rows, specs, filt) if avoid else filt,
        limit=limit,
    )
    if avoid and not ranked:  # strict mode: no candidate but the implicit all-Replicate row's gather
        ranked = candidates(rows, specs, out_shapes, links=links, filter_fn=filt, limit=limit)
    if not ranked:
        raise NoShardingStrategyError(  # a NotImplementedError too, as torch's for a layout its rules do not cover
            f"Operator {schema.op} does not have a sharding strategy registered. shardops: for {specs[0]!r}, the "
            "in-place op would need self in another layout, and an in-place op never changes its tensor's local "
            "shape. Redistribute the tensor first, or use the out-of-place op."
        )
    best = with_plans(ranked[0], specs, links)
    gathers = None
    if on_purpose and (any(p.steps for p in best.plans) or any(r.comm for r in best.rows)):
        gathers = "is replicated on purpose (its only algorithm gathers the sharded dim)"
    elif _replicating_gather(best, specs):
        gathers = "has no sharded strategy for this layout (it would gather a sharded input and run replicated)"
    mesh = specs[0].mesh
    out_specs = tuple(TensorSpec(mesh, pl, m) for pl, m in zip(best.outputs, out_metas))
    in_after = tuple(s.with_placements(pl) for s, pl in zip(specs, best.inputs))
    ctx = AlgoContext(schema, in_after, out_specs, func) if best.algorithm is not None else None
    return Decision(
        func,
        specs,
        best.plans,
        out_specs,
        best.algorithm,
        ctx,
        best,
        inplace=inplace,
        schema=schema,
        candidates=ranked,
        out_metas=out_metas,
        gathers=gathers,
    )


def _replicating_gather(c: Candidate, specs) -> bool:
    """On some mesh dim the candidate gathers a sharded input (Shard -> Replicate or Partial) and
    leaves no output sharded there: the op runs replicated over that mesh dim, as the implicit
    all-Replicate row does (a gather that feeds a sharded output, like a column-parallel matmul's
    weight, is the op's own algorithm)."""
    for i in range(len(specs[0].placements)):
        if any(o[i].is_shard() for o in c.outputs):
            continue
        if any(s.placements[i].is_shard() and not t[i].is_shard() for s, t in zip(specs, c.inputs)):
            return True
    return False


def _without_replicating_gathers(rows, specs, filt):
    """Strict mode's candidate filter: no candidate that gathers a sharded input to run replicated."""
    return lambda c: not _replicating_gather(c, specs) and (filt is None or filt(c))


def decide_for_dispatch(key: tuple, func, leaves: Sequence[Any], tree, tensor_pos: Sequence[int]) -> Decision:
    """`decide`, then what the runtime adds: the fallback's checks and warning, and the cache."""
    decision = decide(func, leaves, tree, tensor_pos)
    if decision.fallback:
        checked_fallback(decision)
        return decision
    if decision.gathers is not None and _state["strict"]:
        if not replicate_allowed(func):
            raise strict_error(decision, decision.gathers)
        return decision  # allowed: decided anew each call (never cached), since the allowance may end
    decision.candidates = []  # explain's list; a cached decision keeps only its choice
    if not caching_decisions() or not _float_reads_keyed(func, decision.schema, decision.algorithm):
        return decision
    if len(_CACHE) >= MAX_DECISIONS:  # bounded: the oldest decision goes (a later call decides it again)
        _CACHE.pop(next(iter(_CACHE)), None)
    _CACHE[key] = decision
    return decision


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


def moved_bytes(d: Decision) -> int:
    """Bytes this rank puts into the decision's input moves."""
    coord = d.in_specs[0].mesh.own_coordinate()
    internal = (
        sum(b for r in d.candidate.rows for _, b in r.comm) if d.candidate is not None else 0
    )  # a gathering algorithm's own
    return int(sum(plan_bytes(s, p, coord) for s, p in zip(d.in_specs, d.plans)) + internal)


def strict_error(d: Decision, how: str) -> ShardingError:
    name = op_name(d.func)
    text = (
        f"{d.schema.name} {how}: strict mode refuses to move {moved_bytes(d)} bytes on this rank for inputs "
        f"{list(d.in_specs)}. Allow it with so.allow_replicate({name!r}) (or `with so.allow_replicate({name!r}):`), "
        "redistribute the inputs yourself, or call so.set_strict(False)."
    )
    if d.replicate_only or not how.startswith("has no sharded strategy"):
        return ShardingError(text)
    # a NotImplementedError too, with torch's phrase first, as torch raises for an op with no strategy
    return NoShardingStrategyError(
        f"Operator {d.schema.op} does not have a sharding strategy registered. shardops: {text}"
    )


def checked_fallback(d: Decision) -> None:
    """A fallback at run time: an error in strict mode or where it would change self's layout, else a warning.

    Inputs all Replicate already: nothing moves, the op runs locally with no warning in either mode."""
    specs = d.in_specs
    if not any(p.steps for p in d.plans):
        return
    # The op has a rule but its meta run failed: torch refuses these arguments (a dtype or shape
    # error). Running it replicated raises torch's own error: no missing strategy to warn about.
    refused = d.meta_error is not None and not isinstance(d.meta_error, NotImplementedError)
    if not refused and _state["strict"] and not replicate_allowed(d.func):
        how = "is replicated on purpose (no sharded algorithm)" if d.replicate_only else "has no sharded strategy"
        raise strict_error(d, how)
    if d.inplace and any(not p.is_replicate() and not p.is_partial() for p in specs[0].placements):
        meta_error = d.meta_error
        if meta_error is not None and not isinstance(meta_error, NotImplementedError):
            # The op has a rule but torch refused the call itself (a dtype or shape error): say that, not "layout".
            raise ShardingError(
                f"{d.schema.name} on {list(specs)}: torch refuses this call: {meta_error}"
            ) from meta_error
        raise NoShardingStrategyError(  # a NotImplementedError too, as torch's at this point
            f"Operator {d.schema.op} does not have a sharding strategy registered. shardops: for {specs[0]!r}, an "
            "in-place op with no sharded strategy would change self's layout. Redistribute self to Replicate first, "
            "or use the out-of-place op."
        )
    if not refused:
        warn_fallback(d)


def warn_fallback(d: Decision) -> None:
    if d.replicate_only or replicate_allowed(d.func):
        return
    moved = moved_bytes(d)
    warnings.warn(
        f"shardops: {d.func} has no sharded strategy; replicated its inputs and ran locally ({moved} bytes moved on "
        "this rank). so.set_strict(True) makes this an error.",
        FallbackWarning,
        stacklevel=5,
    )


# ------------------------------------------------------------------ running


def move_inputs(d: Decision, leaves: list, tensor_pos: Sequence[int]) -> None:
    """Redistribute the local operands in `leaves` to the decision's input layouts (self in place for in-place ops)."""
    for k in d.moves:
        i = tensor_pos[k]
        new = execute(leaves[i], d.in_specs[k], d.plans[k])
        if d.inplace and k == 0:  # resolve self's pending partial in place, same local shape
            leaves[i].copy_(new)
        else:
            leaves[i] = new


def compute(d: Decision, leaves: list, tree) -> Any:
    """The local kernel, or the op's sharded algorithm, on the moved local operands."""
    if d.algorithm is not None:  # sharded algorithms read values, never lazy conj/neg bits
        leaves = [materialize_lazy_bits(t) if isinstance(t, torch.Tensor) else t for t in leaves]
    args, kwargs = unflatten_args(leaves, tree)
    if d.algorithm is not None:
        return d.algorithm(d.context, *args, **kwargs)
    return d.func(*args, **kwargs)


def output_specs(d: Decision, out_leaves: Sequence[Any]) -> tuple[TensorSpec, ...]:
    """The outputs' specs: the decision's, or for a fallback Replicate with the shapes that came out."""
    if d.out_specs is not None:
        return d.out_specs
    mesh = d.in_specs[0].mesh
    return tuple(
        TensorSpec(mesh, (Replicate(),) * mesh.ndim, TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype))
        for t in out_leaves
        if isinstance(t, torch.Tensor)
    )


# ------------------------------------------------------------------ planning only (explain, verify)


def plan_op(func, args: tuple, kwargs: dict | None = None, links=None, limit: int | None = None) -> Decision:
    """`decide` for a call whose tensor operands are TensorSpecs (nested lists too).

    The Decision carries `candidates` (the best `limit`, cheapest first; see planner.choice.candidates),
    `out_metas`, `fallback` and `replicate_only`.
    """
    flat, tree = flatten_args(tuple(args), kwargs or {})
    tensor_pos = [i for i, a in enumerate(flat) if isinstance(a, TensorSpec)]
    return decide(func, flat, tree, tensor_pos, links=links, limit=limit)


PlanReport = Decision  # the name explain was written against
