"""cat and stack: shards of the other dims pass through; identical pending reductions pass through.

Rows for one mesh dim:
    S(k) ... S(k) -> S(k')     k any dim but cat's dim (stack: every input dim; k' skips the new dim)
    P ... P -> P               cat/stack only move values, so a pending reduction passes as it is
                               (Partial(op) and NormPartial(p); a Replicate operand becomes P(op)
                               by the planner's free partition step)
Along the cat dim itself the inputs are redistributed (the implicit Replicate row).

NormPartial and Replicate: the planner cannot turn Replicate into NormPartial (it is a
source-only placement), yet clip_grad_norm_ stacks per-tensor norms that are pending on
some mesh dims and replicated on others. The torch-level torch.stack/cat entry aligns them
first, locally: a replicated value becomes NormP(p) by keeping it on coordinate 0 and the
neutral value (0, or +inf for p < 0 / -inf) elsewhere, exactly what a p-norm of p-norms
ignores. The stacked norms then stay pending together, and clip_grad_norm_'s total norm
costs one all-reduce per mesh dim that shards any gradient, not one per tensor.
"""
from __future__ import annotations

import torch

from ..dispatch.registry import register, register_torch_function
from ..dispatch.schema import OpSchema, normalize_dim
from ..dispatch.strategy import Row, row
from ..placements import NormPartial, Partial, Replicate, Shard
from ._shard_stats import call_default, needs_grad, norm_neutral

aten = torch.ops.aten
R = Replicate()
PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"))


def _concat_rule(schema: OpSchema) -> list[Row]:
    specs = schema.tensor_specs
    stack = schema.op._schema.name.endswith("stack")
    ndim = max(s.ndim for s in specs)
    d = normalize_dim(schema.arg("dim", 0), ndim + 1 if stack else ndim, schema.name)
    # torch.cat skips 1-d empty tensors whatever the others' rank (legacy): they stay Replicate
    legacy = [not stack and s.ndim == 1 and s.shape[0] == 0 and ndim > 1 for s in specs]
    rows = []
    for k in range(ndim):
        if not stack and k == d:
            continue
        out_k = k + 1 if stack and k >= d else k
        rows.append(row(Shard(out_k), [R if skip else Shard(k) for skip in legacy]))
    norms = tuple(sorted({p for s in specs for p in s.placements if isinstance(p, NormPartial)}, key=repr))
    pending = PARTIALS + (norms if not any(legacy) else ())
    rows += [row(p, [p] * len(specs)) for p in pending]
    return rows


# ------------------------------------------------------------------ torch-level alignment of pending norms


def _neutral_off_origin(local: torch.Tensor, p: NormPartial, coordinate: int) -> torch.Tensor:
    return local if coordinate == 0 else torch.full_like(local, norm_neutral(p))


def align_pending_norms(tensors):
    """Replicate operands become NormP(p) on mesh dims where the others are NormP(p) (local, exact)."""
    from ..tensor import DTensor

    if not tensors or not all(isinstance(t, DTensor) for t in tensors) or needs_grad(*tensors):
        return tensors
    mesh = tensors[0]._spec.mesh
    if any(t._spec.mesh != mesh for t in tensors):
        return tensors
    coord = mesh.get_coordinate()
    locals_ = [t._local_tensor for t in tensors]
    placements = [list(t._spec.placements) for t in tensors]
    for i in range(mesh.ndim):
        kinds = {pl[i] for pl in placements if isinstance(pl[i], NormPartial)}
        if len(kinds) != 1 or not all(pl[i] in kinds or pl[i].is_replicate() for pl in placements):
            continue
        p = kinds.pop()
        for k, pl in enumerate(placements):
            others = {q for j, q in enumerate(pl) if j != i and q.is_partial()}
            if pl[i].is_replicate() and others <= {p}:
                locals_[k] = _neutral_off_origin(locals_[k], p, coord[i])
                pl[i] = p
    return [
        t if tuple(pl) == t._spec.placements else DTensor._make(loc, t._spec.with_placements(pl))
        for t, loc, pl in zip(tensors, locals_, placements)
    ]


class _CatWithLegacyEmpty(torch.autograd.Function):
    """torch.cat whose inputs include a 1-d empty DTensor that needs a gradient.

    torch's cat backward makes such an input's gradient with at::zeros, a factory that never
    reaches DTensor dispatch: the gradient would be a plain tensor. Here every gradient is a
    DTensor: a slice of the output's gradient, or an empty DTensor laid out like the input.
    """

    @staticmethod
    def forward(ctx, dim: int, *tensors):
        ctx.dim = dim
        ctx.specs = [t._spec for t in tensors]
        ctx.legacy = [t.ndim == 1 and t.shape[0] == 0 for t in tensors]
        return aten.cat.default(list(tensors), dim)

    @staticmethod
    def backward(ctx, grad):
        from ..tensor import DTensor

        grads, offset = [], 0
        for spec, legacy in zip(ctx.specs, ctx.legacy):
            if legacy:
                local = grad._local_tensor.new_zeros(spec.local_shape())
                grads.append(DTensor._make(local, spec.with_placements(tuple(R if p.is_partial() else p for p in spec.placements))))
                continue
            size = spec.shape[ctx.dim]
            grads.append(aten.slice.Tensor(grad, ctx.dim, offset, offset + size))
            offset += size
        return (None, *grads)


def _legacy_empty_needs_grad(tensors, args, kwargs) -> bool:
    from ..tensor import DTensor

    return (
        torch.is_grad_enabled()
        and all(isinstance(t, DTensor) for t in tensors)
        and any(t.ndim == 1 and t.shape[0] == 0 and t.requires_grad for t in tensors)
        and len({t._spec.mesh for t in tensors}) == 1
        and not kwargs
        and len(args) <= 1
    )


def _concat_entry(func):
    def entry(tensors, *args, **kwargs):
        if kwargs.get("out") is None and isinstance(tensors, (list, tuple)):
            tensors = align_pending_norms(list(tensors))
            if func is not torch.stack and _legacy_empty_needs_grad(tensors, args, kwargs):
                ndim = max(t.ndim for t in tensors)
                dim = normalize_dim(args[0] if args else 0, ndim, "cat")
                return _CatWithLegacyEmpty.apply(dim, *tensors)
        return call_default(func, (tensors, *args), kwargs)

    return entry


# ------------------------------------------------------------------ registration

register(_concat_rule, aten.cat.default, aten.stack.default)
for _func in (torch.stack, torch.cat, torch.concat, torch.concatenate):
    register_torch_function(_concat_entry(_func), _func)
