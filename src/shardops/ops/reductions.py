"""Linear reductions and arg-reductions over sharded dims.

Rows for one mesh dim (`d` a reduced dim, `e` a kept dim, `e'` its place in the output):

    S(e) -> S(e')                 local kernel; a kept dim keeps its shard
    S(d) -> P(op)                 local reduce, pending        (sum, prod, mean, amax, all, ...)
    S(d) -> R   + all_gather      gather each shard's result, combine locally: one round
    P(op) -> P(op)                a pending input whose op the reduction passes stays pending
    S(d) -> R   + all_gather      argmax/argmin/max.dim/min.dim: (value, global index) pairs

The pending row and the gather row compete in the cost model: gathering n tiny results is one
ring pass, resolving a pending scalar later is an all_reduce (two), so the gather row wins for
small outputs and the pending row for the rest. `mean` divides the local sum by the GLOBAL
count, so its pending partial is exact on uneven shards. Arg-reductions carry GLOBAL indices
(strided and nested shards included) and fold the pairs as torch does: NaN wins, ties go to
the smaller index. Kernels that refuse an empty reduced region (amax, max, aminmax, argmax)
get the reduction's identity there (index: int64 max), so an empty shard still joins every
collective.

Autograd: see _reduction_autograd (the differentiable ops are entered from __torch_function__;
their backward builds each rank's gradient locally, in the input's layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..placements import Partial, Placement, Replicate, Shard, StridedShard
from ..planner.rows import Row, row
from ..spec import TensorSpec, contiguous_stride
from ._reduction_autograd import (
    AMAX,
    AMINMAX,
    COUNT_NONZERO,
    DIMS,
    DIMS_DTYPE,
    Call,
    TorchDecides,
    check_dims,
    named_dims,
    reduction_entry,
)
from .common import all_gather_stacked, global_index_tensor, mesh_dims_sharding, opmath_dtype, shift_after_reduce

aten = torch.ops.aten
R = Replicate()
NO_INDEX = torch.iinfo(torch.int64).max  # an empty shard's index: loses every tie


# ------------------------------------------------------------------ the algebra


@dataclass(frozen=True)
class Linear:
    """How a reduction combines over shards.

    combine: per output, how shard results combine (sum | product | max | min | all | any)
    passes:  Partial(op) inputs that stay pending through the reduction (linear in them)
    identity_on_empty: the kernel refuses an empty reduced region; use the identity instead
    by_count: mean: the local sum over the GLOBAL count
    """

    combine: tuple[str, ...]
    passes: tuple[str, ...] = ()
    identity_on_empty: bool = False
    by_count: bool = False


PENDING_OP = {"sum": "sum", "product": "product", "max": "max", "min": "min", "all": "min", "any": "max"}

SUM = Linear(("sum",), ("sum", "avg"))
LINEAR: dict[Any, Linear] = {
    aten.sum.default: SUM,
    aten.sum.dim_IntList: SUM,
    aten.nansum.default: Linear(("sum",)),  # NaN on one rank's partial must not vanish: no passes
    aten.prod.default: Linear(("product",), ("product",)),
    aten.prod.dim_int: Linear(("product",), ("product",)),
    aten.mean.default: Linear(("sum",), ("sum", "avg"), by_count=True),
    aten.mean.dim: Linear(("sum",), ("sum", "avg"), by_count=True),
    aten.amax.default: Linear(("max",), ("max",), True),
    aten.amin.default: Linear(("min",), ("min",), True),
    aten.max.default: Linear(("max",), ("max",), True),
    aten.min.default: Linear(("min",), ("min",), True),
    # all/any pass min/max partials only where "nonzero" commutes with them: bool and unsigned
    aten.all.default: Linear(("all",), ("min",)),
    aten.all.dim: Linear(("all",), ("min",)),
    aten.all.dims: Linear(("all",), ("min",)),
    aten.any.default: Linear(("any",), ("max",)),
    aten.any.dim: Linear(("any",), ("max",)),
    aten.any.dims: Linear(("any",), ("max",)),
    aten.count_nonzero.default: Linear(("sum",)),
    aten.count_nonzero.dim_IntList: Linear(("sum",)),
    aten.aminmax.default: Linear(("min", "max"), (), True),
}
UNSIGNED = (torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64)

# arg-reductions: (which extreme, returns values too)
SELECT: dict[Any, tuple[str, bool]] = {
    aten.argmax.default: ("max", False),
    aten.argmin.default: ("min", False),
    aten.max.dim: ("max", True),
    aten.min.dim: ("min", True),
}


# ------------------------------------------------------------------ shared helpers


def reduced_dims(schema: OpSchema) -> tuple[int, ...]:
    """The dims an op reduces (every dim when it takes none, or dim=None / [])."""
    if schema.self_spec.ndim == 0:
        return ()
    if "dim" not in {a.name for a in schema.op._schema.arguments}:
        return tuple(range(schema.self_spec.ndim))
    return schema.dims("dim")


def shard_options(spec: TensorSpec, d: int) -> list[Placement]:
    """Placements that shard dim d worth a row: plain Shard unless the dim is trivial, plus any strided shard in use."""
    present = [p for p in spec.placements if p.is_shard(d)]
    plain: list[Placement] = [Shard(d)] if spec.shape[d] > 1 else []
    return list(dict.fromkeys(present + plain))


def kept_dim_rows(spec: TensorSpec, dims: Sequence[int], keepdim: bool, n_out: int) -> list[Row]:
    """S(e) -> S(e') for every kept dim: the local kernel is right, a kept dim never mixes shards."""
    return [
        row([shift_after_reduce(p, dims, keepdim)] * n_out, p)
        for e in range(spec.ndim)
        if e not in dims
        for p in shard_options(spec, e)
    ]


def output_bytes_per_rank(spec: TensorSpec, dims: Sequence[int], bytes_per_element: float) -> float:
    """Bytes of this op's output on one rank, kept dims sharded as now (for the cost of gathering it)."""
    kept = math.prod(s for i, s in enumerate(spec.shape) if i not in dims)
    split = math.prod(
        n
        for n, p in zip(spec.mesh.shape, spec.placements)
        if isinstance(p, (Shard, StridedShard)) and p.dim not in dims
    )
    return kept * bytes_per_element / max(split, 1)


def identity(op: str, dtype: torch.dtype) -> Any:
    """The value an empty shard contributes to a max/min (it loses every comparison)."""
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


# ------------------------------------------------------------------ linear reductions


# Its rows' labels name the op ("local sum.dim_IntList -> pending", as explain prints them):
# verify reads each op's algorithm names from its rows.
@strategy(*LINEAR)
def _linear_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    lin = LINEAR[schema.op]
    dims = reduced_dims(schema)
    keepdim = bool(schema.arg("keepdim", False))
    n_out = len(lin.combine)
    rows = kept_dim_rows(spec, dims, keepdim, n_out)
    pending = [Partial(PENDING_OP[c]) for c in lin.combine]
    out_dtype = _out_dtype(schema, spec, lin)
    gathered = (("all_gather", output_bytes_per_rank(spec, dims, out_dtype.itemsize * n_out)),)
    for d in dims:
        for p in shard_options(spec, d):
            rows.append(row(pending, p, algorithm=linear_sharded, label=f"local {schema.name} -> pending"))
            rows.append(
                row([R] * n_out, p, algorithm=linear_sharded, comm=gathered, label=f"gather shard {schema.name}s")
            )
    for op in _passing(lin, spec.dtype, out_dtype):
        rows.append(row([Partial(op)] * n_out, Partial(op)))
    return rows


def _passing(lin: Linear, in_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[str, ...]:
    """The pending input kinds that stay pending, exactly."""
    if lin.combine[0] in ("all", "any"):
        # "nonzero" commutes with the ranks' min/max only for values >= 0: min(0, -1) = -1 is nonzero
        # although one rank holds a zero
        return lin.passes if in_dtype in UNSIGNED else ()
    if not in_dtype.is_floating_point and not in_dtype.is_complex:
        if out_dtype != in_dtype:
            return ()  # int32 partials wrap at 32 bits, their int64 sum would not
        return tuple(p for p in lin.passes if p != "avg")  # an integer avg floors: not linear
    return lin.passes


def _out_dtype(schema: OpSchema, spec: TensorSpec, lin: Linear) -> torch.dtype:
    if schema.arg("dtype") is not None:
        return schema.arg("dtype")
    if schema.op in (aten.count_nonzero.default, aten.count_nonzero.dim_IntList):
        return torch.int64
    integral = not spec.dtype.is_floating_point and not spec.dtype.is_complex
    if integral and lin.combine[0] in ("sum", "product"):
        return torch.int64  # torch promotes integer sums and products
    if lin.combine[0] in ("all", "any"):
        return torch.uint8 if spec.dtype == torch.uint8 else torch.bool
    return spec.dtype


def refuse_empty_like_torch(ctx, dims: Sequence[int], flat: bool, args, kwargs) -> None:
    """torch refuses max/amax/argmax/... over an empty region: so does every rank, before any collective.

    (Each shard substitutes the identity for its own empty part, which is right only while
    the global region is not empty; aten's meta kernels do not check this.)
    """
    spec = ctx.in_specs[0]
    if spec.numel == 0 if flat else any(spec.shape[d] == 0 for d in dims):
        ctx.func(torch.empty(spec.shape, dtype=spec.dtype), *args, **kwargs)  # raises torch's own error


def linear_sharded(ctx, x: torch.Tensor, *args, **kwargs):
    """Local reduce; over mesh dims whose output is Replicate, gather the shard results and combine (one round)."""
    lin = LINEAR[ctx.func]
    spec = ctx.in_specs[0]
    dims = reduced_dims(ctx.schema)
    if lin.identity_on_empty:
        refuse_empty_like_torch(ctx, dims, False, args, kwargs)
    outs = _local_partials(ctx, lin, dims, x, args, kwargs)
    gather = [i for i in mesh_dims_sharding(spec, dims) if not ctx.out_specs[0].placements[i].is_partial()]
    if gather:
        stacked = all_gather_stacked(torch.stack(outs), spec, gather)
        outs = tuple(
            Partial(PENDING_OP[how]).combine(stacked[:, k]).to(o.dtype)
            for k, (how, o) in enumerate(zip(lin.combine, outs))
        )
    return outs if len(outs) > 1 else outs[0]


def _local_partials(ctx, lin: Linear, dims, x, args, kwargs) -> tuple[torch.Tensor, ...]:
    if lin.identity_on_empty and any(x.shape[d] == 0 for d in dims):
        return tuple(
            torch.full(o.local_shape(), identity(how, o.dtype), dtype=o.dtype, device=x.device)
            for how, o in zip(lin.combine, ctx.out_specs)
        )
    if lin.by_count:
        return (_mean_over_global_count(ctx, x, dims),)
    out = ctx.func(x, *args, **kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _mean_over_global_count(ctx, x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    # Like torch's CPU mean: sum (in float for half types), divide by the count, cast.
    out_dtype = ctx.out_specs[0].dtype
    acc = opmath_dtype(out_dtype)
    count = math.prod(ctx.in_specs[0].shape[d] for d in dims)
    keepdim = bool(ctx.schema.arg("keepdim", False))
    total = torch.sum(x, list(dims), keepdim=keepdim, dtype=acc) if dims else x.to(acc)
    return (total / count).to(out_dtype)


# ------------------------------------------------------------------ arg-reductions


LABEL_PAIRS = "gather (value, global index) pairs"


@strategy(*SELECT, algorithms=[LABEL_PAIRS])
def _select_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    _, with_values = SELECT[schema.op]
    flat = schema.arg("dim") is None
    dims = tuple(range(spec.ndim)) if flat else reduced_dims(schema)
    keepdim = bool(schema.arg("keepdim", False))
    n_out = 2 if with_values else 1
    rows = [] if flat else kept_dim_rows(spec, dims, keepdim, n_out)
    pairs = (("all_gather", output_bytes_per_rank(spec, dims, 8 if _compact(spec, dims, flat) else 16)),)
    for d in dims:
        for p in shard_options(spec, d):
            rows.append(row([R] * n_out, p, algorithm=select_sharded, comm=pairs, label=LABEL_PAIRS))
    return rows


def select_sharded(ctx, x: torch.Tensor, *args, **kwargs):
    """Local best (value, GLOBAL index); one all_gather of the pairs; the best pair wins, ties to the smaller index."""
    which, with_values = SELECT[ctx.func]
    spec = ctx.in_specs[0]
    flat = ctx.schema.arg("dim") is None
    dims = tuple(range(spec.ndim)) if flat else reduced_dims(ctx.schema)
    refuse_empty_like_torch(ctx, dims, flat, args, kwargs)
    values, index = _local_best(ctx, x, spec, which, with_values, flat, dims)
    group = mesh_dims_sharding(spec, dims)
    if group:
        if _compact(spec, dims, flat):
            packed = all_gather_stacked(_pack32(values, index), spec, group)
            best, index = best_of(*_unpack32(packed, values.dtype), which)
        else:
            pairs = all_gather_stacked(torch.stack([_as_int64(values), index]), spec, group)
            best, index = best_of(_from_int64(pairs[:, 0], values.dtype), pairs[:, 1], which)
        values = best.to(values.dtype)
    shapes = [o.local_shape() for o in ctx.out_specs]
    if with_values:
        return values.reshape(shapes[0]), index.reshape(shapes[1])
    return index.reshape(shapes[0])


def _local_best(ctx, x, spec, which, with_values, flat, dims):
    """keepdim-shaped (value, global index) of this shard's best element."""
    local = x.reshape(-1) if flat else x
    d = 0 if flat else dims[0]
    if local.shape[d] == 0:
        shape = list(local.shape)
        shape[d] = 1
        values = torch.full(shape, identity(which, x.dtype), dtype=x.dtype, device=x.device)
        return values, torch.full(shape, NO_INDEX, dtype=torch.int64, device=x.device)
    if with_values:
        values, idx = (torch.max if which == "max" else torch.min)(local, d, keepdim=True)
    else:
        idx = (torch.argmax if which == "max" else torch.argmin)(local, d, keepdim=True)
        values = local.gather(d, idx)
    gidx = _global_flat_index(spec, x.shape, idx) if flat else global_index_tensor(spec, d, x.device)[idx]
    return values, gidx


def _global_flat_index(spec: TensorSpec, local_shape, idx: torch.Tensor) -> torch.Tensor:
    """Index into this shard's flattened data -> index into the global tensor flattened."""
    strides = contiguous_stride(spec.shape)
    rem, out = idx, torch.zeros_like(idx)
    for e in reversed(range(spec.ndim)):
        coord = rem % local_shape[e]
        rem = rem // local_shape[e]
        out = out + global_index_tensor(spec, e, idx.device)[coord] * strides[e]
    return out


_COMPACT_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_INDEX_BITS = 0xFFFFFFFF


def _compact(spec: TensorSpec, dims, flat: bool) -> bool:
    """(value, index) fit one int64 when the value has <= 32 bits and every global index < 2**31."""
    span = spec.numel if flat else math.prod(spec.shape[d] for d in dims)
    return spec.dtype in _COMPACT_DTYPES and span < 2**31 - 1


def _pack32(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """value bits in the high word, index in the low word: 8 bytes a pair instead of 16."""
    as32 = values.to(torch.float32).view(torch.int32) if values.dtype.is_floating_point else values.to(torch.int32)
    low = torch.where(index == NO_INDEX, torch.full_like(index, 2**31 - 1), index)
    return (as32.to(torch.int64) << 32) | low


def _unpack32(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    high = (packed >> 32).to(torch.int32)
    values = high.view(torch.float32) if dtype.is_floating_point else high
    return values, packed & _INDEX_BITS


def _as_int64(values: torch.Tensor) -> torch.Tensor:
    """Values as int64 bits, so that (value, index) travel as one tensor; exact for every real dtype."""
    if values.dtype.is_floating_point:
        return values.to(torch.float64).view(torch.int64)
    return values.to(torch.int64)


def _from_int64(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bits = bits.contiguous()
    return bits.view(torch.float64) if dtype.is_floating_point else bits


def best_of(values: torch.Tensor, index: torch.Tensor, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold candidates stacked on dim 0 as torch does: NaN beats all, then the extreme, ties to the smaller index."""
    best_v, best_i = values[0], index[0]
    for v, i in zip(values[1:], index[1:]):
        v_nan, b_nan = torch.isnan(v), torch.isnan(best_v)
        strictly = (v > best_v) if which == "max" else (v < best_v)
        strictly = (v_nan & ~b_nan) | (~v_nan & ~b_nan & strictly)
        tie = ((v == best_v) | (v_nan & b_nan)) & (i < best_i)
        take = strictly | tie
        best_v, best_i = torch.where(take, v, best_v), torch.where(take, i, best_i)
    return best_v, best_i


# ------------------------------------------------------------------ torch-level entries (autograd)


@reduction_entry(
    torch.sum,
    torch.Tensor.sum,
    torch.mean,
    torch.Tensor.mean,
    torch.nansum,
    torch.Tensor.nansum,
    torch.nanmean,
    torch.Tensor.nanmean,
    torch.prod,
    torch.Tensor.prod,
    signature=DIMS_DTYPE,
)
def _describe_linear(name, b, spec) -> Call:
    """sum/mean/nansum/nanmean/prod (the Call's kind is the function's name): dim (None: all), keepdim, dtype."""
    if named_dims(b["dim"]):
        raise TorchDecides
    dims = check_dims(name, spec, b["dim"], single=name == "prod")
    return Call(name, dims, bool(b["keepdim"]), flat=b["dim"] is None)


@reduction_entry(torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin, signature=AMAX)
def _describe_amax(name, b, spec) -> Call:
    if named_dims(b["dim"]):
        raise TorchDecides
    return Call("extreme", check_dims(name, spec, b["dim"]), bool(b["keepdim"]))


@reduction_entry(torch.max, torch.Tensor.max, torch.min, torch.Tensor.min, signature=DIMS)
def _describe_max(name, b, spec) -> Call:
    """max(x) / max(x, dim, keepdim) / max(x, other) (elementwise: torch's path)."""
    dim = b["dim"]
    if isinstance(dim, torch.Tensor) or named_dims(dim):
        raise TorchDecides
    if dim is None:
        if b["keepdim"]:
            raise TorchDecides
        return Call("extreme", tuple(range(spec.ndim)), False, nan_aware=True)
    dims = check_dims(name, spec, dim, single=True)
    return Call("select", dims, bool(b["keepdim"]), result_type=getattr(torch.return_types, name))


@reduction_entry(torch.aminmax, torch.Tensor.aminmax, signature=AMINMAX)
def _describe_aminmax(name, b, spec) -> Call:
    dims = check_dims(name, spec, b["dim"], single=True)
    return Call("aminmax", dims, bool(b["keepdim"]), result_type=torch.return_types.aminmax)


@reduction_entry(
    torch.argmax,
    torch.Tensor.argmax,
    torch.argmin,
    torch.Tensor.argmin,
    torch.all,
    torch.Tensor.all,
    torch.any,
    torch.Tensor.any,
    signature=DIMS,
)
@reduction_entry(torch.count_nonzero, torch.Tensor.count_nonzero, signature=COUNT_NONZERO)
def _check_dims_only(name, b, spec) -> None:
    """Non-differentiable ops (argmax, all, count_nonzero, ...): only check the dims, then dispatch."""
    if not named_dims(b["dim"]):
        check_dims(name, spec, b["dim"], single=name in ("argmax", "argmin"))
    return None
