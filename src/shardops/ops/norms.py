"""Vector norms: linalg_vector_norm, norm (aten.norm.* overloads), dist, _foreach_norm.

A norm over a sharded dim is a local norm left pending as NormPartial(p): no communication
until something needs the value (full_tensor, a nonlinear op), and then one small
all-reduce per mesh dim (redistribute's resolution). A norm of NormPartial(p) values with
the same p stays NormPartial(p) (the p-norm of p-norms is the p-norm of everything; not
for p = 0, whose pending values are counts): clip_grad_norm_'s
`vector_norm(stack(_foreach_norm(grads)))` is resolved once, not once per tensor (see
concat.py for how stack keeps the pending layouts together).

An empty shard has no inf / -inf / negative-p norm in torch (no identity); the local
kernel is then skipped and the shard contributes the neutral value (0, or +inf where
small values win).

Backward: torch's formulas read the pending result several times (each read would resolve
it again) and the inf-norm one needs a global count of ties. The torch-level entry points
(torch.linalg.vector_norm, torch.norm, Tensor.norm, torch.dist) use their own
autograd.Function: one collective resolves the norm (or, for inf/-inf, one all_gather of
per-shard (max, count of maxima) gives both the norm and the tie count), the rest is
torch's formula, local, in the input's layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..dispatch.mixed import check_plain_operand
from ..dispatch.registry import decomposition, strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema
from ..placements import NormPartial, Replicate, Shard, without_partials
from ..planner.rows import Row, row
from ..spec import TensorMeta, TensorSpec
from ..tensor import DTensor
from ..wrapping import local_of, shard_in, spec_of, wrap
from ._shard_stats import (
    grad_local,
    input_grad,
    needs_grad,
    reduced_dims,
    reduction_layouts,
    resolve_partials,
    to_layout,
    unsqueeze_reduced,
)
from .common import all_gather_stacked, all_reduce, mesh_dims_sharding, shift_after_reduce

aten = torch.ops.aten
R = Replicate()
NORM_OPS = (
    aten.linalg_vector_norm.default,
    aten.norm.Scalar,
    aten.norm.ScalarOpt_dim,
    aten.norm.ScalarOpt_dim_dtype,
    aten.norm.ScalarOpt_dtype,
)
LABEL_NORM = "local norm (pending)"
LABEL_DIST = "local dist (pending)"


def _norm_params(op, bound: dict, ndim: int) -> tuple[float, tuple[int, ...], bool]:
    """(ord, reduced dims, keepdim) of linalg_vector_norm and the aten.norm overloads, from bound arguments."""
    p = bound.get("ord", 2) if "ord" in bound else bound.get("p")
    p = 2.0 if p is None else float(p)
    dims = reduced_dims(bound.get("dim"), ndim, str(op))
    return p, dims if dims is not None else tuple(range(ndim)), bool(bound.get("keepdim", False))


def _norm_args(schema: OpSchema) -> tuple[float, tuple[int, ...], bool]:
    return _norm_params(schema.op, schema.bound, schema.self_spec.ndim)


# ------------------------------------------------------------------ forward


def _empty_safe_norm(ctx, x, *args, **kwargs):
    """The local norm; an empty shard gives the neutral value (torch has no inf/-inf/p<0 norm of nothing)."""
    p, dims, _ = _norm_args(ctx.schema)
    if math.prod(x.shape[d] for d in dims) == 0:
        out = ctx.out_specs[0]
        return torch.full(out.local_shape(), NormPartial(p).neutral, dtype=out.dtype, device=x.device)
    return ctx.func(x, *args, **kwargs)


@strategy(*NORM_OPS, algorithms=[LABEL_NORM])
def _vector_norm_rule(schema: OpSchema) -> list[Row]:
    """Rows: S(k) -> S(k shifted) for kept dims; S(k) -> NormP(p) for reduced dims (local norm,
    pending); NormP(p) -> NormP(p) (a p-norm of p-norms, p != 0). No collective inside."""
    spec = schema.self_spec
    p, dims, keepdim = _norm_args(schema)
    rows = [row(shift_after_reduce(Shard(k), dims, keepdim), Shard(k)) for k in range(spec.ndim) if k not in dims]
    rows += [row(NormPartial(p), Shard(k), algorithm=_empty_safe_norm, label=LABEL_NORM) for k in dims]
    if p != 0 and NormPartial(p) in spec.placements:
        rows.append(row(NormPartial(p), NormPartial(p)))
    return rows


def _empty_safe_dist(ctx, a, b, *args, **kwargs):
    if a.numel() == 0 or b.numel() == 0:
        p = ctx.schema.arg("p", 2)
        out = ctx.out_specs[0]
        return torch.full(
            out.local_shape(), NormPartial(2.0 if p is None else p).neutral, dtype=out.dtype, device=a.device
        )
    return ctx.func(a, b, *args, **kwargs)


@strategy(aten.dist.default, algorithms=[LABEL_DIST])
def _dist_rule(schema: OpSchema) -> list[Row]:
    """dist(a, b, p) = ||a - b||_p over everything: both sides sharded alike on a broadcast dim
    (Replicate where one broadcasts) -> NormP(p)."""
    a, b = schema.tensor_specs
    p = schema.arg("p", 2)
    p = 2.0 if p is None else float(p)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    rows = []
    for d, size in enumerate(shape):
        ins = []
        for s in (a, b):
            k = d - (len(shape) - s.ndim)
            ins.append(R if k < 0 or s.shape[k] != size else Shard(k))
        if size > 1:
            rows.append(row(NormPartial(p), ins, algorithm=_empty_safe_dist, label=LABEL_DIST))
    return rows


@decomposition(aten._foreach_norm.Scalar)
def _foreach_norm(tensors, ord=2, dtype=None):
    """_foreach_norm on DTensors: one pending norm per tensor (no collective); a later stack
    and norm of the results keep them pending together."""
    return [aten.linalg_vector_norm.default(t, ord, None, False, dtype=dtype) for t in tensors]


# ------------------------------------------------------------------ backward


def resolve_norm(local: torch.Tensor, spec) -> torch.Tensor:
    """This rank's piece of a pending norm, resolved over all its NormP mesh dims in ONE collective."""
    pending = [i for i, p in enumerate(spec.placements) if isinstance(p, NormPartial)]
    if not pending:
        return local
    p = spec.placements[pending[0]]
    return p.from_wire(all_reduce(p.to_wire(local), spec, pending, p.wire_op))


def self_norm(local: torch.Tensor, spec, placements) -> torch.Tensor:
    """The norm resolved (one collective) and brought to `placements`."""
    resolved = resolve_norm(local, spec)
    return to_layout(resolved, spec.with_placements(without_partials(spec.placements)), placements)


def _extreme_norm_and_count(x: torch.Tensor, p: float, spec, dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(global inf/-inf norm, mask of the elements that attain it (or are NaN), global count of those).

    One all_gather of per-shard (max |x|, count of |x| equal to it or NaN): a shard whose max is
    not the global one holds none of the attaining elements.
    """
    a = x.abs()
    if math.prod(x.shape[d] for d in dims) == 0:
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
        local = torch.full(shape, NormPartial(p).neutral, dtype=a.dtype, device=x.device)
        count = torch.zeros(shape, dtype=torch.int64, device=x.device)
    else:
        local = a.amax(dims, keepdim=True) if p > 0 else a.amin(dims, keepdim=True)
        count = ((a == local) | a.isnan()).sum(dims, keepdim=True)
    values, counts = all_gather_stacked([local, count], spec, mesh_dims_sharding(spec, dims))
    norm = values.amax(0) if p > 0 else values.amin(0)
    attains = (values == norm) | (values.isnan() & norm.isnan())
    total = (counts * attains).sum(0)
    return norm, (a == norm) | a.isnan(), total


def _norm_backward(g: torch.Tensor, x: torch.Tensor, norm: torch.Tensor | None, p: float) -> torch.Tensor:
    """torch's norm_backward (FunctionsManual.cpp), given the global norm; g and norm keepdim-shaped."""
    if p == 1.0:
        return x.sgn() * g
    assert norm is not None  # only p == 1 goes without the norm
    if p == 2.0:
        return g * (x / norm).masked_fill(norm == 0, 0)
    if p < 1.0:
        scaled = x.sgn() * x.abs().pow(p - 1).masked_fill(x == 0, 0)
        return scaled * g * norm.pow(1 - p)
    scaled = x.sgn() * x.abs().pow(p - 1) if p < 2.0 else x * x.abs().pow(p - 2)
    return scaled * (g / norm.pow(p - 1)).masked_fill(norm == 0, 0)


@dataclass
class _NormState:
    """What a norm's backward keeps from its forward."""

    p: float
    dims: tuple[int, ...]
    keepdim: bool
    x_local: torch.Tensor  # the input, in `layout` (where it already was)
    x_spec: TensorSpec
    layout: tuple
    out_layout: tuple
    out_local: torch.Tensor
    out_spec: TensorSpec


def _norm_forward(x_in, p: float, dims: tuple[int, ...], keepdim: bool, dtype) -> tuple[Any, _NormState]:
    """The norm of `x_in` (pending partials already resolved) through dispatch, and its backward state."""
    out = aten.linalg_vector_norm.default(x_in, p, list(dims), keepdim, dtype=dtype)
    layout, out_layout = reduction_layouts(spec_of(x_in), dims, keepdim)
    state = _NormState(
        p,
        dims,
        keepdim,
        shard_in(x_in, layout),
        spec_of(x_in),
        layout,
        out_layout,
        local_of(out).clone(),
        spec_of(out),
    )
    return out, state


def _norm_input_grad(s: _NormState, grad) -> torch.Tensor | None:
    """d norm / d x (local, in `s.layout`): torch's formula on the global norm, resolved once."""
    if s.p == 0:  # torch leaves the input without a gradient (an undefined one)
        return None
    nd = len(s.x_spec.shape)
    g = unsqueeze_reduced(grad_local(grad, s.out_spec, s.out_layout), nd, s.dims, s.keepdim)
    x = s.x_local
    if math.isinf(s.p):
        _, mask, count = _extreme_norm_and_count(x, s.p, s.x_spec.with_placements(s.layout), s.dims)
        return x.sgn() * ((g / count) * mask)
    norm = unsqueeze_reduced(self_norm(s.out_local, s.out_spec, s.out_layout), nd, s.dims, s.keepdim)
    return _norm_backward(g, x, norm, s.p)


class _VectorNormFunction(torch.autograd.Function):
    """linalg_vector_norm on DTensors with a backward that resolves the norm once."""

    @staticmethod
    def forward(ctx, x, p: float, dims: tuple[int, ...], keepdim: bool, dtype):
        out, ctx.state = _norm_forward(resolve_partials(x), p, dims, keepdim, dtype)
        ctx.x_spec = spec_of(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx = _norm_input_grad(ctx.state, grad)
        if gx is None:
            return None, None, None, None, None
        return input_grad(gx, ctx.state.layout, ctx.x_spec), None, None, None, None


class _DistFunction(torch.autograd.Function):
    """dist(a, b, p) = ||a - b||_p with the difference taken inside: both gradients come back in
    their inputs' layouts (a difference left to autograd would hand back the layout the pointwise
    planner picked for it)."""

    @staticmethod
    def forward(ctx, a, b, p: float):
        diff = aten.sub.Tensor(resolve_partials(a), resolve_partials(b))
        out, ctx.state = _norm_forward(diff, p, tuple(range(diff.ndim)), False, None)
        ctx.a_spec, ctx.b_spec = spec_of(a), spec_of(b)
        return out

    @staticmethod
    def backward(ctx, grad):
        s = ctx.state
        gd = _norm_input_grad(s, grad)
        if gd is None:
            return None, None, None
        ga = input_grad(gd, s.layout, ctx.a_spec) if ctx.needs_input_grad[0] else None
        gb = input_grad(gd.neg(), s.layout, ctx.b_spec) if ctx.needs_input_grad[1] else None
        return ga, gb, None


# ------------------------------------------------------------------ torch-level and aten-level entry points


# torch's forms, with aten's names
def _vector_norm_call(self, ord=2, dim=None, keepdim=False, dtype=None, *, out=None): ...  # noqa: E704
def _norm_call(self, p="fro", dim=None, keepdim=False, dtype=None, *, out=None): ...  # noqa: E704
def _dist_call(self, other, p=2): ...  # noqa: E704


_ALIASES = {"input": "self", "x": "self"}


@torch_level(*NORM_OPS, apply=_VectorNormFunction.apply)  # torch.ops.aten.* called directly get the same backward
@torch_level(
    torch.norm,
    torch.Tensor.norm,
    signature=CallSignature(_norm_call, aliases=_ALIASES),
    apply=_VectorNormFunction.apply,
)
@torch_level(
    torch.linalg.vector_norm,
    signature=CallSignature(_vector_norm_call, aliases=_ALIASES),
    apply=_VectorNormFunction.apply,
)
def _parse_norm(b: dict, *_) -> tuple | None:
    """(x, p, dims, keepdim, dtype) of a differentiable vector_norm/norm call; None: not ours."""
    x = b["self"]
    if b.get("out") is not None or not isinstance(x, torch.Tensor) or x.ndim == 0:
        return None
    p, dim = (b["ord"] if "ord" in b else b["p"]), b.get("dim")
    if isinstance(p, str):
        if p != "fro" or not (dim is None or isinstance(dim, int) or len(dim) <= 2):
            return None
        p = 2.0
    dims = reduced_dims(dim, x.ndim, "norm")
    if dims is None or not x.dtype.is_floating_point or not needs_grad(x):
        return None
    return x, 2.0 if p is None else float(p), dims, bool(b.get("keepdim", False)), b.get("dtype")


def _as_dtensor(t, other):
    """A plain operand as Replicate on the other's mesh (as dispatch takes it); None if it needs a gradient."""
    if isinstance(t, DTensor):
        return t
    if t.requires_grad or not isinstance(other, DTensor):
        return None
    check_plain_operand(aten.dist.default, t)  # torch's rule for plain operands beside DTensors
    mesh = spec_of(other).mesh
    return wrap(t, TensorSpec(mesh, (R,) * mesh.ndim, TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype)))


@torch_level(
    torch.dist,
    torch.Tensor.dist,
    aten.dist.default,
    signature=CallSignature(_dist_call, aliases=_ALIASES),
    apply=_DistFunction.apply,
)
def _parse_dist(b: dict, *_) -> tuple | None:
    """(a, b, p) of a differentiable dist of equal shapes; None: not ours (broadcasting dist: torch's formula)."""
    x, y, p = b["self"], b["other"], b["p"]
    tensors = all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in (x, y))
    if not tensors or not needs_grad(x, y) or x.shape != y.shape or x.ndim == 0:
        return None
    x, y = _as_dtensor(x, y), _as_dtensor(y, x)
    if x is None or y is None:
        return None
    return x, y, 2.0 if p is None else float(p)


# linalg__powsum (torch 2.13): sum(|x|^ord) over dims, a linear reduction of a pointwise op, so on
# DTensors it is that pair of ops (a sharded dim gives a pending sum, no collective). _foreach_powsum
# is the same per tensor. torch defines no derivative for either.
@decomposition(aten.linalg__powsum.default)
def _powsum(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dtype is not None:
        x = aten._to_copy.default(x, dtype=dtype)
    powered = aten.pow.Tensor_Scalar(aten.abs.default(x), ord)
    return aten.sum.dim_IntList(powered, dim if dim is not None else [], keepdim)


@decomposition(aten._foreach_powsum.Scalar)
def _foreach_powsum(tensors, ord=2, dtype=None):
    return [_powsum(t, ord, dtype=dtype) for t in tensors]
