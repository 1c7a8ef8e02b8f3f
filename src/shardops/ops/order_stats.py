"""Order statistics: median, nanmedian, kthvalue, mode.

An order statistic needs every element of its dim in one place, so the reduced dim is
never sharded here. Rows for one mesh dim (`e` a kept dim, `e'` its place in the output):

    S(e) -> S(e'), S(e')       (values, indices): the local kernel on whole rows

and the implicit Replicate row. A sharded reduced dim is therefore moved: the cost model
chooses between all_to_all onto a kept dim (1/n of what a gather moves; what DTensor would
need an explicit redistribute for) and gathering it (DTensor's own choice). Full reductions
(median(), nanmedian()) need every element: the implicit Replicate row only.

Autograd: the .dim forms scatter each value's gradient into the shard holding its global
index (_reduction_autograd.ShardedReduction); the full forms spread it over the elements equal to the
result, NaN-aware as torch's evenly_distribute_backward.
"""

from __future__ import annotations

import torch

from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..errors import ShardingError
from ..planner.rows import Row
from ._reduction_autograd import DIMS, KTHVALUE, MODE, Call, TorchDecides, check_dims, reduction_entry
from .reductions import kept_dim_rows

aten = torch.ops.aten


@strategy(aten.median.dim, aten.nanmedian.dim, aten.kthvalue.default, aten.mode.default)
def _order_dim_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    if spec.ndim == 0:
        return []
    d = schema.dim("dim")
    _check_k(schema, spec, d)
    return kept_dim_rows(spec, (d,), bool(schema.arg("keepdim", False)), 2)


def _check_k(schema: OpSchema, spec, d: int) -> None:
    k = schema.arg("k")
    if k is not None and not 1 <= k <= max(spec.shape[d], 1):
        raise ShardingError(
            f"{schema.name}: k={k} is out of range for dim {d} of {spec!r}; use 1 <= k <= {spec.shape[d]}."
        )


@strategy(aten.median.default, aten.nanmedian.default)
def _order_full_rule(schema: OpSchema) -> list[Row]:
    return []  # every element in one place: the implicit Replicate row


# ------------------------------------------------------------------ torch-level entry


@reduction_entry(torch.median, torch.Tensor.median, torch.nanmedian, torch.Tensor.nanmedian, signature=DIMS)
def _describe_median(name, b, spec) -> Call:
    dim = b["dim"]
    if dim is None:
        if b["keepdim"]:
            raise TorchDecides
        return Call("extreme", tuple(range(spec.ndim)), False, nan_aware=True)
    return _select_call(name, spec, dim, b["keepdim"])


@reduction_entry(torch.kthvalue, torch.Tensor.kthvalue, signature=KTHVALUE)
def _describe_kthvalue(name, b, spec) -> Call:
    call = _select_call(name, spec, b["dim"], b["keepdim"])
    size = spec.shape[call.dims[0]] if spec.ndim else 1
    k = b["k"]
    if isinstance(k, int) and not 1 <= k <= size:
        raise ShardingError(f"{name}: k={k} is out of range for dim {b['dim']} of {spec!r}; use 1 <= k <= {size}.")
    return call


@reduction_entry(torch.mode, torch.Tensor.mode, signature=MODE)
def _describe_mode(name, b, spec) -> Call:
    return _select_call(name, spec, b["dim"], b["keepdim"])


def _select_call(name, spec, dim, keepdim) -> Call:
    if isinstance(dim, str):
        raise TorchDecides
    dims = check_dims(name, spec, dim, single=True)
    return Call("select", dims, bool(keepdim), result_type=getattr(torch.return_types, name))
