"""Complex views and lazy bits: view_as_complex, view_as_real, conj, _neg_view, resolve_*; polar, complex.

Every op here is elementwise over the complex (or real pair) values, so a shard of
any dim but the pair dim passes through with no data moved. The pair dim of
view_as_complex's input (size 2) needs both halves on one rank: it is never split
(a tensor sharded there is gathered first). Where a real last dim of size 2k was
sharded before `reshape(..., k, 2)`, views.py keeps the k dim sharded only where
every shard splits on whole pairs; otherwise it gathers: never a wrong value.

`_conj` and `_neg_view` set a lazy bit on their local output; wrapping it gives the
DTensor the same bit (see wrapper_meta.py), so torch's Conjugate/Negative
fallbacks materialise it before any op that does not understand it, exactly as on a
plain tensor.

Pending reductions: conj and negation are linear, so a pending sum or mean passes
(a pending product passes conj, not negation); view_as_real/view_as_complex
re-label a sum's parts, so sum and mean pass there too.
"""

from __future__ import annotations

import torch

from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..placements import Partial, Replicate, Shard, StridedShard
from ..planner.rows import Row, row
from .pointwise import pointwise_rule

aten = torch.ops.aten
R = Replicate()


def _strided(schema: OpSchema) -> list:
    return sorted({p for p in schema.self_spec.placements if isinstance(p, StridedShard)}, key=repr)


def _elementwise_view_rule(partials: tuple[str, ...]):
    """Every dim keeps its shard (and a _S layout stays); the listed pending reductions pass."""

    def rule(schema: OpSchema) -> list[Row]:
        nd = schema.self_spec.ndim
        rows = [row(Shard(d), Shard(d)) for d in range(nd)] + [row(p, p) for p in _strided(schema)]
        return rows + [row(Partial(op), Partial(op)) for op in partials]

    return rule


# conj is linear and commutes with products; negation and real/imag are linear; prims.view_of moves nothing.
strategy(aten._conj.default, aten.resolve_conj.default, aten.conj.default)(
    _elementwise_view_rule(("sum", "avg", "product"))
)
strategy(aten._neg_view.default, aten.resolve_neg.default, aten.real.default, aten.imag.default)(
    _elementwise_view_rule(("sum", "avg"))
)
strategy(torch.ops.prims.view_of.default)(_elementwise_view_rule(("sum", "avg", "max", "min", "product")))
strategy(aten.polar.default, aten.complex.default)(pointwise_rule)  # elementwise over two real tensors


@strategy(aten.view_as_complex.default)
def _view_as_complex_rule(schema: OpSchema) -> list[Row]:
    """(..., 2) real -> (...) complex: every dim but the pair dim keeps its shard."""
    nd = schema.self_spec.ndim
    rows = [row(Shard(d), Shard(d)) for d in range(nd - 1)]
    rows += [row(p, p) for p in _strided(schema) if p.dim < nd - 1]
    return rows + [row(Partial(op), Partial(op)) for op in ("sum", "avg")]
