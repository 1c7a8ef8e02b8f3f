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
"""
from __future__ import annotations

from typing import Callable

import torch

from ..dispatch.registry import register
from ..dispatch.schema import OpSchema
from ..planner.rows import Row, row
from ..placements import Partial, Placement, Replicate, Shard, StridedShard

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
    return [Shard] + [lambda d, sf=sf: StridedShard(d, sf) for sf in factors]


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


register(
    product_rows,
    aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default,
    aten.addmm.default, aten.baddbmm.default, aten.addmv.default,
)
