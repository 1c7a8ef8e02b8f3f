"""View and shape ops: a sharded dim passes through where it maps cleanly.

Each rule maps an input shard dim to an output dim, or gives none (then the
input is redistributed first). Every pending partial passes through a view:
a view moves values, it never combines them.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..dispatch.registry import register
from ..dispatch.schema import OpSchema, normalize_dim
from ..dispatch.strategy import Row, row
from ..placements import NormPartial, Partial, Replicate, Shard, StridedShard

aten = torch.ops.aten
R = Replicate()
PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"))


def _partial_rows(schema: OpSchema, n_out: int = 1) -> list[Row]:
    norms = {p for s in schema.tensor_specs for p in s.placements if isinstance(p, NormPartial)}
    return [row([p] * n_out, p) for p in PARTIALS + tuple(sorted(norms, key=repr))]


def _with_local_size(ctx, local, *args, **kwargs):
    """view/reshape/expand take a global size; the local kernel needs this rank's size."""
    size = list(ctx.out_specs[0].local_shape())
    if ctx.schema.op is aten.expand.default:
        return ctx.func(local, size, **kwargs)
    return ctx.func(local, size)


def _squeeze_global_dims(ctx, local, *args, **kwargs):
    """squeeze() drops the GLOBAL size-1 dims: a short shard's local size 1 must stay."""
    shape = ctx.schema.self_spec.shape
    dims = ctx.schema.arg("dim")
    dims = [dims] if isinstance(dims, int) else dims  # squeeze.dim / squeeze_.dim take one int
    dims = range(len(shape)) if dims is None else [d % max(len(shape), 1) for d in dims]
    squeeze = aten.squeeze_.dims if ctx.schema.op is aten.squeeze_.dim else aten.squeeze.dims
    return squeeze(local, [d for d in dims if shape[d] == 1])


def _dim_map_rule(mapping: Callable[[OpSchema], dict[int, int]], n_out: int = 1, local_size: bool = False, algorithm=None):
    """A rule from {input dim: output dim} (dims absent from the map need Replicate)."""
    algo = _with_local_size if local_size else algorithm

    def rule(schema: OpSchema) -> list[Row]:
        rows = [row([Shard(o)] * n_out, Shard(i), algorithm=algo) for i, o in mapping(schema).items()]
        return rows + _partial_rows(schema, n_out)

    return rule


def _unsqueeze(schema: OpSchema) -> dict[int, int]:
    nd = schema.self_spec.ndim
    d = normalize_dim(schema.arg("dim"), nd + 1, schema.name)
    return {i: (i if i < d else i + 1) for i in range(nd)}


def _squeeze(schema: OpSchema) -> dict[int, int]:
    spec = schema.self_spec
    shape = spec.shape
    raw = schema.arg("dim")
    if raw is None:
        dropped = {i for i, s in enumerate(shape) if s == 1}
    else:
        dims = (raw,) if isinstance(raw, int) else tuple(raw)
        dropped = {normalize_dim(d, spec.ndim, schema.name) for d in dims if shape[normalize_dim(d, spec.ndim, schema.name)] == 1}
    kept = [i for i in range(spec.ndim) if i not in dropped]
    return {i: kept.index(i) for i in kept}


def _permute(schema: OpSchema) -> dict[int, int]:
    nd = schema.self_spec.ndim
    dims = [normalize_dim(d, nd, schema.name) for d in schema.arg("dims")]
    return {src: out for out, src in enumerate(dims)}


def _transpose(schema: OpSchema) -> dict[int, int]:
    nd = schema.self_spec.ndim
    if schema.op in (aten.t.default,):
        a, b = (0, 1) if nd == 2 else (0, 0)
    else:
        a, b = normalize_dim(schema.arg("dim0"), nd, schema.name), normalize_dim(schema.arg("dim1"), nd, schema.name)
    m = {i: i for i in range(nd)}
    m[a], m[b] = b, a
    return m


def _expand(schema: OpSchema) -> dict[int, int]:
    spec = schema.self_spec
    size = list(schema.arg("size"))
    lead = len(size) - spec.ndim
    return {i: i + lead for i in range(spec.ndim) if size[i + lead] in (-1, spec.shape[i]) and spec.shape[i] != 1}


def _keep_other_dims(arg: str) -> Callable[[OpSchema], dict[int, int]]:
    """select/slice/narrow/split-like: every dim but `arg`'s keeps its shard (select drops it)."""

    def mapping(schema: OpSchema) -> dict[int, int]:
        nd = schema.self_spec.ndim
        d = normalize_dim(schema.arg(arg, 0), nd, schema.name)
        drop = schema.op in (aten.select.int, aten.unbind.int)
        return {i: (i - (1 if drop and i > d else 0)) for i in range(nd) if i != d}

    return mapping


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input and output dims whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if (pi == pj and gi and gj) or (i >= len(src) and j >= len(dst)):
                break
            if pi <= pj and i < len(src) or j >= len(dst):
                pi *= src[i]
                gi.append(i)
                i += 1
            else:
                pj *= dst[j]
                gj.append(j)
                j += 1
        # trailing size-1 dims join the group so that every dim belongs somewhere
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _view(schema: OpSchema) -> dict[int, int]:
    spec = schema.self_spec
    src = list(spec.shape)
    size = list(schema.arg("size") if schema.arg("size") is not None else schema.arg("shape"))
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = math.prod(src) // known if known else 0
    mesh_size = spec.mesh.size()
    out: dict[int, int] = {}
    for gi, gj in view_groups(src, size):
        real_in = [i for i in gi if src[i] != 1]
        real_out = [j for j in gj if size[j] != 1]
        if not real_in or not real_out:
            continue
        first_in, first_out = real_in[0], real_out[0]
        # NOTE: only the outermost dim of a group may stay sharded, and only when
        # its chunks land on whole rows of the other side for every mesh size.
        if len(real_in) == 1 and len(real_out) == 1:
            out[first_in] = first_out
        elif len(real_out) == 1 and src[first_in] % mesh_size == 0:
            out[first_in] = first_out  # flatten
        elif len(real_in) == 1 and size[first_out] % mesh_size == 0:
            out[first_in] = first_out  # split
    return out


def _like_rule(schema: OpSchema) -> list[Row]:
    """zeros_like & co: the output takes the input's shards; a partial input gives Replicate."""
    nd = schema.self_spec.ndim
    return [row(Shard(d), Shard(d)) for d in range(nd)] + [row(R, p) for p in _partial_rows_inputs(schema)]


def _partial_rows_inputs(schema: OpSchema):
    norms = {p for s in schema.tensor_specs for p in s.placements if isinstance(p, NormPartial)}
    return PARTIALS + tuple(norms)


def _new_factory_rule(schema: OpSchema) -> list[Row]:
    """new_zeros(size) & co: the input only lends dtype and device; output Replicate."""
    nd = schema.self_spec.ndim
    return [row(R, Shard(d)) for d in range(nd)] + [row(R, p) for p in _partial_rows_inputs(schema)]


def _identity_rule(schema: OpSchema) -> list[Row]:
    """clone/detach/alias/_to_copy/contiguous: every layout passes."""
    nd = schema.self_spec.ndim
    strided = sorted({p for p in schema.self_spec.placements if isinstance(p, StridedShard)}, key=repr)
    rows = [row(Shard(d), Shard(d)) for d in range(nd)] + [row(p, p) for p in strided]  # detach/clone keep _S too
    base = schema.op._schema.name
    if "_to_copy" in base and schema.arg("dtype") is not None and not schema.arg("dtype").is_floating_point:
        return rows + [row(p, p) for p in (Partial("max"), Partial("min"))]
    return rows + _partial_rows(schema)


def _copy_rule(schema: OpSchema) -> list[Row]:
    """self.copy_(src): src follows self's layout (broadcast dims replicated)."""
    dst, src = schema.tensor_specs[0], schema.tensor_specs[1]
    lead = dst.ndim - src.ndim
    rows = []
    for d in range(dst.ndim):
        k = d - lead
        rows.append(row(Shard(d), [Shard(d), R if k < 0 or src.shape[k] != dst.shape[d] else Shard(k)]))
    return rows + [row(p, [p, p]) for p in (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"))]


def _scalar_rule(schema: OpSchema) -> list[Row]:
    return []  # item()/_local_scalar_dense: needs the whole value (the implicit Replicate row)


register(_dim_map_rule(_unsqueeze), aten.unsqueeze.default, aten.unsqueeze_.default)
register(_dim_map_rule(_squeeze, algorithm=_squeeze_global_dims), aten.squeeze.default, aten.squeeze.dims, aten.squeeze.dim, aten.squeeze_.dim)
register(_dim_map_rule(_permute), aten.permute.default)
register(_dim_map_rule(_transpose), aten.transpose.int, aten.t.default, aten.transpose_.default, aten.t_.default)
register(_dim_map_rule(_expand, local_size=True), aten.expand.default)
register(_dim_map_rule(_view, local_size=True), aten.view.default, aten._unsafe_view.default, aten.reshape.default)
register(_dim_map_rule(_keep_other_dims("dim")), aten.select.int, aten.slice.Tensor, aten.narrow.default)
register(_dim_map_rule(_keep_other_dims("dim"), n_out=1), aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default)
register(_like_rule, aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like)  # rand_like, randn_like: ops/random.py
register(_new_factory_rule, aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full)
register(_identity_rule, aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default, aten.contiguous.default, aten.view_as_real.default)
register(_copy_rule, aten.copy_.default)
register(_scalar_rule, aten._local_scalar_dense.default)
