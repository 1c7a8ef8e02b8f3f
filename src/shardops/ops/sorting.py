"""topk, sort and argsort over any dim, forward and backward, on any layout.

Rows for one mesh dim; p = a shard placement of input dim e, `dim` = the sorted dim:

    topk (self)                         (values, indices)
      p, e != dim   local                    p, p
      p, e == dim   sharded top-k            R, R    1 round: every rank's local top-k, with
                                                     GLOBAL indices, packed (values and indices
                                                     as bytes) in one all_gather; top-k of those
    sort / sort.stable (self)           (values, indices)
      p, e != dim   local                    p, p
      p, e == dim   gather the dim, sort     p, p    1 round: an all_gather of the dim (the
                                                     same bytes as gathering the input), then
                                                     torch's own sort of the whole rows, and
                                                     each rank keeps its slice: the outputs stay
                                                     sharded for free
argsort reaches the dispatcher as sort.stable (it is composite).

Ties. torch's CPU topk breaks ties by an unspecified order (std::nth_element /
partial_sort compare values only: topk([3,3,3,...], 5) may return indices
[10, 7, 9, 6, 11]), so no sharded algorithm can reproduce it. The sharded top-k
breaks ties by the smallest global index, as a stable sort does: the values equal
torch's bitwise, the indices are those of sort(x, stable=True)[..., :k]. (The local
rows run torch's topk itself, so they give torch's own indices.) sort over a sharded
dim runs torch's sort on the whole rows, so its indices are torch's, stable or not.

Backward: torch's formula scatters the values' gradient into a full-size `new_zeros`.
torch.topk / torch.sort (and the Tensor methods) on DTensors therefore enter
`_SelectAlongDim`, whose backward puts each gradient on the rank that owns its global
index: the input's gradient keeps the input's layout and no full-size temporary is
made (for sort over a sharded dim, one packed all_gather of (grad, index) rows first:
the sorted output is as large as the input).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..dispatch.registry import replicate_when, strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema, normalize_dim
from ..errors import ShardingError
from ..placements import Placement, Replicate, Shard, StridedShard, dim_positions, without_partials
from ..planner.rows import Row, row
from ..redistribute import redistribute_local
from ..spec import TensorMeta, TensorSpec, contiguous_stride
from ..tensor import DTensor, dispatch
from ..wrapping import local_of, shard_in, spec_of, wrap
from .common import (
    all_gather_packed,
    global_index_tensor,
    global_positions,
    member_coordinates,
    member_shapes,
    mesh_dims_sharding,
    shard_placements,
)

aten = torch.ops.aten
R = Replicate()

LABEL_TOPK = "sharded topk: local top-k with global indices, one all_gather of k per rank"
LABEL_SORT = "sharded sort: all_gather the sorted dim, sort whole rows, keep own slice"


# ------------------------------------------------------------------ helpers


def _wire_index_dtype(n: int) -> torch.dtype:
    """Global indices travel as int32 where they fit (a third fewer bytes for float32 values)."""
    return torch.int32 if n < 2**31 else torch.int64


def _avg_local_numel(spec: TensorSpec, skip_dim: int | None = None) -> float:
    """Elements per rank on average (without `skip_dim`): the same figure on every rank,
    and the one the redistribution planner uses, so rows and plans compare fairly.

    NOTE: assumes the other dims keep their current sharding, which is the usual choice.
    """
    dims = [d for d in range(spec.ndim) if d != skip_dim]
    parts = math.prod(
        n for n, p in zip(spec.mesh.shape, spec.placements) if isinstance(p, (Shard, StridedShard)) and p.dim in dims
    )
    return math.prod(spec.shape[d] for d in dims) / parts


def _gather_dim(
    tensors: Sequence[torch.Tensor], spec: TensorSpec, dim: int, mesh_dims: Sequence[int]
) -> list[torch.Tensor]:
    """Whole rows along `dim`, in global order, of tensors laid out like `spec` (one collective)."""
    if not mesh_dims:
        return list(tensors)
    shapes = member_shapes(spec, mesh_dims)
    coords = member_coordinates(spec, mesh_dims)
    pieces = all_gather_packed(tensors, spec, mesh_dims, shapes)
    positions = [p for c in coords for p in dim_positions(spec.shape[dim], dim, spec.mesh.shape, c, spec.placements)]
    in_order = positions == list(range(len(positions)))
    out = []
    for k in range(len(tensors)):
        whole = torch.cat([piece[k] for piece in pieces], dim=dim)
        if not in_order:  # StridedShard: put every element back at its global position
            whole = torch.empty_like(whole).index_copy_(dim, torch.tensor(positions, device=whole.device), whole)
        out.append(whole)
    return out


# ------------------------------------------------------------------ topk


def _stable_local_topk(x: torch.Tensor, k: int, dim: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's best min(k, len) along `dim`, ties broken by the smallest index."""
    kk = min(k, x.shape[dim])
    if kk == 0 or kk == x.shape[dim]:
        v, i = torch.sort(x, dim=dim, descending=largest, stable=True)
        return v.narrow(dim, 0, kk), i.narrow(dim, 0, kk)
    v, i = torch.topk(x, kk, dim, largest, sorted=True)
    kth = v.narrow(dim, kk - 1, 1)
    same = lambda t: (t == kth) | (t.isnan() & kth.isnan())  # noqa: E731
    if torch.equal(same(x).sum(dim), same(v).sum(dim)):
        return v, i  # no tie is cut at the boundary: the chosen set is the stable one
    v, i = torch.sort(x, dim=dim, descending=largest, stable=True)
    return v.narrow(dim, 0, kk), i.narrow(dim, 0, kk)


def _merge_candidates(values: torch.Tensor, index: torch.Tensor, k: int, dim: int, largest: bool, n: int):
    """Top-k of gathered candidates: valid first, then by value, then by global index."""
    keys = (lambda: index, lambda: values, lambda: (index >= n).to(torch.uint8))  # read after each reorder
    for key, desc in zip(keys, (False, largest, False)):
        order = key().argsort(dim=dim, descending=desc, stable=True)
        values, index = values.gather(dim, order), index.gather(dim, order)
    return values.narrow(dim, 0, k), index.narrow(dim, 0, k)


def _topk_sharded(ctx, x, *args, **kwargs):
    schema = ctx.schema
    spec = ctx.in_specs[0]
    dim, k, largest = schema.dim("dim"), int(schema.arg("k")), bool(schema.arg("largest", True))
    n = spec.shape[dim]
    v, i = _stable_local_topk(x, k, dim, largest)
    gi = global_index_tensor(spec, dim, x.device)[i].to(_wire_index_dtype(n))
    missing = k - v.shape[dim]
    if missing:  # short shard: pad with invalid candidates (index n), so every rank sends k
        shape = list(v.shape)
        shape[dim] = missing
        v = torch.cat([v, v.new_zeros(shape)], dim)
        gi = torch.cat([gi, gi.new_full(shape, n)], dim)
    pieces = all_gather_packed([v, gi], spec, mesh_dims_sharding(spec, dim))
    values = torch.cat([p[0] for p in pieces], dim)
    index = torch.cat([p[1] for p in pieces], dim)
    values, index = _merge_candidates(values, index, k, dim, largest, n)
    return values, index.to(torch.int64)


@strategy(aten.topk.default, algorithms=[LABEL_TOPK])
def _topk_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    if spec.ndim == 0:
        return []
    dim, k = schema.dim("dim"), int(schema.arg("k"))
    index_bytes = torch.empty((), dtype=_wire_index_dtype(spec.shape[dim])).element_size()
    nbytes = _avg_local_numel(spec, skip_dim=dim) * k * (spec.itemsize + index_bytes)
    rows = []
    for p in shard_placements(spec):
        if p.dim != dim:
            rows.append(row([p, p], p))
        else:
            rows.append(row([R, R], p, _topk_sharded, comm=[("all_gather", nbytes)], label=LABEL_TOPK))
    return rows


# ------------------------------------------------------------------ sort


def _sort_sharded(ctx, x, *args, **kwargs):
    spec = ctx.in_specs[0]
    dim = ctx.schema.dim("dim")
    (whole,) = _gather_dim([x], spec, dim, mesh_dims_sharding(spec, dim))
    out = ctx.func(whole, *args, **kwargs)  # torch's own sort of the whole rows: its exact result
    keep = global_positions(ctx.out_specs[0], dim)
    if isinstance(keep, range):
        return tuple(o.narrow(dim, keep.start, len(keep)) for o in out)
    where = torch.tensor(keep, dtype=torch.int64, device=x.device)
    return tuple(o.index_select(dim, where) for o in out)


@strategy(aten.sort.default, aten.sort.stable, algorithms=[LABEL_SORT])
def _sort_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    if spec.ndim == 0:
        return []
    dim = schema.dim("dim")
    nbytes = _avg_local_numel(spec) * spec.itemsize
    rows = []
    for p in shard_placements(spec):
        if p.dim != dim:
            rows.append(row([p, p], p))
        else:
            rows.append(row([p, p], p, _sort_sharded, comm=[("all_gather", nbytes)], label=LABEL_SORT))
    return rows


@replicate_when(aten.sort.default, aten.sort.stable)
def _sorts_a_sharded_dim(schema: OpSchema) -> bool:
    """sort/argsort over a sharded dim: its only algorithm gathers that dim (strict mode asks so.allow_replicate)."""
    spec = schema.self_spec
    return spec.ndim > 0 and any(
        isinstance(p, (Shard, StridedShard)) and p.dim == schema.dim("dim") for p in spec.placements
    )


# ------------------------------------------------------------------ backward: scatter to the owner


def _as_dtensor(t, mesh) -> DTensor:
    """A plain gradient is the whole tensor: Replicate."""
    if isinstance(t, DTensor):
        return t
    return wrap(t, TensorSpec(mesh, (R,) * mesh.ndim, TensorMeta(tuple(t.shape), contiguous_stride(t.shape), t.dtype)))


def _local_in(t: DTensor, placements: Sequence[Placement]) -> torch.Tensor:
    return local_of(t) if spec_of(t).placements == tuple(placements) else shard_in(t, placements)


def _relaid(local: torch.Tensor, spec: TensorSpec, src: Sequence[Placement], dst: Sequence[Placement]) -> torch.Tensor:
    meta = TensorMeta(spec.shape, contiguous_stride(spec.shape), local.dtype)
    return redistribute_local(local, TensorSpec(spec.mesh, tuple(src), meta), tuple(dst))


def _rows_of(values_grad, index: DTensor, dim: int, x_layout: Sequence[Placement]):
    """(grad, index) locals holding whole rows along `dim`, and their layout.

    Mesh dims that shard `dim` are gathered (one packed collective); where the
    gradient is replicated and the input is sharded on another dim, rows are sliced
    (free). Everything else keeps the gradient's layout; a pending gradient is settled.
    """
    values_grad = _as_dtensor(values_grad, spec_of(index).mesh)
    layout = without_partials(spec_of(values_grad).placements)
    g, i = _local_in(values_grad, layout), _local_in(index, layout)
    spec = spec_of(values_grad).with_placements(layout)
    gathered = mesh_dims_sharding(spec, dim)
    g, i = _gather_dim([g, i], spec, dim, gathered)
    whole = [R if m in gathered else p for m, p in enumerate(layout)]
    sliced = [
        p if whole[m].is_replicate() and isinstance(p, (Shard, StridedShard)) and p.dim != dim else whole[m]
        for m, p in enumerate(x_layout)
    ]
    if sliced != whole:
        g, i = _relaid(g, spec, whole, sliced), _relaid(i, spec, whole, sliced)
    return g, i, tuple(sliced)


def _scatter_to_owner(values_grad, index: DTensor, x_spec: TensorSpec, dim: int) -> DTensor:
    """The input's gradient: each rank scatters the gradients whose global index it owns."""
    x_layout = without_partials(x_spec.placements)
    g, i, rows_layout = _rows_of(values_grad, index, dim, x_layout)
    # where the rows are whole on a mesh dim, the input's split of `dim` there is taken by index
    out_layout = tuple(x_layout[m] if p.is_replicate() else p for m, p in enumerate(rows_layout))
    out_spec = TensorSpec(x_spec.mesh, out_layout, TensorMeta(x_spec.shape, contiguous_stride(x_spec.shape), g.dtype))
    mine = global_positions(out_spec, dim)
    size = len(mine)
    if isinstance(mine, range):
        local = i - mine.start
        local = torch.where((local >= 0) & (local < size), local, size)
    else:
        lookup = torch.full((x_spec.shape[dim] + 1,), size, dtype=torch.int64, device=i.device)
        lookup[torch.tensor(list(mine), dtype=torch.int64, device=i.device)] = torch.arange(size, device=i.device)
        local = lookup[i]
    shape = list(out_spec.local_shape())
    shape[dim] = size + 1  # one spare slot takes every gradient this rank does not own
    grad = g.new_zeros(shape).scatter_(dim, local, g).narrow(dim, 0, size).contiguous()
    if out_layout != x_layout:
        grad = redistribute_local(grad, out_spec, x_layout)
    return wrap(grad, out_spec.with_placements(x_layout))


class _SelectAlongDim(torch.autograd.Function):
    """topk / sort on DTensors: the op as planned by the dispatcher, and a sharded backward."""

    @staticmethod
    def forward(ctx, x, op, args, kwargs, dim):
        values, indices = dispatch(op, (x,) + tuple(args), dict(kwargs))
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.x_spec, ctx.dim = spec_of(x), dim
        return values, indices

    @staticmethod
    def backward(ctx, values_grad, _indices_grad):
        if values_grad is None or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        (indices,) = ctx.saved_tensors
        if ctx.x_spec.ndim == 0:  # a 0-dim input is its own single value: the gradient passes through
            return values_grad, None, None, None, None
        return _scatter_to_owner(values_grad, indices, ctx.x_spec, ctx.dim), None, None, None, None


# torch's forms, with aten's names
def _topk_call(self, k, dim=-1, largest=True, sorted=True, *, out=None): ...  # noqa: E704
def _sort_call(self, dim=-1, descending=False, *, stable=None, out=None): ...  # noqa: E704


def _apply_select(x, op, args, kwargs, dim, result_type):
    return result_type(_SelectAlongDim.apply(x, op, args, kwargs, dim))


@torch_level(
    torch.topk, torch.Tensor.topk, signature=CallSignature(_topk_call, aliases={"input": "self"}), apply=_apply_select
)
def _parse_topk(b: dict, *_) -> tuple | None:
    """torch.topk / Tensor.topk on a DTensor: the planned op and a sharded backward (see the module docstring)."""
    x, k = b["self"], b["k"]
    if b.get("out") is not None or not isinstance(x, DTensor):
        return None
    d = normalize_dim(b["dim"], x.ndim, "topk")
    size = x.shape[d] if x.ndim else 1
    if not 0 <= k <= size:
        raise ShardingError(
            f"topk: k={k} is out of range for dim {d} of size {size} of {spec_of(x)!r}; use 0 <= k <= {size}."
        )
    return x, aten.topk.default, (k, d, b["largest"], b["sorted"]), {}, d, torch.return_types.topk


@torch_level(
    torch.sort, torch.Tensor.sort, signature=CallSignature(_sort_call, aliases={"input": "self"}), apply=_apply_select
)
def _parse_sort(b: dict, *_) -> tuple | None:
    """torch.sort / Tensor.sort on a DTensor (see the module docstring)."""
    x, stable = b["self"], b["stable"]
    if b.get("out") is not None or not isinstance(x, DTensor):
        return None
    d = normalize_dim(b["dim"], x.ndim, "sort")
    if stable is None:  # the overload torch itself picks
        return x, aten.sort.default, (d, b["descending"]), {}, d, torch.return_types.sort
    return (
        x,
        aten.sort.stable,
        (),
        {"stable": stable, "dim": d, "descending": b["descending"]},
        d,
        torch.return_types.sort,
    )
