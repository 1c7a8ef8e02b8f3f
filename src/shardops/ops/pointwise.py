"""Pointwise ops: elementwise with broadcasting, and which pending partials pass through.

Rows for one mesh dim: for every output dim d, "shard d" (each input sharded on its
own aligned dim, or Replicate where it broadcasts). Partial rows come from the
algebra table below: an op keeps a pending reduction only where that is exact.
Unlisted ops are treated as nonlinear (the safe default): a partial is resolved first.
"""

from __future__ import annotations

import torch

from .._torch.dispatch import OpOverload, OpOverloadPacket, all_op_names
from ..dispatch.registry import decomposition, strategy
from ..dispatch.schema import OpSchema, is_none, scalar_sign
from ..placements import NormPartial, Partial, Replicate
from ..planner.rows import Row, row

aten = torch.ops.aten
R = Replicate()
ALL_PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"))


def _shard_rows(schema: OpSchema) -> list[Row]:
    specs = schema.tensor_specs
    out_ndim = max(s.ndim for s in specs)
    out_shape = torch.broadcast_shapes(*[s.shape for s in specs]) if specs else ()
    rows = []
    for d in range(out_ndim):
        if out_shape[d] <= 1 and not _sharded_on(specs, d, out_ndim):
            continue  # nothing to gain from sharding a dim of 0 or 1 elements, unless an operand already is
        ins = []
        for s in specs:
            k = d - (out_ndim - s.ndim)
            ins.append(R if k < 0 or s.shape[k] != out_shape[d] else _shard(k))
        rows.append(row([_shard(d)] * _n_outputs(schema), ins))
    return rows


def _sharded_on(specs, d: int, out_ndim: int) -> bool:
    """An operand is sharded on (its dim aligned with) output dim d: an in-place op on it must keep that."""
    return any(p.is_shard(d - (out_ndim - s.ndim)) for s in specs for p in s.placements if d - (out_ndim - s.ndim) >= 0)


def _shard(d: int):
    from ..placements import Shard

    return Shard(d)


def _n_outputs(schema: OpSchema) -> int:
    return len(schema.op._schema.returns)


# -- the algebra: which partials pass through which op, exactly

SUM, AVG, MAX, MIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")
NORMS = "norms"  # every NormPartial(p) among the operands stays pending as it is
_SCALED = [(SUM, (SUM,)), (AVG, (AVG,))]  # a sum (or mean) of scaled parts is the scaled sum
_SCALED_NONNEG = _SCALED + [(MAX, (MAX,)), (MIN, (MIN,)), NORMS]  # c >= 0 keeps the order and the norms
_SCALED_NEG = _SCALED + [(MIN, (MAX,)), (MAX, (MIN,))]  # c < 0 swaps max and min

# (op, operands) -> [(output, inputs)]: the pending partials an op keeps, exactly.
# operands: "TT" two tensors; "T" one tensor; "c>0", "c=0", "c<0", "c=nan": one tensor and a scalar.
# NOTE: (a + b) / c = a/c + b/c except at c == 0, where parts of opposite sign give inf - inf = NaN
# instead of the total's +-inf; integer operands are where zeros are common, so their true division
# resolves the pending sum first (see _excluded). Floor/trunc division is not linear at all.
PASS_THROUGH: dict[tuple[str, str | None], list] = {
    ("add", "TT"): [(SUM, (SUM, SUM)), (AVG, (AVG, AVG))],
    ("sub", "TT"): [(SUM, (SUM, SUM)), (AVG, (AVG, AVG))],
    ("mul", "TT"): [(SUM, (SUM, R)), (SUM, (R, SUM))],
    ("div", "TT"): [(SUM, (SUM, R))],
    ("mul", "c>0"): _SCALED_NONNEG,
    ("mul", "c=0"): _SCALED_NONNEG,
    ("mul", "c<0"): _SCALED_NEG,
    ("mul", "c=nan"): _SCALED,
    ("div", "c>0"): _SCALED_NONNEG,
    ("div", "c=0"): _SCALED,
    ("div", "c<0"): _SCALED_NEG,
    ("div", "c=nan"): _SCALED,
    ("neg", "T"): _SCALED_NEG,
    ("maximum", "TT"): [(MAX, (MAX, MAX))],
    ("fmax", "TT"): [(MAX, (MAX, MAX))],
    ("minimum", "TT"): [(MIN, (MIN, MIN))],
    ("fmin", "TT"): [(MIN, (MIN, MIN))],
}


def _operands(schema: OpSchema, base: str) -> str | None:
    """The PASS_THROUGH key's operand kind of this call (None: no partial passes)."""
    specs = schema.tensor_specs
    if base in ("add", "sub") and schema.arg_class("alpha", is_none, 1):
        return None
    if base == "div" and (
        schema.arg("rounding_mode") is not None or (len(specs) == 2 and not specs[0].dtype.is_floating_point)
    ):
        return None
    if len(specs) == 2:
        return "TT"
    if len(specs) != 1:
        return None
    if base == "neg":
        return "T"
    return schema.arg_class("other", scalar_sign)  # its sign, never its value: a new scalar each step reuses the plan


def _linear_rows(schema: OpSchema) -> list[Row]:
    """Rows that keep a pending partial: P(sum)+P(sum), P(sum)*R, P*scalar, -P ... (PASS_THROUGH)."""
    base = schema.op._schema.name.split("::")[-1].rstrip("_")
    rows: list[Row] = []
    for entry in PASS_THROUGH.get((base, _operands(schema, base)), ()):
        if entry is NORMS:
            rows += [row(NormPartial(p), NormPartial(p)) for p in _norm_types(schema.tensor_specs)]
        else:
            rows.append(row(entry[0], list(entry[1])))
    return rows


def _norm_types(specs) -> list[float]:
    return sorted({p.norm_type for s in specs for p in s.placements if isinstance(p, NormPartial)})


def _strided_rows(schema: OpSchema) -> list[Row]:
    """An operand's StridedShard (FSDP+TP after a view) passes through: every operand with
    that dim at full size takes the same StridedShard, so ranks hold the same positions."""
    from ..placements import StridedShard

    specs = schema.tensor_specs
    out_ndim = max((s.ndim for s in specs), default=0)
    out_shape = torch.broadcast_shapes(*[s.shape for s in specs]) if specs else ()
    found = {
        (p.dim + out_ndim - s.ndim, p.split_factor) for s in specs for p in s.placements if isinstance(p, StridedShard)
    }
    rows = []
    for d, sf in sorted(found):
        ins = []
        for s in specs:
            k = d - (out_ndim - s.ndim)
            ins.append(R if k < 0 or s.shape[k] != out_shape[d] else StridedShard(k, sf))
        rows.append(row([StridedShard(d, sf)] * _n_outputs(schema), ins))
    return rows


def _aten_packets() -> list[tuple[str, OpOverloadPacket]]:
    """Every aten packet (dir(aten) lists only the ones already touched)."""
    names = sorted({n.split("::")[1].split(".")[0] for n in all_op_names() if n.startswith("aten::")})
    return [(n, getattr(aten, n)) for n in names]


def _tagged_pointwise() -> list[OpOverload]:
    """Every aten overload tagged pointwise (equal is tagged too, but returns one bool for the whole tensor)."""
    ops = []
    for name, packet in _aten_packets():
        if name == "equal" or not isinstance(packet, OpOverloadPacket):
            continue
        ops += [getattr(packet, ov) for ov in packet.overloads() if torch.Tag.pointwise in getattr(packet, ov).tags]
    return ops


# prims.* elementwise ops (torch's decompositions and PyTorch's own DTensor tests call them directly):
# they carry no pointwise tag, so they are listed by name.
_PRIMS_ELEMENTWISE = """abs acos acosh add asin asinh atan atan2 atanh bessel_i0 bessel_i0e bessel_i1 bessel_i1e
bessel_j0 bessel_j1 bitwise_and bitwise_not bitwise_or bitwise_xor cbrt ceil conj_physical convert_element_type cos
cosh digamma div eq erf erf_inv erfc erfcx exp exp2 expm1 floor fmax fmin fmod gcd ge gt hypot igamma igammac
isfinite le lgamma log log10 log1p log2 lt maximum minimum mul ndtri ne neg nextafter pow reciprocal remainder round
rsqrt shift_left shift_right_arithmetic sign signbit sin sinh spherical_bessel_j0 sqrt sub tan tanh trunc where
zeta""".split()


@strategy(
    *_tagged_pointwise(),
    aten.where.self,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.masked_fill_.Scalar,
    aten.masked_fill_.Tensor,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_,
    aten.fill.Scalar,
    aten.fill.Tensor,
    *[getattr(torch.ops.prims, n).default for n in _PRIMS_ELEMENTWISE if hasattr(torch.ops.prims, n)],
)
def pointwise_rule(schema: OpSchema) -> list[Row]:
    return _shard_rows(schema) + _strided_rows(schema) + _linear_rows(schema)


# -- _foreach_*: a list op is the single-tensor op applied to each element


def _foreach(single, inplace: bool = False):
    def run(*args, **kwargs):
        lists = [a for a in args if isinstance(a, (list, tuple))]
        n = len(lists[0])
        results = []
        for i in range(n):
            call = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            results.append(single(*call, **kwargs))
        return None if inplace else results  # torch requires None from an in-place foreach op

    return run


def _register_foreach() -> None:
    for name, _ in _aten_packets():
        if not name.startswith("_foreach_") or name in ("_foreach_norm", "_foreach_max"):
            continue
        single_name = name[len("_foreach_") :]
        single = getattr(aten, single_name, None)
        packet = getattr(aten, name)
        if single is None or not isinstance(packet, OpOverloadPacket):
            continue
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
                continue
            first = op._schema.arguments[0].alias_info
            decomposition(op)(
                _foreach(_single_for(single_name, ov, single), inplace=first is not None and first.is_write)
            )


# The per-tensor op a _foreach overload stands for, where its name alone doesn't say.
_SCALAR_TWINS = {
    "maximum": aten.clamp_min,
    "minimum": aten.clamp_max,
    "maximum_": aten.clamp_min_,
    "minimum_": aten.clamp_max_,
}


def _single_for(single_name: str, overload: str, single):
    scalar_form = overload.startswith("Scalar") or overload == "Tensor"
    if single_name in _SCALAR_TWINS and overload.startswith("Scalar"):
        return _SCALAR_TWINS[single_name]
    if single_name.rstrip("_") in ("addcmul", "addcdiv") and scalar_form:
        return lambda s, a, b, value=1: single(s, a, b, value=value)  # value is keyword-only there
    return single


_register_foreach()
