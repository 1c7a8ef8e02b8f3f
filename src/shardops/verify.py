"""`shardops verify`: a differential checker of every registered op against single-device torch.

For every op the registry knows (aten overloads in RULES, REPLICATE_ONLY and
DECOMPOSITIONS, and the torch-level callables in TORCH_FUNCTIONS), discovered
at run time so that an op added later is checked without anyone listing it:

    samples (verify_samples)  x  dtypes  x  meshes (4,), (2,2), (2,2,2)
      x  input layouts: one placement per mesh dim for every tensor operand,
         Shard(d), Replicate and the pending kinds P(sum/avg/max/min/product), NormP(2)

Each case runs in `shardops.run` (threads world): the op is called directly on
DTensors, `out.full_tensor()` is compared with the op on the full tensors, and
where the inputs are float and torch can differentiate the op, the input
gradients of `sum(out * g)` (g fixed and random) are compared too.

Partial inputs are built so that a wrong rule cannot pass by luck:

    P(sum)      rank k holds x*w_k + noise_k (dyadic weights of both signs, noise summing to 0)
    P(avg)      rank k holds x + noise_k (noise summing to 0)
    P(max/min)  per element one rank holds x, the others strictly smaller/larger values
    P(product)  per element one rank holds x / (product of the others), the others hold +-2^e
    NormP(2)    rank k holds |x| * sqrt(w_k), w_k > 0 summing to 1

Sample values sit on a dyadic grid, so these splits are exact in every dtype
and the reference input is exactly the value the pieces resolve to.

The default run is a seeded sample (a budget of cases per op and mesh that
covers every placement kind of the first operand); `full=True` runs every
layout combination of every sample and dtype.
"""
from __future__ import annotations

import itertools
import json
import math
import random
import time
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from . import verify_samples as samples
from .verify_samples import resolve_pending, split_pending
from .dispatch import core, registry
from .errors import CollectiveError, ShardingError
from .mesh import DeviceMesh
from .placements import NormPartial, Partial, Placement, Replicate, Shard, dim_positions
from .spec import TensorMeta, TensorSpec, contiguous_stride
from .tensor import DTensor
from .world import run

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.bool)
MESHES = {"4": (4,), "2x2": (2, 2), "2x2x2": (2, 2, 2)}
# NOTE: errors are |got - ref| / (1 + |ref|): relative for large values, absolute near 0.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}
# Cases per op and mesh in the default (sampled) run. The coverage sweep (see sampled_cases) starts
# at a different placement kind on each mesh, so over the three meshes every kind of the main operand
# is forced at least once; the whole registry (~350 entries) then runs in about 2 minutes of CPU.
DEFAULT_BUDGET = {1: 8, 2: 6, 3: 4}
TORCH_FUNCTION_BUDGET_SHARE = 0.5  # torch-level entries mostly re-run the aten ops they wrap
SAMPLES_PER_DTYPE = 3
CASE_TIMEOUT = 30.0  # seconds a rank waits in a collective before the case counts as hung
R = Replicate()
PARTIAL_KINDS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"), NormPartial(2))


# ------------------------------------------------------------------ targets (discovered from the registry)


@dataclass(frozen=True)
class Target:
    """One thing verify calls on DTensors: an aten overload or a torch-level callable."""

    name: str  # aten.sum.dim_IntList, torch.cumsum, Tensor.cumsum
    group: str  # the summary row: aten.sum, torch.cumsum
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    generator: Callable[..., Any] | None
    kind: str  # rule | replicate | decomposition | torch_function


def _writes_self(op) -> bool:
    args = op._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _aten_target(op, kind: str) -> Target:
    return Target(str(op), str(op).rsplit(".", 1)[0], op, samples.reference_for(op) or op, samples.generator_for(op), kind)


def callable_name(fn) -> str:
    """A readable, stable name for a torch-level callable: torch.cumsum, Tensor.cumsum, F.rms_norm."""
    name = getattr(fn, "__name__", repr(fn))
    owner = getattr(fn, "__objclass__", None)
    qual = getattr(fn, "__qualname__", name)
    module = getattr(fn, "__module__", None) or ""
    if (owner is not None and "Tensor" in owner.__name__) or qual.startswith("Tensor."):
        return f"Tensor.{name}"
    if module.startswith("torch.nn.functional"):
        return f"F.{name}"
    for prefix in ("linalg", "special", "fft"):  # torch._C._linalg.linalg_vector_norm -> torch.linalg.vector_norm
        if module.startswith(f"torch._C._{prefix}") or name.startswith(f"{prefix}_"):
            return f"torch.{prefix}.{name.removeprefix(prefix + '_')}"
    if module.startswith("torch._C._nn"):
        return f"torch._C._nn.{name}"
    return f"torch.{name}"


RANDOM_SKIP = "random ops (layout-invariant draws, not torch's values: tests/test_random.py)"


def _is_random(fn) -> bool:
    from .ops.random import RANDOM_ENTRIES

    return fn in RANDOM_ENTRIES or (isinstance(fn, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in fn.tags)


def discover() -> tuple[list[Target], dict[str, int]]:
    """Every registered op, one Target per overload (out= and in-place variants left out)."""
    skipped: Counter[str] = Counter()
    found: dict[str, Target] = {}
    sources = [(registry.RULES, "rule"), (registry.REPLICATE_ONLY, "replicate"), (registry.DECOMPOSITIONS, "decomposition")]
    for ops, kind in sources:
        for op in list(ops):
            if not isinstance(op, torch._ops.OpOverload):
                continue
            if core.out_arg_names(op):
                skipped["out= variants"] += 1
            elif _is_random(op):
                skipped[RANDOM_SKIP] += 1
            elif _writes_self(op):
                skipped["in-place variants"] += 1
            elif str(op) not in found:
                found[str(op)] = _aten_target(op, kind)
    for fn in list(registry.TORCH_FUNCTIONS):
        if _is_random(fn):
            skipped[RANDOM_SKIP] += 1
            continue
        if callable_name(fn).startswith("Tensor.") and callable_name(fn).endswith("_"):  # Tensor.fill_ & co
            skipped["in-place variants"] += 1
            continue
        if isinstance(fn, torch._ops.OpOverload):  # an aten op intercepted before dispatch: verify calls it as such
            found.setdefault(str(fn), _aten_target(fn, "torch_function"))
            continue
        name = callable_name(fn)
        while name in found:
            name += "'"
        found[name] = Target(name, name, fn, fn, samples.torch_generator(fn), "torch_function")
    return sorted(found.values(), key=lambda t: t.name), dict(skipped)


def select(targets: Sequence[Target], filters: Sequence[str] | None) -> list[Target]:
    """Targets named exactly by a filter, else those whose name contains it."""
    if not filters:
        return list(targets)
    chosen = []
    for f in filters:
        exact = [t for t in targets if t.name == f]
        chosen += exact or [t for t in targets if f in t.name]
    seen: set[str] = set()
    return [t for t in chosen if not (t.name in seen or seen.add(t.name))]


# ------------------------------------------------------------------ prepared samples (reference computed once)


@dataclass
class Prepared:
    """A sample in one dtype that single-device torch accepts, with its reference results."""

    sample: samples.Sample
    dtype: torch.dtype
    tensors: list[torch.Tensor]  # tensor leaves of (args, kwargs), in pytree order
    tree: Any
    leaves: list[Any]
    ref_out: list[Any]
    grad_out: list[torch.Tensor | None]  # g per output leaf (None: not differentiated)
    ref_grads: list[torch.Tensor | None] | None  # per tensor leaf; None: no gradient check

    @property
    def label(self) -> str:
        shapes = ", ".join(_short(t) for t in self.tensors)
        statics = [repr(v) for v in self.leaves if not isinstance(v, torch.Tensor)]
        return f"{shapes}" + (f"; {', '.join(statics)}" if statics else "")


def _short(t: torch.Tensor) -> str:
    return f"{_dtype_name(t.dtype)}{list(t.shape)}"


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int64: "i64",
            torch.int32: "i32", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128"}.get(dtype, str(dtype))


def _call(fn, tree, leaves):
    args, kwargs = pytree.tree_unflatten(leaves, tree)
    return fn(*args, **kwargs)


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def reference(target: Target, tree, leaves: list[Any], grad_out: list[torch.Tensor | None] | None, g: torch.Generator | None):
    """The op on full tensors: output leaves, the g used per output, and input gradients of sum(out * g)."""
    with torch.no_grad():
        out = pytree.tree_leaves(_call(target.reference, tree, leaves))
    try:
        grad_out, grads = _reference_grads(target, tree, leaves, grad_out, g)
    except Exception:  # noqa: BLE001 - torch cannot differentiate this op: values only
        grad_out, grads = [None] * len(out), None
    return out, grad_out, grads


def _reference_grads(target: Target, tree, leaves: list[Any], grad_out, g):
    """g per output (drawn now unless given) and d sum(out * g) / d input, one per tensor leaf (None: no check)."""
    inputs = [x.detach().clone().requires_grad_(True) if _differentiable(x) else x for x in leaves]
    with torch.enable_grad():
        got = pytree.tree_leaves(_call(target.reference, tree, inputs))
    if grad_out is None:
        grad_out = [samples.make_tensor(o.shape, o.dtype, g) if _differentiable(o) and o.requires_grad else None for o in got]
    terms = [(o * w).sum() for o, w in zip(got, grad_out) if w is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not terms or not wrt:
        return [None] * len(got), None
    grads = iter(torch.autograd.grad(sum(terms), wrt, allow_unused=True))
    return grad_out, [next(grads) if x.requires_grad else None for x in inputs if isinstance(x, torch.Tensor)]


def prepare(target: Target, seed: int) -> tuple[list[Prepared], str | None]:
    """Every (sample, dtype) the reference accepts; the first rejection's reason if none is accepted."""
    prepared, reason = [], None
    if target.generator is None:
        return [], "no sample generator matches this op (add a row to verify_samples.SAMPLES)"
    for dtype in DTYPES:
        g = torch.Generator().manual_seed(_key(target.name, dtype, seed))
        for k in range(SAMPLES_PER_DTYPE):
            try:
                s = target.generator(target.fn, dtype, g, k)
                if s is None:
                    continue
                leaves, tree = pytree.tree_flatten((s.args, s.kwargs))
                out, grad_out, grads = reference(target, tree, leaves, None, g)
            except Exception as e:  # noqa: BLE001 - torch rejects this sample (dtype, domain): not a failure
                reason = reason or f"torch rejects every sample ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                continue
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            if not s.check_values or not any(t.is_floating_point() for t in tensors) or target.reference is not target.fn:
                grads = None  # a hand-written reference stands in for an op torch cannot run, let alone differentiate
            prepared.append(Prepared(s, dtype, tensors, tree, leaves, out, grad_out, grads))
    return prepared, (None if prepared else reason or "the generator gave no sample for any dtype")


def _key(*parts: Any) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


# ------------------------------------------------------------------ layouts


def alphabet(t: torch.Tensor) -> list[Placement]:
    """Every placement one mesh dim may give this operand."""
    shards = [Shard(d) for d in range(t.ndim)]
    if t.dtype == torch.bool:
        kinds = [Partial("max"), Partial("min")]
    elif t.is_complex():
        kinds = [Partial("sum")]
    elif not t.is_floating_point():
        kinds = [Partial("sum"), Partial("max"), Partial("min"), Partial("product")]
    else:
        kinds = list(PARTIAL_KINDS)
    return [R] + shards + kinds


def main_operand(tensors: Sequence[torch.Tensor]) -> int:
    """The operand the layout sweep is about: the most dims, then float over int/bool, then the first."""
    return max(range(len(tensors)), key=lambda i: (tensors[i].ndim, tensors[i].is_floating_point(), -i))


def _aligned(p: Placement, main: torch.Tensor, t: torch.Tensor) -> Placement:
    """The placement of operand t that matches `p` on the main operand (same tensor dim, same pending kind)."""
    if t is main:
        return p
    if p.is_shard():
        size = main.shape[p.dim]
        for d in (p.dim - (main.ndim - t.ndim), p.dim):
            if 0 <= d < t.ndim and t.shape[d] == size:
                return Shard(d)
        return R
    if p.is_partial() and t.is_floating_point() == main.is_floating_point() and p in alphabet(t):
        return p
    return R


def aligned_column(p: Placement, tensors: Sequence[torch.Tensor]) -> tuple[Placement, ...]:
    """One mesh dim's placements: `p` on the main operand, the others aligned to it."""
    main = tensors[main_operand(tensors)]
    return tuple(_aligned(p, main, t) for t in tensors)


def coverage_slots(prepared: Sequence[Prepared]) -> list[Placement]:
    """Every placement kind the main operands can take: pending kinds first (the bug-prone ones), shards, Replicate."""
    found: set[Placement] = set()
    for prep in prepared:
        found.update(alphabet(prep.tensors[main_operand(prep.tensors)]))
    shards = sorted((p for p in found if p.is_shard()), key=lambda p: p.dim)
    return [p for p in PARTIAL_KINDS if p in found] + shards + [R]


def _pending_kinds_ok(layouts: Sequence[Sequence[Placement]], tensors: Sequence[torch.Tensor]) -> bool:
    """At most one pending kind per operand: mixed kinds have no order-free meaning. NormP on several
    mesh dims only in float64: its nested square roots round differently in each resolution order;
    and none in half precision, whose resolved norm is not exact on the sample grid."""
    for pl, t in zip(layouts, tensors):
        if len({p for p in pl if p.is_partial()}) > 1:
            return False
        if sum(isinstance(p, NormPartial) for p in pl) > 1:
            # NOTE: known issue: two resolutions of one tensor pending on several mesh dims may take
            # different plans and round differently (ops whose backward compares values, e.g.
            # median, then see a mismatch); a canonical resolution order is the fix.
            return False
        if t.dtype in (torch.bfloat16, torch.float16) and any(isinstance(p, NormPartial) for p in pl):
            return False  # a half-precision sqrt(sum of squares) is not exact on the sample grid
    return True


def _transpose(columns: Sequence[Sequence[Placement]]) -> tuple[tuple[Placement, ...], ...]:
    """Per-mesh-dim columns -> per-operand placement tuples."""
    return tuple(zip(*columns))


@dataclass(frozen=True)
class Case:
    index: int
    prepared: int  # index into the target's prepared samples
    layouts: tuple[tuple[Placement, ...], ...]  # per tensor operand, one placement per mesh dim


def all_cases(prepared: Sequence[Prepared], mesh_shape: tuple[int, ...]) -> Iterator[Case]:
    """--full: every layout combination of every prepared sample."""
    i = 0
    for si, prep in enumerate(prepared):
        columns = list(itertools.product(*[alphabet(t) for t in prep.tensors]))
        for combo in itertools.product(columns, repeat=len(mesh_shape)):
            layouts = _transpose(combo)
            if _pending_kinds_ok(layouts, prep.tensors):
                yield Case(i, si, layouts)
                i += 1


def sampled_cases(prepared: Sequence[Prepared], mesh_shape: tuple[int, ...], budget: int, seed: int) -> list[Case]:
    """A seeded sample. Case j < len(slots) puts placement kind j on the main operand of one mesh dim (the
    others aligned to it), so every kind is covered; the other mesh dims, and later cases, draw aligned or
    independent random columns."""
    rng = random.Random(seed)
    ndim = len(mesh_shape)
    order = list(range(len(prepared)))
    rng.shuffle(order)
    slots = coverage_slots(prepared)
    start = sum(DEFAULT_BUDGET.get(d, 0) for d in range(1, ndim))  # each mesh sweeps on where the smaller ones stopped
    slots = slots[start % len(slots):] + slots[: start % len(slots)]
    cases: list[Case] = []
    seen: set = set()
    rejected = 0
    while len(cases) < budget and rejected < budget * 20:
        j = len(cases)
        slot = slots[j] if j < len(slots) else None
        fits = [si for si in order if slot is None or slot in alphabet(prepared[si].tensors[main_operand(prepared[si].tensors)])]
        si = fits[(j + rejected) % len(fits)]
        tensors = prepared[si].tensors
        columns = [_random_column(tensors, rng) for _ in range(ndim)]
        if slot is not None:
            columns[j % ndim] = aligned_column(slot, tensors)
        layouts = _transpose(columns)
        if not _pending_kinds_ok(layouts, tensors) or (si, layouts) in seen:
            rejected += 1
            continue
        seen.add((si, layouts))
        cases.append(Case(len(cases), si, layouts))
    return cases


def _random_column(tensors: Sequence[torch.Tensor], rng: random.Random) -> tuple[Placement, ...]:
    """Mostly an aligned column of a random kind (where rules keep data in place), sometimes independent picks."""
    if rng.random() < 0.6:
        main = tensors[main_operand(tensors)]
        return aligned_column(rng.choice(alphabet(main)), tensors)
    return tuple(rng.choice(alphabet(t)) for t in tensors)


def describe_layouts(prep: Prepared, layouts) -> str:
    return " ".join(f"{_short(t)}:{','.join(map(repr, pl))}" for t, pl in zip(prep.tensors, layouts))


# ------------------------------------------------------------------ building one case


@dataclass
class Built:
    """Everything a case needs on the ranks, made once in the main thread."""

    case: Case
    target: Target
    prep: Prepared
    specs: list[TensorSpec]
    locals: dict[int, list[torch.Tensor]]  # rank -> local tensor per operand
    ref_inputs: list[torch.Tensor]  # what the operands resolve to (the reference's inputs)
    ref_out: list[Any]
    ref_grads: list[torch.Tensor | None] | None
    grad_case: bool
    tol: float


def _local_piece(full: torch.Tensor, pieces, placements, mesh: DeviceMesh, coord) -> torch.Tensor:
    pending = [i for i, p in enumerate(placements) if p.is_partial()]
    x = full
    if pending:
        flat = 0
        for i in pending:
            flat = flat * mesh.shape[i] + coord[i]
        x = pieces[flat]
    for d in range(full.ndim):
        pos = dim_positions(full.shape[d], d, mesh.shape, coord, placements)
        x = x.narrow(d, pos.start if len(pos) else 0, len(pos))
    return x.contiguous().clone()


def build(target: Target, prep: Prepared, case: Case, mesh: DeviceMesh, seed: int) -> Built:
    g = torch.Generator().manual_seed(_key(target.name, mesh.shape, case.index, seed))
    specs, per_operand, ref_inputs = [], [], []
    for t, placements in zip(prep.tensors, case.layouts):
        pending = [p for p in placements if p.is_partial()]
        m = math.prod(n for n, p in zip(mesh.shape, placements) if p.is_partial())
        pieces = split_pending(t, pending[0], m, g) if pending else None
        ref_inputs.append(resolve_pending(pieces, pending[0]) if pending else t)
        specs.append(TensorSpec(mesh, tuple(placements), TensorMeta(tuple(t.shape), contiguous_stride(t.shape), t.dtype)))
        per_operand.append((t, pieces, placements))
    ref_out, ref_grads = prep.ref_out, prep.ref_grads
    if any(p.is_partial() for pl in case.layouts for p in pl):
        # the reference sees exactly what the pieces resolve to (NormP gives |x|; a zero's sign may flip)
        leaves = _replace_tensors(prep.leaves, ref_inputs)
        ref_out, _, ref_grads = reference(target, prep.tree, leaves, prep.grad_out, None)
        ref_grads = ref_grads if prep.ref_grads is not None else None
    locals_ = {}
    for rank in range(mesh.size()):
        coord = mesh.coordinate_of(rank)
        locals_[rank] = [_local_piece(t, pieces, pl, mesh, coord) for t, pieces, pl in per_operand]
    tol = TOLERANCE.get(prep.dtype, 1e-5)
    return Built(case, target, prep, specs, locals_, ref_inputs, ref_out, ref_grads, ref_grads is not None, tol)


def _replace_tensors(leaves: list[Any], tensors: Sequence[torch.Tensor]) -> list[Any]:
    it = iter(tensors)
    return [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]


# ------------------------------------------------------------------ comparing


def compare(got: Any, ref: Any, tol: float) -> tuple[float, str | None]:
    """(error, problem or None). Floats: max |got-ref|/(1+|ref|), NaN/inf where torch has them; others exact."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return math.inf, f"expected a tensor, got {type(got).__name__}"
        if tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
            return math.inf, f"got {_short(got)}, torch gives {_short(ref)}"
        if ref.numel() == 0:
            return 0.0, None
        if not (ref.is_floating_point() or ref.is_complex()):
            bad = int((got != ref).sum())
            return (0.0, None) if bad == 0 else (math.inf, f"{bad} of {ref.numel()} elements differ (exact for {ref.dtype})")
        return _float_error(got.detach(), ref.detach(), tol)
    if isinstance(ref, (bool, int, float, complex)):
        return compare(torch.tensor(got), torch.tensor(ref), tol) if isinstance(got, (bool, int, float, complex)) else (math.inf, f"got {got!r}")
    return (0.0, None) if got == ref else (math.inf, f"got {got!r}, torch gives {ref!r}")


def _float_error(got: torch.Tensor, ref: torch.Tensor, tol: float) -> tuple[float, str | None]:
    wide = torch.complex128 if ref.is_complex() else torch.float64
    a, b = got.to(wide), ref.to(wide)
    if not torch.equal(a.isnan(), b.isnan()):
        return math.inf, "NaN where torch has none (or the reverse)"
    inf = b.isinf()
    if not torch.equal(a[inf], b[inf]) or bool(a[~inf].isinf().any()):
        return math.inf, "infinities differ"
    finite = ~(b.isnan() | inf)
    if not bool(finite.any()):
        return 0.0, None
    err = float(((a - b).abs() / (1 + b.abs()))[finite].max())
    return err, (None if err <= tol else f"max error {err:.2e} > tolerance {tol:.0e}")


def _tie_aware(got: list[Any], ref: list[Any], inputs: list[torch.Tensor], dim: int, which: Sequence[int]) -> list[Any]:
    """sort/topk & co may order equal values differently: compare index outputs by the values they pick."""
    x = inputs[0]
    out = []
    for k, (gv, rv) in enumerate(zip(got, ref)):
        if k in which and isinstance(gv, torch.Tensor) and gv.shape == rv.shape and gv.dtype == rv.dtype and x.ndim:
            d = dim % x.ndim
            pick = lambda idx: x.take_along_dim(idx if idx.ndim == x.ndim else idx.unsqueeze(d), d)  # noqa: E731
            in_range = bool(((gv >= 0) & (gv < max(x.shape[d], 1))).all())
            out.append((pick(gv) if in_range else gv, pick(rv)))
        else:
            out.append((gv, rv))
    return out


# ------------------------------------------------------------------ running on the ranks


@dataclass
class Outcome:
    error: float = 0.0
    grad_error: float | None = None
    problem: str | None = None
    out_placements: str = ""


class _CaseRaised(Exception):
    """A rank raised inside a case; the rank's error is in the shared `errors` dict of run_cases."""


def _run_case(b: Built, rank: int) -> Outcome:
    mesh_leaves = []
    wants_grad = b.grad_case
    for spec, local in zip(b.specs, b.locals[rank]):
        mesh_leaves.append(DTensor._make(local, spec, requires_grad=wants_grad and _differentiable(local)))
    leaves = _replace_tensors(b.prep.leaves, mesh_leaves)
    with torch.set_grad_enabled(wants_grad):
        out = pytree.tree_leaves(_call(b.target.fn, b.prep.tree, leaves))
        full = [o.full_tensor() if isinstance(o, DTensor) else o for o in out]
    placements = " ".join("[" + ",".join(map(repr, o.placements)) + "]" for o in out if isinstance(o, DTensor))
    result = Outcome(out_placements=placements)
    if not b.prep.sample.check_values:  # random or uninitialised values: shapes and dtypes only
        blank = lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
        result.error, result.problem = _worst([(blank(f), blank(r)) for f, r in zip(full, b.ref_out)], b.tol, "output")
        return result
    pairs = list(zip(full, b.ref_out)) if len(full) == len(b.ref_out) else [(full, b.ref_out)]
    if b.prep.sample.tie_outputs and len(full) == len(b.ref_out):
        pairs = _tie_aware(full, b.ref_out, b.ref_inputs, b.prep.sample.tie_dim, b.prep.sample.tie_outputs)
    result.error, result.problem = _worst(pairs, b.tol, "output")
    if wants_grad:
        result.grad_error, problem = _check_grads(b, full, mesh_leaves)
        result.problem = result.problem or problem
    return result


def _worst(pairs, tol: float, what: str) -> tuple[float, str | None]:
    worst, problem = 0.0, None
    if not pairs and what:
        return 0.0, None
    for k, (got, ref) in enumerate(pairs):
        if isinstance(got, list):
            return math.inf, f"{what}: {len(got)} results, torch gives {len(ref)}"
        err, p = compare(got, ref, tol)
        worst = max(worst, err)
        if p and problem is None:
            problem = f"{what} {k}: {p}"
    return worst, problem


def _check_grads(b: Built, full: list[Any], leaves: list[DTensor]) -> tuple[float, str | None]:
    terms = [(f * w).sum() for f, w in zip(full, b.prep.grad_out) if w is not None]
    wrt = [x for x in leaves if x.requires_grad]
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in terms):
        return math.inf, "gradient: the sharded output does not require grad, torch's does"
    grads = iter(torch.autograd.grad(sum(terms), wrt, allow_unused=True))
    got = [next(grads) if x.requires_grad else None for x in leaves]
    pairs = []
    with torch.no_grad():
        for gv, rv, x in zip(got, b.ref_grads, leaves):
            if not x.requires_grad:
                continue
            gv = gv.full_tensor() if isinstance(gv, DTensor) else gv
            rv = torch.zeros(x.shape, dtype=x.dtype) if rv is None else rv
            pairs.append((torch.zeros_like(rv) if gv is None else gv, rv))
    return _worst(pairs, b.tol, "gradient")


def _rank_loop(todo: Sequence[tuple[int, Built]], results: dict, errors: dict) -> None:
    from .world import current_comm

    rank = current_comm().rank
    for index, b in todo:
        try:
            results[(index, rank)] = _run_case(b, rank)
        except Exception as e:  # noqa: BLE001 - reported as the case's failure
            errors[rank] = (index, e)
            raise _CaseRaised() from e


def run_cases(built: Sequence[Built], world_size: int) -> list[Outcome]:
    """Run the cases in as few so.run calls as possible; a case that raises is recorded and the rest go on.

    NOTE: collectives span sub-groups, so a rank may run ahead of ranks it shares no group with: when a
    case raises, cases other ranks were aborted in are run again, the failing one is not.
    """
    results: dict[tuple[int, int], Outcome] = {}
    failed: dict[int, Outcome] = {}
    done = lambda i: all((i, r) in results for r in range(world_size))  # noqa: E731
    while True:
        todo = [(i, b) for i, b in enumerate(built) if i not in failed and not done(i)]
        if not todo:
            break
        errors: dict[int, tuple[int, BaseException]] = {}
        try:
            run(_rank_loop, world_size, todo, results, errors, timeout=CASE_TIMEOUT)
        except _CaseRaised:
            index, error = _root_cause(errors)
            failed[index] = Outcome(math.inf, None, f"raised {type(error).__name__}: {_first_line(error)}")
    return [failed.get(i) or _merge([results[(i, r)] for r in range(world_size)]) for i in range(len(built))]


def _root_cause(errors: dict[int, tuple[int, BaseException]]) -> tuple[int, BaseException]:
    """The earliest case that raised on its own (not a rank released because another one failed)."""
    echo = lambda e: isinstance(e, CollectiveError) and "aborted" in str(e)  # noqa: E731
    own = [ie for ie in errors.values() if not echo(ie[1])] or list(errors.values())
    return min(own, key=lambda ie: ie[0])


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _merge(per_rank: list[Outcome]) -> Outcome:
    worst = max(per_rank, key=lambda o: (o.problem is not None, o.error))
    grads = [o.grad_error for o in per_rank if o.grad_error is not None]
    return Outcome(worst.error, max(grads) if grads else None, worst.problem, per_rank[0].out_placements)


# ------------------------------------------------------------------ the report


@dataclass
class Failure:
    target: str
    mesh: str
    case: int
    layouts: str
    sample: str
    problem: str
    out_placements: str
    repro: str

    def __str__(self) -> str:
        out = f" -> {self.out_placements}" if self.out_placements else ""
        return f"FAIL {self.target} mesh {self.mesh} case {self.case}: {self.layouts}{out}\n     {self.problem}\n     repro: {self.repro}"


@dataclass
class OpRow:
    group: str
    overloads: list[str] = field(default_factory=list)
    cases: int = 0
    passed: int = 0
    failed: int = 0
    grad_cases: int = 0
    worst: float = 0.0
    no_samples: list[str] = field(default_factory=list)  # "overload: reason"
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if self.failed:
            return "FAIL"
        if self.cases == 0:
            return "no samples"
        return "ok" if not self.no_samples else "partial"  # some overloads have no samples (listed below the table)


@dataclass
class VerifyReport:
    rows: dict[str, OpRow]
    failures: list[Failure]
    skipped: dict[str, int]
    settings: dict[str, Any]
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def cases(self) -> int:
        return sum(r.cases for r in self.rows.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "settings": self.settings,
            "elapsed_s": round(self.elapsed, 2),
            "cases": self.cases,
            "skipped": self.skipped,
            "ops": [
                {"op": r.group, "overloads": r.overloads, "cases": r.cases, "passed": r.passed, "failed": r.failed,
                 "grad_cases": r.grad_cases, "worst_error": r.worst if math.isfinite(r.worst) else "inf",
                 "no_samples": r.no_samples, "status": r.status, "seconds": round(r.seconds, 3)}
                for r in self.rows.values()
            ],
            "failures": [f.__dict__ for f in self.failures],
        }


def repro_line(target: str, mesh: str, case: int, settings: dict[str, Any]) -> str:
    extra = ""
    if settings.get("full"):
        extra += " --full"
    elif settings.get("budget") is not None:
        extra += f" --budget {settings['budget']}"
    if settings.get("seed"):
        extra += f" --seed {settings['seed']}"
    return f"shardops verify --op {target} --mesh {mesh} --case {case}{extra}"


# ------------------------------------------------------------------ driving it


def parse_mesh(text: str | Sequence[int]) -> tuple[str, tuple[int, ...]]:
    if not isinstance(text, str):
        shape = tuple(int(s) for s in text)
        return "x".join(map(str, shape)), shape
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise ShardingError(f"verify: mesh {text!r} is not like 4, 2x2 or 2x2x2") from None
    if not shape or any(s < 1 for s in shape):
        raise ShardingError(f"verify: mesh {text!r} needs positive sizes, like 4, 2x2 or 2x2x2")
    return text, shape


def _budget_for(target: Target, mesh_shape, budget: int | None) -> int:
    base = budget if budget is not None else DEFAULT_BUDGET.get(len(mesh_shape), 6)
    if target.kind == "torch_function" and budget is None:
        return max(2, int(base * TORCH_FUNCTION_BUDGET_SHARE))
    return base


def plan_cases(target: Target, prepared, mesh_name: str, mesh_shape, full: bool, budget: int | None, seed: int) -> Iterable[Case]:
    if not prepared:
        return []
    if full:
        return all_cases(prepared, mesh_shape)
    return sampled_cases(prepared, mesh_shape, _budget_for(target, mesh_shape, budget), _key(target.name, mesh_name, seed))


def verify(
    ops: str | Sequence[str] | None = None,
    meshes: Sequence[str | Sequence[int]] | None = None,
    *,
    full: bool = False,
    budget: int | None = None,
    seed: int = 0,
    case: int | None = None,
    json_path: str | None = None,
    progress: bool = True,
    console: Any = None,
) -> VerifyReport:
    """Check registered ops against single-device torch; see the module docstring. Prints as it goes."""
    from rich.console import Console

    console = console or Console()
    filters = [ops] if isinstance(ops, str) else list(ops or [])
    mesh_list = [parse_mesh(m) for m in (meshes or list(MESHES))]
    targets_all, skipped = discover()
    targets = select(targets_all, filters)
    if filters and not targets:
        raise ShardingError(f"verify: no registered op matches {filters}; `shardops verify --list` shows them")
    if case is not None and (len(targets) != 1 or len(mesh_list) != 1):
        raise ShardingError("verify: --case needs exactly one op (--op NAME) and one mesh (--mesh ...)")
    settings = {"ops": filters, "meshes": [m for m, _ in mesh_list], "full": full, "budget": budget, "seed": seed, "case": case}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core.clear_cache()  # decisions cached before a rule changed (tests patch rules) must not be reused
        try:
            report = _verify_targets(targets, mesh_list, settings, console, progress)
        finally:
            core.clear_cache()
    report.skipped = skipped
    report.elapsed = time.perf_counter() - t0
    print_report(report, console)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report.to_dict(), f, indent=1, default=str)
    return report


def _verify_targets(targets, mesh_list, settings, console, progress) -> VerifyReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    rows: dict[str, OpRow] = {}
    failures: list[Failure] = []
    plans = []
    for t in targets:
        prepared, reason = prepare(t, settings["seed"])
        row = rows.setdefault(t.group, OpRow(t.group))
        row.overloads.append(t.name)
        if not prepared:
            row.no_samples.append(f"{t.name}: {reason}")
        for mesh_name, shape in mesh_list:
            cases = list(plan_cases(t, prepared, mesh_name, shape, settings["full"], settings["budget"], settings["seed"]))
            if settings["case"] is not None:
                if not 0 <= settings["case"] < len(cases):
                    raise ShardingError(f"verify: {t.name} on mesh {mesh_name} has cases 0..{len(cases) - 1}, not {settings['case']}")
                cases = [cases[settings["case"]]]
            plans.append((t, prepared, mesh_name, shape, cases))
    total = sum(len(p[-1]) for p in plans)
    mode = "every layout combination (--full)" if settings["full"] else "a seeded sample"
    console.print(f"verify: {total} cases over {len(targets)} registered ops on meshes {', '.join(settings['meshes'])}: {mode}", highlight=False)
    columns = [TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not progress, transient=True) as bar:
        task = bar.add_task("verify", total=total)
        for t, prepared, mesh_name, shape, cases in plans:
            bar.update(task, description=f"{t.name} [{mesh_name}]")
            t0 = time.perf_counter()
            _run_unit(t, prepared, mesh_name, shape, cases, rows[t.group], failures, settings)
            rows[t.group].seconds += time.perf_counter() - t0
            bar.advance(task, len(cases))
    return VerifyReport(rows, failures, {}, settings)


def _run_unit(t: Target, prepared, mesh_name: str, shape, cases: list[Case], row: OpRow, failures: list[Failure], settings) -> None:
    if not cases:
        return
    mesh = DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape))
    built = []
    for c in cases:
        try:
            built.append(build(t, prepared[c.prepared], c, mesh, settings["seed"]))
        except Exception as e:  # noqa: BLE001 - a verify bug must not hide the other results
            row.cases += 1
            row.failed += 1
            failures.append(Failure(t.name, mesh_name, c.index, describe_layouts(prepared[c.prepared], c.layouts), prepared[c.prepared].label,
                                    f"could not build the case: {type(e).__name__}: {e}", "", repro_line(t.name, mesh_name, c.index, settings)))
    outcomes = run_cases(built, mesh.size())
    for b, o in zip(built, outcomes):
        row.cases += 1
        row.grad_cases += o.grad_error is not None
        row.worst = max(row.worst, o.error, o.grad_error or 0.0)
        if o.problem is None:
            row.passed += 1
            continue
        row.failed += 1
        failures.append(Failure(t.name, mesh_name, b.case.index, describe_layouts(b.prep, b.case.layouts), b.prep.label,
                                o.problem, o.out_placements, repro_line(t.name, mesh_name, b.case.index, settings)))


def print_report(report: VerifyReport, console) -> None:
    from rich.table import Table

    table = Table(title="shardops verify", show_lines=False, box=None, pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("op", no_wrap=True, min_width=30)
    for col in ("ovl", "cases", "pass", "fail", "grads", "worst err"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for r in report.rows.values():
        worst = "-" if r.cases == 0 else ("mismatch" if not math.isfinite(r.worst) else f"{r.worst:.1e}")
        style = "red" if r.failed else ("yellow" if r.no_samples else None)
        table.add_row(r.group, str(len(r.overloads)), str(r.cases), str(r.passed), str(r.failed), str(r.grad_cases), worst, r.status, style=style)
    console.print(table)
    for r in report.rows.values():
        for note in r.no_samples:
            console.print(f"[yellow]no samples[/yellow] {note}", highlight=False)
    for f in report.failures:
        console.print(str(f), highlight=False, markup=False)
    skipped = ", ".join(f"{n} {k}" for k, n in report.skipped.items())
    verdict = "[green]all passed[/green]" if report.ok else f"[red]{len(report.failures)} failing case(s)[/red]"
    console.print(f"{report.cases} cases over {len(report.rows)} ops in {report.elapsed:.1f} s: {verdict}"
                  + (f" (not run: {skipped}; their functional forms are checked)" if skipped else ""))


# ------------------------------------------------------------------ command line


def add_arguments(parser) -> None:
    parser.add_argument("--op", action="append", help="op name, exact or substring (aten.sum.dim_IntList, softmax); repeatable")
    parser.add_argument("--mesh", action="append", choices=sorted(MESHES), help="mesh shape (default: all of 4, 2x2, 2x2x2); repeatable")
    parser.add_argument("--full", action="store_true", help="every layout combination of every sample and dtype (slow: narrow with --op)")
    parser.add_argument("--budget", type=int, default=None, help="cases per op and mesh in the sampled run (default: 8 / 6 / 4 by mesh dims)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled run")
    parser.add_argument("--case", type=int, default=None, help="run only this case (with one --op and one --mesh): the reproduction of a failure")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    parser.add_argument("--list", action="store_true", help="list the ops verify would check, then exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args) -> int:
    """`shardops verify` with parsed arguments; exit code 1 on any mismatch."""
    if args.list:
        targets, _ = discover()
        for t in select(targets, args.op):
            print(f"{t.name:<60} {t.kind:<15} {'samples' if t.generator else 'NO SAMPLES'}")
        return 0
    report = verify(args.op, args.mesh, full=args.full, budget=args.budget, seed=args.seed, case=args.case,
                    json_path=args.json, progress=not args.no_progress)
    return 0 if report.ok else 1
