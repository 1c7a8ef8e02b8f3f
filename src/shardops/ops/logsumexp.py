"""logsumexp over sharded dims: ONE all_gather of per-shard (max, sum exp(x - max)) pairs.

Every rank reduces its shard to a shift m_r (its max, or 0 where that max is infinite, as
torch does) and s_r = sum exp(x - m_r), packs both in one tensor, gathers them over the
mesh dims that shard reduced dims (one round), and merges locally:

    M = max over members with s_r > 0 of m_r    (0 if none)
    logsumexp = log(sum_r s_r exp(m_r - M)) + M

Members with nothing to add (empty shards, all -inf rows) have s_r = 0 and are left out
of M, so a row whose values sit near -1e4 does not underflow against an empty shard's 0.
+inf gives +inf, NaN gives NaN, all -inf gives -inf, like torch.

Backward: grad * exp(x - result), local given the replicated result. torch's formula would
do the same through pointwise ops, but it reads the input as autograd saved it: a pending
(Partial) input would be resolved again in backward and its gradient would come back in
whatever layout those ops chose. The torch-level entry points use their own
autograd.Function, which keeps the resolved input: no communication, the gradient in the
input's layout (Replicate for a pending input).
"""

from __future__ import annotations

import math

import torch

from ..dispatch.registry import strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema, normalize_dim
from ..placements import Replicate, Shard
from ..planner.rows import Row, row
from ..wrapping import local_of, shard_in, spec_of
from ._shard_stats import (
    grad_local,
    input_grad,
    needs_grad,
    reduction_layouts,
    reduction_stats_bytes,
    resolve_partials,
    to_layout,
    unsqueeze_reduced,
)
from .common import all_gather_stacked, mesh_dims_sharding, opmath_dtype, shift_after_reduce

aten = torch.ops.aten
R = Replicate()
LABEL_LSE = "sharded logsumexp"


def _shard_pair(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift, sum exp(x - shift)) over `dims`, keepdim; an empty shard gives (0, 0)."""
    if math.prod(x.shape[d] for d in dims) == 0:
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
        zeros = torch.zeros(shape, dtype=x.dtype, device=x.device)
        return zeros, zeros.clone()
    m = x.amax(dims, keepdim=True)
    m = m.masked_fill(m.abs() == math.inf, 0)
    return m, (x - m).exp().sum(dims, keepdim=True)


def merge_pairs(shifts: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """log-sum-exp of members' (shift, sum) pairs stacked on dim 0 (keepdim shape)."""
    live = sums > 0
    top = torch.where(live, shifts, -math.inf).amax(0)
    top = top.masked_fill(top == -math.inf, 0)
    scaled = torch.where(live, sums * (shifts - top).exp(), sums)
    return scaled.sum(0).log() + top


def _logsumexp_sharded(ctx, x, *args, **kwargs):
    spec = ctx.in_specs[0]
    dims = ctx.schema.dims("dim")
    keepdim = bool(ctx.schema.arg("keepdim", False))
    out_dtype = ctx.out_specs[0].dtype
    xc = x.to(opmath_dtype(out_dtype))
    shifts, sums = all_gather_stacked(list(_shard_pair(xc, dims)), spec, mesh_dims_sharding(spec, dims))
    out = merge_pairs(shifts, sums)
    if not keepdim:
        out = out.squeeze(dims)
    return out.to(out_dtype)


@strategy(aten.logsumexp.default, algorithms=[LABEL_LSE])
def _logsumexp_rule(schema: OpSchema) -> list[Row]:
    """Rows: S(k) -> S(k shifted) for kept dims (local); S(k) -> R for reduced dims
    (one all_gather of a (shift, sum) pair per output element)."""
    spec = schema.self_spec
    dims = schema.dims("dim")
    keepdim = bool(schema.arg("keepdim", False))
    rows = [row(shift_after_reduce(Shard(k), dims, keepdim), Shard(k)) for k in range(spec.ndim) if k not in dims]
    if not spec.dtype.is_complex:
        dtype = opmath_dtype(spec.dtype if spec.dtype.is_floating_point else torch.get_default_dtype())
        per_row = 2 * torch.empty((), dtype=dtype).element_size()
        comm = [("all_gather", reduction_stats_bytes(spec, dims, per_row))]
        rows += [row(R, Shard(k), algorithm=_logsumexp_sharded, comm=comm, label=LABEL_LSE) for k in dims]
    return rows


# ------------------------------------------------------------------ backward


class _LogsumexpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dims: tuple[int, ...], keepdim: bool):
        x_in = resolve_partials(x)
        out = aten.logsumexp.default(x_in, list(dims), keepdim)
        ctx.dims, ctx.keepdim, ctx.x_spec, ctx.out_spec = dims, keepdim, spec_of(x), spec_of(out)
        ctx.layout, ctx.out_layout = reduction_layouts(spec_of(x_in), dims, keepdim)
        ctx.x_local = shard_in(x_in, ctx.layout)
        ctx.out_local = local_of(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        nd = len(ctx.x_spec.shape)

        def full(t):
            return unsqueeze_reduced(t, nd, ctx.dims, ctx.keepdim)

        g = full(grad_local(grad, ctx.out_spec, ctx.out_layout))
        lse = full(to_layout(ctx.out_local, ctx.out_spec, ctx.out_layout))
        return input_grad(g * (ctx.x_local - lse).exp(), ctx.layout, ctx.x_spec), None, None


def _logsumexp_call(self, dim=None, keepdim=False, *, out=None): ...  # noqa: E704  (torch's forms, aten's names)


@torch_level(
    torch.logsumexp,
    torch.Tensor.logsumexp,
    torch.special.logsumexp,
    aten.logsumexp.default,
    signature=CallSignature(_logsumexp_call, aliases={"input": "self"}),
    apply=_LogsumexpFunction.apply,
)
def _parse_logsumexp(b: dict, *_):
    """(input, dims, keepdim) of a differentiable logsumexp call; None: not ours."""
    x, dim = b["self"], b["dim"]
    if b.get("out") is not None or not isinstance(x, torch.Tensor) or x.ndim == 0 or dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims or not all(isinstance(d, int) for d in dims):
        return None
    dims = tuple(sorted({normalize_dim(d, x.ndim, "logsumexp") for d in dims}))
    if not x.dtype.is_floating_point or not needs_grad(x):
        return None
    return x, dims, bool(b["keepdim"])
