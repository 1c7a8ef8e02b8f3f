"""Matrix products in einsum terms: mm, addmm, bmm, baddbmm, mv, addmv, dot (and so
torch.matmul, F.linear, torch.einsum, `@` and outer, which torch decomposes into them).

Each op is described by the labels of its operands' dims and of its output:

    mm   mk,kn->mn     bmm  bmk,bkn->bmn     mv  mk,k->m     dot  k,k->

Rows for one mesh dim (the implicit all-Replicate row competes with all of them):

    a batch label sharded on both operands        -> local, output sharded on it
    a free label of one operand sharded, the other operand Replicate
                                                  -> local, output sharded on it (column-parallel)
    the contracting label sharded on both         -> local, output P(sum) (row-parallel)
    P(sum) x Replicate, Replicate x P(sum)        -> local, output P(sum) (the product is linear in each)

addmm/baddbmm/addmv add `beta * bias` (bias broadcast to the output): on a sharded
output label the bias is sharded alike where it has that dim at full size, Replicate
where it broadcasts; on a pending (P(sum)) output the bias must be P(sum) too, so it is
added once in total (a Replicate bias moves to P(sum) locally: kept on one rank, zero
on the others).

StridedShard placements (FSDP+TP layouts after a view) get the same rows as Shard:
a product does not care in which order a rank holds its rows, as long as every
operand that carries a label holds the same positions of it.

Uneven leading dims: torch folds F.linear / torch.matmul of a [*lead, K] input with a
2-d weight into one mm over the flattened leading dims. Flattening an unevenly sharded
leading dim (a batch of 3 over 4 ranks: rows 1,1,1,0) is no Shard of the merged dim, so
that view would all_to_all. On DTensors such calls keep the leading dims: a bmm of the
[A, M, K] input with the weight expanded (a free view) over A, which is local for a
sharded A or M (column-parallel weights too); the weight's gradient is the bmm's summed
over A, pending (P(sum)) where A is sharded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..dispatch.registry import decomposition, strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema
from ..placements import Partial, Placement, Replicate, Shard, StridedShard
from ..planner.rows import Row, row

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")

# Operand and output labels of each product (without the bias of the add* forms).
EQUATIONS = {
    "mm": ("mk", "kn", "mn"),
    "bmm": ("bmk", "bkn", "bmn"),
    "mv": ("mk", "k", "m"),
    "dot": ("k", "k", ""),
}
BIASED = {"addmm": "mm", "baddbmm": "bmm", "addmv": "mv"}
CONTRACTED = "k"


def _base(schema: OpSchema) -> str:
    return schema.op._schema.name.split("::")[-1]


def _shard_makers(schema: OpSchema) -> list[Callable[[int], Placement]]:
    """Shard, plus one StridedShard maker per split factor already present on an operand."""
    factors = sorted({p.split_factor for s in schema.tensor_specs for p in s.placements if isinstance(p, StridedShard)})
    makers: list[Callable[[int], Placement]] = [Shard]
    return makers + [functools.partial(StridedShard, split_factor=sf) for sf in factors]


@strategy(
    aten.mm.default,
    aten.bmm.default,
    aten.mv.default,
    aten.dot.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten.addmv.default,
)
def product_rows(schema: OpSchema) -> list[Row]:
    """Rows of a product with or without a bias (the bias is the first tensor operand)."""
    name = _base(schema)
    has_bias = name in BIASED
    lhs, rhs, out = EQUATIONS[BIASED.get(name, name)]
    specs = schema.tensor_specs
    if len(specs) != 2 + has_bias:
        return []  # a plain-number operand: nothing to plan (the implicit Replicate row)
    out_shape = _out_shape(specs[-2].shape, specs[-1].shape, lhs, rhs, out)
    bias = specs[0] if has_bias else None

    def bias_for(label: str, mk) -> list[Placement]:
        """The bias placement when the output is sharded on `label` (empty list: no bias)."""
        if bias is None:
            return []
        d = out.index(label) - (len(out) - bias.ndim)
        if d < 0 or bias.shape[d] != out_shape[out.index(label)]:
            return [R]  # the bias broadcasts along this dim: every rank needs all of it
        return [mk(d)]

    rows: list[Row] = []
    for mk in _shard_makers(schema):
        for label in out:
            ins = [mk(lhs.index(label)) if label in lhs else R, mk(rhs.index(label)) if label in rhs else R]
            rows.append(row(mk(out.index(label)), bias_for(label, mk) + ins))
        if CONTRACTED in lhs:
            pend = [SUM] if bias is not None else []
            rows.append(row(SUM, pend + [mk(lhs.index(CONTRACTED)), mk(rhs.index(CONTRACTED))]))
    pend = [SUM] if bias is not None else []
    rows.append(row(SUM, pend + [SUM, R]))
    rows.append(row(SUM, pend + [R, SUM]))
    return rows


def _out_shape(a: tuple[int, ...], b: tuple[int, ...], lhs: str, rhs: str, out: str) -> tuple[int, ...]:
    sizes = dict(zip(lhs, a)) | dict(zip(rhs, b))
    return tuple(sizes[c] for c in out)


# ------------------------------------------------------------------ composite products under inference_mode


# torch.inference_mode() skips autograd, whose dispatch key is where torch's composite linear and
# matmul split into mm/bmm/addmm and views: there they reach DTensor dispatch whole. They are
# decomposed here the same way (torch's own decomposition, on DTensors), so they shard as in
# training (a column-parallel weight gives a sharded output, torch's test_aten_linear) rather
# than replicating.


@decomposition(aten.linear.default)
def _linear_decomposed(*args, **kwargs):
    return aten.linear.default.decompose(*args, **kwargs)


@decomposition(aten.matmul.default)
def _matmul_decomposed(*args, **kwargs):
    return aten.matmul.default.decompose(*args, **kwargs)


# ------------------------------------------------------------------ uneven leading dims (torch level)


def _uneven_leading_dims(x) -> list[int]:
    """x's leading (non-last) dims whose shards are uneven (their size not a multiple of the shard count)."""
    counts: dict[int, int] = {}
    for n, p in zip(x.device_mesh.shape, x.placements):
        if isinstance(p, (Shard, StridedShard)) and p.dim % x.ndim < x.ndim - 1:
            counts[p.dim % x.ndim] = counts.get(p.dim % x.ndim, 1) * n
    return [d for d, c in counts.items() if x.shape[d] % c]


def _keeps_leading_dims(x, weight) -> bool:
    """The bmm form applies: x a DTensor of 3+ dims with an unevenly sharded leading dim among its
    first two, the dims it would merge (1 .. -2, for 4+ dims) unsharded, and a 2-d weight."""
    from ..tensor import DTensor

    if not isinstance(x, DTensor) or x.ndim < 3 or not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return False
    uneven = _uneven_leading_dims(x)
    if not uneven or any(d > 1 for d in uneven):
        return False
    merged = set(range(1, x.ndim - 1)) if x.ndim > 3 else set()
    return not any(isinstance(p, (Shard, StridedShard)) and p.dim % x.ndim in merged for p in x.placements)


def _bmm_keeping_leading_dims(x, rhs, bias=None):
    """x [A, *mid, K] @ rhs [K, N] (+ bias) as one bmm over A: the leading dims never merge with A."""
    x3 = x if x.ndim == 3 else x.flatten(1, -2)  # unsharded mid dims: a free view
    out = torch.bmm(x3, rhs.expand(x3.shape[0], *rhs.shape))
    if x.ndim > 3:
        out = out.unflatten(1, tuple(x.shape[1:-1]))
    return out if bias is None else out + bias


def _linear_call(input, weight, bias=None): ...  # noqa: E704


def _matmul_call(input, other, *, out=None): ...  # noqa: E704


@torch_level(torch.nn.functional.linear, signature=CallSignature(_linear_call), apply=_bmm_keeping_leading_dims)
def _parse_linear(b: dict, *_) -> tuple | None:
    if not _keeps_leading_dims(b["input"], b["weight"]):
        return None
    return b["input"], b["weight"].t(), b["bias"]


@torch_level(
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    signature=CallSignature(_matmul_call, aliases={"self": "input"}),
    apply=_bmm_keeping_leading_dims,
)
def _parse_matmul(b: dict, *_) -> tuple | None:
    if b.get("out") is not None or not _keeps_leading_dims(b["input"], b["other"]):
        return None
    return b["input"], b["other"], None
