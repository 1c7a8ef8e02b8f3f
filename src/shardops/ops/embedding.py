"""Embedding lookups and their table gradient: embedding, embedding_dense_backward.

Rows for one mesh dim (weight [V, H], indices [...], output [..., H]):

    forward   weight   indices   output
      S(0)     R        P(sum)   vocabulary parallel: each rank looks up the ids it owns,
                                 zero rows for the others; the sum over ranks is exact
      S(1)     R        S(-1)    hidden-sharded table: local
      R        S(d)     S(d)     ids sharded: local
      P(sum)   R        P(sum)   the lookup is linear in the table

    backward  grad_out  indices  grad_weight
      R        R        S(0)     each rank accumulates only the rows it owns: no collective,
                                 the gradient stays sharded like the table
      S(-1)    R        S(1)     hidden-sharded table: local
      S(d)     S(d)     P(sum)   ids sharded: each rank adds its own tokens (not with
                                 scale_grad_by_freq, whose counts are global)
      P(sum)   R        P(sum)   linear in grad_out

F.embedding(max_norm=...) first renormalises the looked-up rows in place
(embedding_renorm_, under no_grad): row-local, so a vocabulary-sharded table renorms the
rows it owns (0 B), a replicated one all of them (ids Replicate, so replicas stay equal).

An id outside [0, V) raises like torch on every rank: the vocabulary rows see the
whole id tensor (it is Replicate there), so each rank can check it without a message.
"""

from __future__ import annotations

import torch

from ..comm.traceable import is_traced_tensor
from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..errors import ShardingError
from ..placements import Partial, Replicate, Shard
from ..planner.rows import Row, row
from .common import global_range

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")
LABEL_VOCAB = "vocabulary parallel lookup: owned ids only, zero rows elsewhere -> P(sum)"
LABEL_VOCAB_BACKWARD = "vocabulary parallel table gradient: each rank accumulates its own rows"
LABEL_VOCAB_RENORM = "vocabulary parallel renorm: owned rows only"


def _owned_rows(ctx) -> range:
    """Global rows of the table this rank holds (nested mesh dims included)."""
    weight = ctx.in_specs[0]
    return global_range(weight, 0)


def _check_ids(ids: torch.Tensor, vocab: int, op: str) -> None:
    if type(ids) is not torch.Tensor and is_traced_tensor(ids):
        return  # torch.compile: ids have no values at trace time (a compiled lookup gives zero rows for bad ids)
    if ids.is_meta:
        return  # metadata-only pricing (autoparallel's dry world): no values to check
    if ids.numel() and (
        int(ids.min()) < 0 or int(ids.max()) >= vocab
    ):  # stays: torch raises here too (CPU); on CUDA a device assert would abort
        raise ShardingError(
            f"{op}: index out of range in self (ids must lie in [0, {vocab}); got {int(ids.min())}..{int(ids.max())})."
        )


def _vocab_lookup(ctx, weight: torch.Tensor, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    rows = _owned_rows(ctx)
    _check_ids(ids, ctx.in_specs[0].shape[0], "embedding")
    owned = (ids >= rows.start) & (ids < rows.stop)
    if weight.shape[0] == 0:  # an empty shard owns no id
        return weight.new_zeros(tuple(ids.shape) + tuple(weight.shape[1:]))
    looked_up = aten.embedding.default(weight, torch.where(owned, ids - rows.start, 0))
    return torch.where(owned.unsqueeze(-1), looked_up, torch.zeros((), dtype=weight.dtype, device=weight.device))


def _vocab_table_grad(
    ctx,
    grad: torch.Tensor,
    ids: torch.Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
    *args,
    **kwargs,
) -> torch.Tensor:
    """The rows this rank owns; other ids go to a spare row that is dropped."""
    out = ctx.out_specs[0]
    rows = global_range(out, 0)
    n_local = len(rows)
    owned = (ids >= rows.start) & (ids < rows.stop)
    local_ids = torch.where(owned, ids - rows.start, n_local)
    local_pad = padding_idx - rows.start if padding_idx >= 0 and padding_idx in rows else -1
    table = aten.embedding_dense_backward.default(grad, local_ids, n_local + 1, local_pad, scale_grad_by_freq)
    return table[:n_local]


def _vocab_renorm(ctx, weight: torch.Tensor, ids: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
    """embedding_renorm_ on the rows this rank owns (each row is renormalised on its own)."""
    rows = _owned_rows(ctx)
    _check_ids(ids, ctx.in_specs[0].shape[0], "embedding_renorm_")
    mine = ids[(ids >= rows.start) & (ids < rows.stop)] - rows.start
    if mine.numel():
        aten.embedding_renorm_.default(weight, mine, max_norm, norm_type)
    return weight


@strategy(aten.embedding_renorm_.default, algorithms=[LABEL_VOCAB_RENORM])
def embedding_renorm_rule(schema: OpSchema) -> list[Row]:
    """Vocabulary-sharded table: local on the owned rows; a replicated table with replicated ids: local."""
    return [row(Shard(0), [Shard(0), R], algorithm=_vocab_renorm, label=LABEL_VOCAB_RENORM)]


@strategy(aten.embedding.default, algorithms=[LABEL_VOCAB])
def embedding_rule(schema: OpSchema) -> list[Row]:
    weight, ids = schema.tensor_specs
    last = ids.ndim  # the output's hidden dim
    rows = [
        row(SUM, [Shard(0), R], algorithm=_vocab_lookup, label=LABEL_VOCAB),
        row(Shard(last), [Shard(1), R]),
        row(SUM, [SUM, R]),
    ]
    return rows + [row(Shard(d), [R, Shard(d)]) for d in range(ids.ndim)]


@strategy(aten.embedding_dense_backward.default, algorithms=[LABEL_VOCAB_BACKWARD])
def embedding_backward_rule(schema: OpSchema) -> list[Row]:
    grad, ids = schema.tensor_specs
    last = grad.ndim - 1
    rows = [
        row(Shard(0), [R, R], algorithm=_vocab_table_grad, label=LABEL_VOCAB_BACKWARD),
        row(Shard(1), [Shard(last), R]),
        row(SUM, [SUM, R]),
    ]
    if not schema.arg("scale_grad_by_freq"):
        rows += [row(SUM, [Shard(d), Shard(d)]) for d in range(ids.ndim)]
    return rows
