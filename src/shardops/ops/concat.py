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

from functools import partial

import torch

from ..dispatch.registry import call_default, strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema, normalize_dim
from ..placements import NormPartial, Partial, Replicate, Shard
from ..planner.rows import Row, row
from ..tensor import DTensor
from ..wrapping import local_of, spec_of, wrap
from ._shard_stats import needs_grad

aten = torch.ops.aten
R = Replicate()
PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"))


@strategy(aten.cat.default, aten.stack.default)
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


def align_pending_norms(tensors):
    """Replicate operands become NormP(p) on mesh dims where the others are NormP(p) (local, exact)."""
    if not tensors or not all(isinstance(t, DTensor) for t in tensors) or needs_grad(*tensors):
        return tensors
    mesh = spec_of(tensors[0]).mesh
    if any(spec_of(t).mesh != mesh for t in tensors):
        return tensors
    coord = mesh.get_coordinate()
    locals_ = [local_of(t) for t in tensors]
    placements = [list(spec_of(t).placements) for t in tensors]
    for i in range(mesh.ndim):
        kinds = {pl[i] for pl in placements if isinstance(pl[i], NormPartial)}
        if len(kinds) != 1 or not all(pl[i] in kinds or pl[i].is_replicate() for pl in placements):
            continue
        p = kinds.pop()
        for k, pl in enumerate(placements):
            others = {q for j, q in enumerate(pl) if j != i and q.is_partial()}
            if pl[i].is_replicate() and others <= {p}:
                locals_[k] = p.split(locals_[k], coord[i])
                pl[i] = p
    return [
        t if tuple(pl) == spec_of(t).placements else wrap(loc, spec_of(t).with_placements(pl))
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
        ctx.specs = [spec_of(t) for t in tensors]
        ctx.legacy = [t.ndim == 1 and t.shape[0] == 0 for t in tensors]
        return aten.cat.default(list(tensors), dim)

    @staticmethod
    def backward(ctx, grad):

        grads, offset = [], 0
        for spec, legacy in zip(ctx.specs, ctx.legacy):
            if legacy:
                local = local_of(grad).new_zeros(spec.local_shape())
                grads.append(
                    wrap(local, spec.with_placements(tuple(R if p.is_partial() else p for p in spec.placements)))
                )
                continue
            size = spec.shape[ctx.dim]
            grads.append(aten.slice.Tensor(grad, ctx.dim, offset, offset + size))
            offset += size
        return (None, *grads)


def _apply_concat(func, args: tuple, kwargs: dict):
    """torch's ordinary path, except for a cat with a 1-d empty DTensor needing a gradient (see above)."""
    from ..tensor import DTensor

    tensors = args[0] if args else kwargs.get("tensors")
    rest = dict(kwargs)
    rest.pop("tensors", None)
    dim = args[1] if len(args) > 1 else rest.pop("dim", 0)
    if (
        func is not torch.stack
        and torch.is_grad_enabled()
        and not rest
        and isinstance(dim, int)
        and tensors is not None
        and all(isinstance(t, DTensor) for t in tensors)
        and any(t.ndim == 1 and t.shape[0] == 0 and t.requires_grad for t in tensors)
        and len({spec_of(t).mesh for t in tensors}) == 1
    ):
        return _CatWithLegacyEmpty.apply(normalize_dim(dim, max(t.ndim for t in tensors), "cat"), *tensors)
    return call_default(func, args, kwargs)


def _concat_call(tensors, dim=0, *, out=None): ...  # noqa: E704


def _parse_concat(func, b: dict, args: tuple, kwargs: dict) -> tuple | None:
    """The call with its pending norms aligned (a local, exact step); None: nothing to align."""
    tensors = b["tensors"]
    if b.get("out") is not None or not isinstance(tensors, (list, tuple)):
        return None
    aligned = align_pending_norms(list(tensors))
    if args:
        return func, (aligned, *args[1:]), kwargs
    return func, (), {**kwargs, "tensors": aligned}


# each callable's parse knows which one it is (its apply re-calls it)
for _func in (torch.stack, torch.cat, torch.concat, torch.concatenate):
    torch_level(_func, signature=CallSignature(_concat_call, aliases={"axis": "dim"}), apply=_apply_concat)(
        partial(_parse_concat, _func)
    )
