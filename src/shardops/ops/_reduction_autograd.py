"""Autograd and the torch-level entry of reductions: gradients come back in the input's layout.

torch's own backward formulas rebuild a reduction's gradient with expand, or new_zeros +
scatter, whose layouts an eager planner cannot know (it may leave a replicated full-size
gradient, or shard it on a dim the input never was). So the differentiable reductions
(sum, mean, nansum, nanmean, prod, amax/amin, max/min, aminmax, median, nanmedian,
kthvalue, mode) are entered from __torch_function__ (`torch_entry`): the call is checked
(a bad dim raises ShardingError naming the op), the forward goes through dispatch as usual
(the cost model picks its layout), and `ShardedReduction.backward` builds each rank's piece
of the gradient locally, in the input's own layout (a pending input gets Replicate):

    sum, mean, nansum, nanmean   the output gradient broadcast over the shard (nan*: masked,
                                 nanmean's count all-reduced: one output-sized round)
    amax/amin, max(), median()   grad / count * (x == result): the count all-reduced
    max(dim) & co                each gradient scattered into the shard holding its global index
    prod                         product of the others: exclusive products in the shard times
                                 the other shards' totals (one all_gather of output-sized totals)

Only output-sized values move; the input's shards never do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .._torch.dispatch import DisableTorchFunctionSubclass
from ..dispatch.registry import torch_level
from ..dispatch.schema import CallSignature
from ..errors import ShardingError
from ..placements import Placement, Replicate, Shard, StridedShard, without_partials
from ..redistribute import redistribute_local
from ..spec import TensorMeta, TensorSpec, contiguous_stride
from ..tensor import DTensor
from ..wrapping import shard_in, spec_of, wrap
from ._shard_stats import resolve_partials
from .common import all_gather_stacked, all_reduce, global_positions, mesh_dims_sharding, shift_after_reduce

R = Replicate()


# ------------------------------------------------------------------ layouts of gradients


def reduced_layout(layout: Sequence[Placement], dims: Sequence[int], keepdim: bool) -> tuple[Placement, ...]:
    """The output-shaped layout matching `layout`: kept dims keep their shards, reduced dims are whole."""
    return tuple(
        (R if p.dim in dims else shift_after_reduce(p, dims, keepdim)) if isinstance(p, (Shard, StridedShard)) else p
        for p in layout
    )


def local_in(t: torch.Tensor, placements: Sequence[Placement], mesh) -> torch.Tensor:
    """This rank's piece of `t` in `placements` (a plain tensor is taken as Replicate)."""
    if isinstance(t, DTensor):
        return shard_in(t, placements)
    spec = TensorSpec(mesh, (R,) * mesh.ndim, TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype))
    return redistribute_local(t, spec, placements)


def restore_dims(t: torch.Tensor, dims: Sequence[int], keepdim: bool) -> torch.Tensor:
    if not keepdim:
        for d in sorted(dims):
            t = t.unsqueeze(d)
    return t


def wrap_grad(local: torch.Tensor, x_spec: TensorSpec):
    meta = TensorMeta(x_spec.shape, contiguous_stride(x_spec.shape), x_spec.dtype)
    return wrap(local.to(x_spec.dtype).contiguous(), TensorSpec(x_spec.mesh, without_partials(x_spec.placements), meta))


@dataclass
class Call:
    """A torch-level reduction call, parsed: how to rerun it and what its backward needs."""

    kind: str  # sum | mean | nansum | nanmean | prod | extreme | aminmax | select
    dims: tuple[int, ...]
    keepdim: bool
    flat: bool = False  # prod(): the product of every element, flattened
    nan_aware: bool = False  # max()/median(): NaN equals a NaN result (torch's evenly_distribute_backward)
    result_type: Any = None  # torch.return_types.* for ops returning (values, indices)
    func: Callable[..., Any] | None = None
    args: tuple = ()
    kwargs: dict | None = None


NEEDS_INPUT = {"nansum", "nanmean", "prod", "extreme", "aminmax"}


class ShardedReduction(torch.autograd.Function):
    """Forward through dispatch (the cost model picks the layout); backward local, in x's layout."""

    @staticmethod
    def forward(ctx, x, call: Call):
        if call.kind in NEEDS_INPUT:
            # Resolved once and shared by forward and backward: two resolutions along different paths
            # (reduce_scatter then gather, or all_reduce) can round differently, and then `x == result`
            # would miss the extreme. The backward would have to resolve x anyway.
            x = resolve_partials(x)
        assert call.func is not None  # set by the entry before apply
        with DisableTorchFunctionSubclass():
            out = call.func(x, *call.args, **(call.kwargs or {}))
        outs = tuple(out) if isinstance(out, tuple) else (out,)
        ctx.call, ctx.x_spec = call, spec_of(x)
        ctx.set_materialize_grads(False)
        if call.kind == "select":
            ctx.mark_non_differentiable(outs[1])
        ctx.save_for_backward(x if call.kind in NEEDS_INPUT else None, *outs)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    @once_differentiable  # the backward works on local tensors: no graph for a second derivative
    def backward(ctx, *grads):
        x, *outs = ctx.saved_tensors
        if all(g is None for g in grads):
            return None, None
        return BACKWARDS[ctx.call.kind](ctx.call, ctx.x_spec, x, outs, grads), None


def _grad_out(call: Call, x_spec: TensorSpec, g) -> tuple[torch.Tensor, tuple[Placement, ...]]:
    """The output gradient as this rank's keepdim-shaped piece, aligned with x's layout."""
    layout = without_partials(x_spec.placements)
    local = local_in(g, reduced_layout(layout, call.dims, call.keepdim), x_spec.mesh)
    return restore_dims(local, call.dims, call.keepdim), layout


def _local_shape(x_spec: TensorSpec, layout) -> tuple[int, ...]:
    return x_spec.with_placements(layout).local_shape()


def _sum_backward(call, x_spec, x, outs, grads):
    g, layout = _grad_out(call, x_spec, grads[0])
    return wrap_grad(g.to(x_spec.dtype).expand(_local_shape(x_spec, layout)), x_spec)


def _mean_backward(call, x_spec, x, outs, grads):
    g, layout = _grad_out(call, x_spec, grads[0])
    count = math.prod(x_spec.shape[d] for d in call.dims)
    return wrap_grad(g.expand(_local_shape(x_spec, layout)) / count, x_spec)


def _nansum_backward(call, x_spec, x, outs, grads):
    g, layout = _grad_out(call, x_spec, grads[0])
    xl = shard_in(x, layout)
    return wrap_grad(g.to(x_spec.dtype).expand(xl.shape) * xl.isnan().logical_not(), x_spec)


def _nanmean_backward(call, x_spec, x, outs, grads):
    g, layout = _grad_out(call, x_spec, grads[0])
    xl = shard_in(x, layout)
    kept = xl.isnan().logical_not()
    count = _global_sum(kept.sum(list(call.dims), keepdim=True), x_spec, layout, call.dims)
    return wrap_grad((g / count).expand(xl.shape) * kept, x_spec)


def _global_sum(t: torch.Tensor, x_spec: TensorSpec, layout, dims) -> torch.Tensor:
    return all_reduce(t, x_spec, mesh_dims_sharding(x_spec.with_placements(layout), dims), "sum")


def _extreme_backward(call, x_spec, x, outs, grads):
    """amax/amin: grad / count * (x == result); max()/median(): NaN-aware mask (torch's two formulas)."""
    total = None
    for g, out in zip(grads, outs):
        if g is not None:
            part = _scale_by_count(call, x_spec, x, out, g)
            total = part if total is None else total + part
    return wrap_grad(total, x_spec)


def _scale_by_count(call, x_spec, x, out, g):
    g, layout = _grad_out(call, x_spec, g)
    result, _ = _grad_out(call, x_spec, out)
    xl = shard_in(x, layout)
    mask = xl == result
    if call.nan_aware:
        mask = mask | (xl.isnan() & result.isnan())
    count = _global_sum(mask.sum(list(call.dims), keepdim=True), x_spec, layout, call.dims)
    return (g / count) * mask


def _select_backward(call, x_spec, x, outs, grads):
    """Scatter each selected element's gradient into the shard that holds its global index."""
    g, layout = _grad_out(call, x_spec, grads[0])
    index, _ = _grad_out(call, x_spec, outs[1])
    (d,) = call.dims
    shape = list(_local_shape(x_spec, layout))
    positions = global_positions(x_spec.with_placements(layout), d)
    size = shape[d]
    if size != x_spec.shape[d]:  # index -> local position; indices held elsewhere go to a spare slot
        lookup = torch.full((x_spec.shape[d],), size, dtype=torch.int64, device=index.device)
        lookup[torch.as_tensor(list(positions), dtype=torch.int64, device=index.device)] = torch.arange(
            size, device=index.device
        )
        index = lookup[index]
    shape[d] = size + 1
    out = torch.zeros(shape, dtype=g.dtype, device=g.device).scatter_(d, index, g)
    return wrap_grad(out.narrow(d, 0, size), x_spec)


def _prod_backward(call, x_spec, x, outs, grads):
    """d prod / dx_i = product of every other element: exclusive products in the shard x other shards' totals.

    Like torch, prod() of a tensor with two or more zeros has a zero gradient (even beside a NaN);
    each shard's zero count travels with its total, in the same round.
    """
    g, layout = _grad_out(call, x_spec, grads[0])
    xl = shard_in(x, layout).to(outs[0].dtype)
    shape = xl.shape
    d = 0 if call.flat else call.dims[0]
    if call.flat:
        xl = xl.reshape(-1)
    others = _exclusive_product(xl, d)
    totals = torch.stack([xl.prod(d, keepdim=True), (xl == 0).sum(d, keepdim=True).to(xl.dtype)])
    group = mesh_dims_sharding(x_spec.with_placements(layout), call.dims)
    zeros = totals[1]
    if group:
        stacked = all_gather_stacked(totals, x_spec, group)
        me = x_spec.mesh.group(tuple(group)).index(x_spec.mesh.get_rank())
        others = others * torch.cat([stacked[:me, 0], stacked[me + 1 :, 0]]).prod(0)
        zeros = stacked[:, 1].sum(0)
    if call.flat:
        others = others.reshape(shape)
        # two zeros or more: every gradient is 0 (a where, not a branch: no host read of the count)
        others = torch.where((zeros > 1).reshape(()), torch.zeros((), dtype=others.dtype, device=others.device), others)
    return wrap_grad(g * others.conj(), x_spec)


def _exclusive_product(x: torch.Tensor, d: int) -> torch.Tensor:
    """Product of every element of x along d but the one at each position (no division: zeros are fine)."""
    n = x.shape[d]
    if n == 0:
        return x
    ones = torch.ones_like(x.narrow(d, 0, 1))
    before = torch.cat([ones, x.narrow(d, 0, n - 1)], d).cumprod(d)
    after = torch.cat([ones, x.flip(d).narrow(d, 0, n - 1)], d).cumprod(d).flip(d)
    return before * after


BACKWARDS = {
    "sum": _sum_backward,
    "mean": _mean_backward,
    "nansum": _nansum_backward,
    "nanmean": _nanmean_backward,
    "prod": _prod_backward,
    "extreme": _extreme_backward,
    "aminmax": _extreme_backward,
    "select": _select_backward,
}


# ------------------------------------------------------------------ torch-level entry


# torch's Python signatures of the calls handled here, by name (numpy-style aliases below)
def _dims_dtype(input, dim=None, keepdim=False, *, dtype=None, out=None): ...  # noqa: E704
def _dims(input, dim=None, keepdim=False, *, out=None): ...  # noqa: E704
def _amax(input, dim=(), keepdim=False, *, out=None): ...  # noqa: E704
def _aminmax(input, *, dim=None, keepdim=False, out=None): ...  # noqa: E704
def _kthvalue(input, k, dim=-1, keepdim=False, *, out=None): ...  # noqa: E704
def _mode(input, dim=-1, keepdim=False, *, out=None): ...  # noqa: E704
def _count_nonzero(input, dim=None): ...  # noqa: E704


_ALIASES = {"axis": "dim", "keepdims": "keepdim", "self": "input"}
DIMS_DTYPE, DIMS, AMAX, AMINMAX, KTHVALUE, MODE, COUNT_NONZERO = (
    CallSignature(f, aliases=_ALIASES) for f in (_dims_dtype, _dims, _amax, _aminmax, _kthvalue, _mode, _count_nonzero)
)


# describe(name, bound arguments, input spec) -> the Call to run sharded, or None: torch's path
Describe = Callable[[str, dict, TensorSpec], "Call | None"]


class TorchDecides(Exception):
    """A call this module leaves to torch (named dims, wrong types): torch raises its own error."""


def check_dims(name: str, spec: TensorSpec, raw, single: bool = False) -> tuple[int, ...]:
    """Normalised, sorted dims (every dim for None or []); ShardingError naming the op for a bad dim."""
    if raw is None or (not single and isinstance(raw, (list, tuple)) and len(raw) == 0):
        return tuple(range(spec.ndim))
    items = (raw,) if isinstance(raw, int) else tuple(raw) if isinstance(raw, (list, tuple)) and not single else None
    if items is None or not all(isinstance(d, int) and not isinstance(d, bool) for d in items):
        raise TorchDecides
    bound = max(spec.ndim, 1)
    out: list[int] = []
    for d in items:
        if not -bound <= d < bound:
            raise ShardingError(
                f"{name}: dim {d} is out of range for {spec!r} ({spec.ndim} dim(s)); use a dim in [-{bound}, {bound})."
            )
        if d % bound in out:
            raise ShardingError(
                f"{name}: dim {d} appears more than once in dim={raw!r} for {spec!r}; name each dim once."
            )
        out.append(d % bound)
    return tuple(sorted(out)) if spec.ndim else ()


def wants_grad(x) -> bool:
    return torch.is_grad_enabled() and x.requires_grad and x.ndim > 0


def _parse_reduction(func, describe, b: dict, args: tuple, kwargs: dict) -> tuple | None:
    """(x, Call) for ShardedReduction when x needs a gradient; None: straight to dispatch.

    The call is checked first (a bad dim raises ShardingError naming the op), gradient or not."""
    x = b["input"]
    if not isinstance(x, DTensor) or b.get("out") is not None:
        return None
    try:
        call = describe(func.__name__, b, spec_of(x))
    except TorchDecides:
        return None
    if call is None or not wants_grad(x):
        return None
    call.func = func
    call.args = args[1:] if args and args[0] is x else args
    call.kwargs = {k: v for k, v in kwargs.items() if k not in ("input", "self")}
    return x, call


def _apply_reduction(x, call: Call):
    out = ShardedReduction.apply(x, call)
    return call.result_type(out) if call.result_type is not None else out


def reduction_entry(*funcs: Any, signature: CallSignature) -> Callable[[Describe], Describe]:
    """Decorator over a describe(name, bound, spec) -> Call | None: `funcs` (torch callables, bound
    by `signature`) on DTensors that need a gradient run ShardedReduction as the Call says."""

    def register_describe(describe: Describe) -> Describe:
        for func in funcs:
            torch_level(func, signature=signature, apply=_apply_reduction)(partial(_parse_reduction, func, describe))
        return describe

    return register_describe


def named_dims(raw) -> bool:
    """dim= given by name (torch's named-tensor forms): torch decides."""
    return isinstance(raw, str) or (isinstance(raw, (list, tuple)) and any(isinstance(d, str) for d in raw))
