"""Indexing, slicing, padding and reordering ops, and the backward ops they dispatch.

Along a dim that is not sharded these ops are local and keep the layout (0 bytes,
forward and backward). Along a sharded dim every one of them is a re-indexing:
output position j takes input position src[j] (or a fill value), where src is
known on every rank from the op's static arguments (or a replicated index):

    flip         src[j] = N-1-j                  slice      src[j] = start + j*step
    roll         src[j] = (j - shift) mod N      pad/crop   src[j] = j - left   (fill: value)
    repeat       src[j] = j mod N                index_select        src[j] = index[j]
    slice_backward  src[j] = (j-start)/step where it lands on the slice (fill: 0)

`reindex_along` builds this rank's output shard from that map with one all_to_all
that moves only the rows whose owner changes (none when the input is replicated
along the dim, or when every needed row is already here). The result keeps the
plain Shard layout on uneven shards too. The cost model weighs it against
gathering the dim.

Scatter-like ops (scatter, scatter_add, index_add, index_put) along a sharded dim
with a replicated index: each rank applies the entries whose target it owns
(local). Gather-like ops along a sharded dim: each rank picks what it owns, zeros
elsewhere -> Partial(sum). Linear ops (scatter_add, index_add, accumulating
index_put) with the index sharded: each rank adds its part into a pending sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..comm.traceable import graph_constant, tracing, untraced
from ..dispatch.registry import COPYING_VIEW_ALGORITHMS, strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema, normalize_dim
from ..placements import NormPartial, Partial, Placement, Replicate, Shard, dim_positions
from ..planner.rows import Row, row
from ..redistribute import redistribute_local
from ..spec import TensorSpec
from ._shard_stats import needs_grad
from .views import keep_other_dims_rule

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")
ALL_PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"))
LABEL_MOVE = "re-index along the sharded dim: all_to_all of the rows that change owner"
LABEL_OWNER = "each rank applies the entries whose target it owns"
LABEL_PICK = "pick from the shard that holds the index, zeros elsewhere"
LABEL_FROM_REPLICA = "re-index a replica into this rank's shard (local)"
LABEL_OWNER_WRITES = "the rank that owns the selected index writes the gradient (local)"


# ------------------------------------------------------------------ the re-indexing primitive


def _positions(length: int, dim: int, placements: Sequence[Placement], mesh, coord) -> torch.Tensor:
    pos = dim_positions(length, dim, mesh.shape, coord, placements)
    if isinstance(pos, range):
        return torch.arange(pos.start, pos.stop, dtype=torch.long)
    return torch.tensor(pos, dtype=torch.long)


def _sharding_mesh_dims(placements: Sequence[Placement], dim: int) -> set[int]:
    return {i for i, p in enumerate(placements) if p.is_shard(dim)}


def reindex_along(
    local: torch.Tensor,
    mesh,
    dim: int,
    src: tuple[int, int, Sequence[Placement]],
    dst: tuple[int, int, Sequence[Placement]],
    source_of: torch.Tensor | Callable[[], torch.Tensor],
    fill: Any = 0,
) -> torch.Tensor:
    """This rank's shard of `out` along `dim`, where out[j] = in[source_of[j]] (fill where source_of[j] < 0).

    src / dst: (global length, tensor dim, placements) of the input and the output along
    that dim. Every rank computes every member's needs from the replicated map, so the
    only collective is one all_to_all of the rows that change owner; a row a rank holds
    itself is never sent. No collective at all when nothing changes owner.

    `source_of`: the map, or a function that builds it from metadata (flip, roll, pad, slices):
    then the route is planned on plain tensors even while torch.compile traces, and the graph
    holds it as constants. A map computed from data (index_select's index) is data-dependent.
    """
    with untraced():  # the route is metadata: plain tensors, Python ints out (a traced map stays traced)
        route = _reindex_route(mesh, src, dst, source_of() if callable(source_of) else source_of)
    index = lambda rows: graph_constant(rows, local)  # noqa: E731
    out_shape = list(local.shape)
    out_shape[dim] = route.out_len
    out = (
        torch.full(out_shape, fill, dtype=local.dtype, device=local.device)
        if route.out_len
        else local.new_empty(out_shape)
    )
    if route.group is None or not route.moving:
        picked = local.index_select(dim, index(route.send_rows[route.me]))
        return out.index_copy_(dim, index(route.recv_slots[route.me]), picked)
    chunks = [local.index_select(dim, index(rows)) for rows in route.send_rows]
    recv_shapes = []
    for slots in route.recv_slots:
        shape = list(local.shape)
        shape[dim] = len(slots)
        recv_shapes.append(shape)
    received = mesh.comm.all_to_all(chunks, route.group, recv_shapes)
    for part, at in zip(received, route.recv_slots):
        if len(at):
            out.index_copy_(dim, index(at), part.to(out.dtype))
    return out


class _Route(NamedTuple):
    """Who sends which rows to whom along one dim (reindex_along), as this rank sees it."""

    group: Any
    me: int
    out_len: int
    moving: bool  # does any row change owner (else: no collective)
    # index lists: Python ints while torch.compile traces (graph constants), else int64 tensors
    send_rows: list  # per member: the local rows this rank sends it (its own: the rows it keeps)
    recv_slots: list  # per member: the output slots the rows this rank receives from it fill


def _reindex_route(mesh, src, dst, source_of: torch.Tensor) -> _Route:
    (n_in, in_dim, in_pl), (n_out, out_dim, out_pl) = src, dst
    group_dims = sorted(_sharding_mesh_dims(in_pl, in_dim) | _sharding_mesh_dims(out_pl, out_dim))
    coord = mesh.get_coordinate()
    if group_dims:
        group = mesh.group(tuple(group_dims))
        members = [mesh.coordinate_of(r) for r in group.ranks]
        me = group.ranks.index(mesh.get_rank())
    else:
        group, members, me = None, [coord], 0
    in_pos = [_positions(n_in, in_dim, in_pl, mesh, c) for c in members]
    owner = torch.full((n_in,), -1, dtype=torch.long)
    for m in reversed(range(len(members))):
        owner[in_pos[m]] = m
    local_index = torch.full((n_in,), -1, dtype=torch.long)
    local_index[in_pos[me]] = torch.arange(len(in_pos[me]))

    def needs(m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Member m's output slots that take a row, the rows (global), and which member sends each."""
        wanted = source_of[_positions(n_out, out_dim, out_pl, mesh, members[m])]
        slots = (wanted >= 0).nonzero().flatten()
        rows = wanted[slots]
        held = torch.zeros(n_in, dtype=torch.bool)
        held[in_pos[m]] = True
        sender = torch.where(held[rows], torch.full_like(rows, m), owner[rows])
        return slots, rows, sender

    all_needs = [needs(m) for m in range(len(members))]
    slots, rows, sender = all_needs[me]
    out_len = int(_positions(n_out, out_dim, out_pl, mesh, coord).numel())
    # stays: the route is planned on the host (its map comes from metadata or an index moved there, as
    # all_to_all's split sizes must be), so these reads cost no device round trip; while tracing its
    # lists become Python ints, graph constants
    moving = any(bool((s != m).any()) for m, (_, _, s) in enumerate(all_needs))
    keep = (lambda t: t.tolist()) if tracing() else (lambda t: t)  # noqa: E731
    if not moving:  # every member keeps what it has: only this rank's own rows matter
        send = [keep(local_index[rows] if m == me else rows[:0]) for m in range(len(members))]
        return _Route(
            group, me, out_len, False, send, [keep(slots if m == me else slots[:0]) for m in range(len(members))]
        )
    send = [keep(local_index[m_rows[m_sender == me]]) for _, m_rows, m_sender in all_needs]
    return _Route(group, me, out_len, True, send, [keep(slots[sender == m]) for m in range(len(members))])


def _axis(spec: TensorSpec, dim: int, length: int | None = None) -> tuple[int, int, tuple[Placement, ...]]:
    return (spec.shape[dim] if length is None else length, dim, spec.placements)


def _sharded_here(ctx, in_dim: int, out_dim: int | None = None, k: int = 0) -> bool:
    """The chosen layout shards the op's dim on input k or on the output (a re-index must move rows)."""
    out_dim = in_dim if out_dim is None else out_dim
    return bool(
        _sharding_mesh_dims(ctx.in_specs[k].placements, in_dim)
        or _sharding_mesh_dims(ctx.out_specs[0].placements, out_dim)
    )


def _local_size(ctx, sizes: Sequence[int]) -> list[int]:
    return list(ctx.out_specs[0].local_shape())


# ------------------------------------------------------------------ rule helpers


def _partials(schema: OpSchema, ops: Sequence[str] = ("sum", "avg", "max", "min", "product")) -> list[Placement]:
    """The pending reductions an op passes through (a copy or selection of values passes every one)."""
    out: list[Placement] = [Partial(op) for op in ops]
    if "sum" in ops:
        out += sorted({p for s in schema.tensor_specs for p in s.placements if isinstance(p, NormPartial)}, key=repr)
    return out


def _keep_rows(
    ndim: int, skip: Sequence[int], n_in: int = 1, shift: Callable[[int], int] = lambda d: d, size_ok=lambda d: True
) -> list[Row]:
    """Local rows: a dim the op does not touch keeps its shard (0 bytes)."""
    return [row(Shard(shift(d)), [Shard(d)] + [R] * (n_in - 1)) for d in range(ndim) if d not in skip and size_ok(d)]


def _move_rows(
    dims: Sequence[int], algorithm, out_bytes: float, n_in: int = 1, out_dim=lambda d: d, from_replica: bool = False
) -> list[Row]:
    """Re-index rows for each dim the op re-indexes: from a shard (the rows that change owner move, at most
    this rank's output shard) and, for backward ops, from a replica (local: a gradient goes back sharded).

    Forward ops get no replica row: a replicated input keeps a replicated output, as in torch, so that
    its backward moves nothing either.
    """
    rows = []
    for d in dims:
        rows.append(
            row(
                Shard(out_dim(d)),
                [Shard(d)] + [R] * (n_in - 1),
                algorithm,
                comm=(("all_to_all", out_bytes),),
                label=LABEL_MOVE,
            )
        )
        if from_replica:
            rows.append(row(Shard(out_dim(d)), [R] * n_in, algorithm, label=LABEL_FROM_REPLICA))
    return rows


def _shard_bytes(spec: TensorSpec, scale: float = 1.0) -> float:
    """Bytes of one shard of `spec` (times `scale`: an output `scale` times the input's size)."""
    n = 1
    for size, p in zip(spec.mesh.shape, spec.placements):
        n *= size if p.is_shard() else 1
    return spec.numel * spec.itemsize * scale / max(n, 1)


# ------------------------------------------------------------------ flip, roll, repeat, constant_pad_nd


def _flip_dims(schema: OpSchema) -> list[int]:
    return sorted({normalize_dim(d, schema.self_spec.ndim, schema.name) for d in schema.arg("dims")})


def _flip_algorithm(ctx, x: torch.Tensor, dims, *args, **kwargs) -> torch.Tensor:
    spec = ctx.in_specs[0]
    left = []
    for d in _flip_dims(ctx.schema):
        if _sharded_here(ctx, d):
            n = spec.shape[d]
            x = reindex_along(
                x,
                spec.mesh,
                d,
                _axis(spec, d),
                _axis(ctx.out_specs[0], d),
                lambda: torch.arange(n - 1, -1, -1),  # noqa: B023 - reindex_along calls it at once
            )
        else:
            left.append(d)
    return x.flip(left) if left else x


@strategy(aten.flip.default, algorithms=[LABEL_MOVE])
def _flip_rule(schema: OpSchema) -> list[Row]:
    spec, dims = schema.self_spec, _flip_dims(schema)
    return (
        _keep_rows(spec.ndim, dims)
        + _move_rows(dims, _flip_algorithm, _shard_bytes(spec))
        + [row(p, p) for p in _partials(schema)]
    )


def _roll_pairs(schema: OpSchema) -> list[tuple[int, int]]:
    spec = schema.self_spec
    shifts, dims = list(schema.arg("shifts")), list(schema.arg("dims") or [])
    if not dims and spec.ndim == 1:  # a roll of the flattened tensor is a roll along the only dim
        dims = [0]
    return [(normalize_dim(d, spec.ndim, schema.name), s) for d, s in zip(dims, shifts)]


def _roll_algorithm(ctx, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    spec = ctx.in_specs[0]
    shifts, dims = [], []
    for d, s in _roll_pairs(ctx.schema):
        if _sharded_here(ctx, d):
            n = spec.shape[d]
            x = reindex_along(
                x,
                spec.mesh,
                d,
                _axis(spec, d),
                _axis(ctx.out_specs[0], d),
                lambda: (torch.arange(n) - s) % max(n, 1),  # noqa: B023 - reindex_along calls it at once
            )
        else:
            shifts.append(s)
            dims.append(d)
    if not dims:
        return x
    return torch.roll(x, shifts, dims) if ctx.schema.arg("dims") else torch.roll(x, shifts)


@strategy(aten.roll.default, algorithms=[LABEL_MOVE])
def _roll_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    if not schema.arg("dims") and spec.ndim != 1:
        return [row(p, p) for p in _partials(schema)]  # a roll of the flattened tensor: replicate (implicit row)
    dims = sorted({d for d, _ in _roll_pairs(schema)})
    return (
        _keep_rows(spec.ndim, dims)
        + _move_rows(dims, _roll_algorithm, _shard_bytes(spec))
        + [row(p, p) for p in _partials(schema)]
    )


def _repeat_layout(schema: OpSchema) -> tuple[int, list[int]]:
    """(leading new dims, input dims repeated more than once)."""
    spec = schema.self_spec
    repeats = list(schema.arg("repeats"))
    lead = len(repeats) - spec.ndim
    return lead, [d for d in range(spec.ndim) if repeats[d + lead] != 1]


def _repeat_algorithm(ctx, x: torch.Tensor, repeats, *args, **kwargs) -> torch.Tensor:
    spec = ctx.in_specs[0]
    lead, repeated = _repeat_layout(ctx.schema)
    local_repeats = list(repeats)
    for d in repeated:
        if _sharded_here(ctx, d, d + lead):
            n, r = spec.shape[d], repeats[d + lead]
            x = reindex_along(
                x,
                spec.mesh,
                d,
                _axis(spec, d),
                _axis(ctx.out_specs[0], d + lead),
                lambda: torch.arange(n * r) % max(n, 1),  # noqa: B023 - reindex_along calls it at once
            )
            local_repeats[d + lead] = 1
    return x.repeat(local_repeats)


@strategy(aten.repeat.default, algorithms=[LABEL_MOVE])
def _repeat_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    lead, repeated = _repeat_layout(schema)
    shift = lambda d: d + lead  # noqa: E731
    rows = _keep_rows(spec.ndim, repeated, shift=shift)
    growth = math.prod(schema.arg("repeats"))
    rows += _move_rows(
        [d for d in repeated if spec.shape[d] > 0], _repeat_algorithm, _shard_bytes(spec, growth), out_dim=shift
    )
    return rows + [row(p, p) for p in _partials(schema)]


def _pad_pairs(schema: OpSchema) -> dict[int, tuple[int, int]]:
    """{dim: (left, right)} of constant_pad_nd (pairs start at the last dim; negative pads crop)."""
    nd = schema.self_spec.ndim
    pad = list(schema.arg("pad"))
    return {
        nd - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2) if (pad[2 * i], pad[2 * i + 1]) != (0, 0)
    }


def _pad_source(n: int, left: int, right: int) -> torch.Tensor:
    source = torch.arange(n + left + right) - left
    return torch.where((source >= 0) & (source < n), source, -1)


def _pad_algorithm(ctx, x: torch.Tensor, pad, value=0, *args, **kwargs) -> torch.Tensor:
    spec = ctx.in_specs[0]
    local_pad = list(pad)
    for d, (left, right) in _pad_pairs(ctx.schema).items():
        if _sharded_here(ctx, d):
            n = spec.shape[d]
            x = reindex_along(
                x,
                spec.mesh,
                d,
                _axis(spec, d),
                _axis(ctx.out_specs[0], d),
                lambda: _pad_source(n, left, right),  # noqa: B023 - reindex_along calls it at once
                fill=value,
            )
            i = spec.ndim - 1 - d
            local_pad[2 * i] = local_pad[2 * i + 1] = 0
    return aten.constant_pad_nd.default(x, local_pad, value) if any(local_pad) else x.clone()


@strategy(aten.constant_pad_nd.default, algorithms=[LABEL_MOVE])
def _pad_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    padded = sorted(_pad_pairs(schema))
    value = schema.arg("value", 0)
    rows = _keep_rows(spec.ndim, padded) + _move_rows(padded, _pad_algorithm, _shard_bytes(spec))
    # a pending reduction passes where every rank's pad value reduces to the pad value itself
    passing = ["avg", "max", "min"] + (["sum"] if value == 0 else []) + (["product"] if value == 1 else [])
    return rows + [row(p, p) for p in _partials(schema, passing)]


# ------------------------------------------------------------------ slice / select backward


def _slice_backward_algorithm(
    ctx, grad: torch.Tensor, input_sizes, dim, start, end, step, *args, **kwargs
) -> torch.Tensor:
    out_spec = ctx.out_specs[0]
    nd = out_spec.ndim
    dim = dim % nd
    if not _sharded_here(ctx, dim):
        return aten.slice_backward.default(grad, list(out_spec.local_shape()), dim, start, end, step)
    n = out_spec.shape[dim]
    start, end = _clamp_slice(start, end, n)
    gspec = ctx.in_specs[0]
    return reindex_along(
        grad,
        out_spec.mesh,
        dim,
        _axis(gspec, dim),
        _axis(out_spec, dim),
        lambda: _slice_backward_source(n, start, end, step),
        fill=0,
    )


def _slice_backward_source(n: int, start: int, end: int, step: int) -> torch.Tensor:
    j = torch.arange(n)
    hit = (j >= start) & (j < end) & ((j - start) % step == 0)
    return torch.where(hit, (j - start) // step, -1)


def _clamp_slice(start, end, n: int) -> tuple[int, int]:
    start = 0 if start is None else start
    end = n if end is None else end
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    return min(max(start, 0), n), min(max(end, 0), n)


@strategy(aten.slice_backward.default, algorithms=[LABEL_MOVE, LABEL_FROM_REPLICA])
def _slice_backward_rule(schema: OpSchema) -> list[Row]:
    grad = schema.tensor_specs[0]
    sizes = list(schema.arg("input_sizes"))
    dim = normalize_dim(schema.arg("dim"), len(sizes), schema.name)
    algo = _slice_backward_algorithm
    rows = [row(Shard(d), Shard(d), algo) for d in range(len(sizes)) if d != dim and grad.shape[d] == sizes[d]]
    rows += _move_rows([dim], algo, _shard_bytes(grad), from_replica=True)
    return rows + [row(p, p, algo) for p in _partials(schema, ("sum", "avg"))]


def _select_backward_algorithm(ctx, grad: torch.Tensor, input_sizes, dim, index, *args, **kwargs) -> torch.Tensor:
    out_spec = ctx.out_specs[0]
    nd = out_spec.ndim
    dim = dim % nd
    local = list(out_spec.local_shape())
    if not _sharding_mesh_dims(out_spec.placements, dim):
        return aten.select_backward.default(grad, local, dim, index)
    index = index % out_spec.shape[dim]
    held = _positions(out_spec.shape[dim], dim, out_spec.placements, out_spec.mesh, out_spec.mesh.get_coordinate())
    out = grad.new_zeros(local)
    at = (held == index).nonzero().flatten()
    if at.numel():
        out.select(dim, int(at[0])).copy_(grad)
    return out


@strategy(aten.select_backward.default, algorithms=[LABEL_OWNER_WRITES])
def _select_backward_rule(schema: OpSchema) -> list[Row]:
    sizes = list(schema.arg("input_sizes"))
    dim = normalize_dim(schema.arg("dim"), len(sizes), schema.name)
    algo = _select_backward_algorithm
    rows = [row(Shard(d), Shard(d - (d > dim)), algo) for d in range(len(sizes)) if d != dim]
    rows.append(row(Shard(dim), R, algo, label=LABEL_OWNER_WRITES))
    return rows + [row(p, p, algo) for p in _partials(schema, ("sum", "avg"))]


# ------------------------------------------------------------------ index_select / index_add


def _owned(spec: TensorSpec, dim: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of index entries this rank holds along `dim`, their local positions)."""
    n = spec.shape[dim]
    held = _positions(n, dim, spec.placements, spec.mesh, spec.mesh.get_coordinate())
    local_index = torch.full((max(n, 1),), -1, dtype=torch.long, device=index.device)
    local_index[held.to(index.device)] = torch.arange(len(held), device=index.device)
    idx = index.long() % max(n, 1)
    local = local_index[idx]
    return local >= 0, local.clamp(min=0)


def _index_select_move(ctx, x: torch.Tensor, dim, index: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Along the sharded dim, output sharded the same way: the selected rows move to their new owners.

    reindex_along needs a map that every member of its group holds. The planner may pair this
    row with the index-sharded row ([R, S(0)] -> S(dim)) on other mesh dims, so `index` can be
    this rank's piece of the index only, which differs between the ranks of those mesh dims.
    When every index cut comes before the re-index cuts, this rank's output is a piece of its
    index piece: re-index that piece over the other mesh dims (the index dims leave the group,
    whose members then share one map). Otherwise the index is gathered first (it is small), so
    every rank still takes the same plan and issues the same collectives.
    """
    spec, index_spec, out_spec = ctx.in_specs[0], ctx.in_specs[1], ctx.out_specs[0]
    dim = dim % max(x.ndim, 1)
    index_dims = [i for i, p in enumerate(index_spec.placements) if p.is_shard()]
    out_pl = list(out_spec.placements)
    move_dims = [i for i, p in enumerate(out_pl) if p.is_shard(dim) and i not in index_dims]
    if index_dims and move_dims and max(index_dims) > min(move_dims):
        index = redistribute_local(index, index_spec, [R] * len(index_spec.placements))
    else:
        for i in index_dims:
            out_pl[i] = R
    # stays: the route (who sends which rows) is planned on the host, as all_to_all's split sizes must be
    source = index.long().cpu() % max(spec.shape[dim], 1)
    return reindex_along(x, spec.mesh, dim, _axis(spec, dim), (index.numel(), dim, tuple(out_pl)), source)


def _index_select_pick(ctx, x: torch.Tensor, dim, index: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Along the sharded dim, output pending: each rank picks the rows it owns, zeros elsewhere -> P(sum)."""
    spec = ctx.in_specs[0]
    dim = dim % max(x.ndim, 1)
    owned, local = _owned(spec, dim, index)
    if not x.shape[dim]:
        return x.new_zeros(_replace(x.shape, dim, index.numel()))
    shape = [1] * x.ndim
    shape[dim] = -1
    return torch.where(owned.view(shape), x.index_select(dim, local), torch.zeros((), dtype=x.dtype, device=x.device))


def _replace(shape, dim, size) -> list[int]:
    s = list(shape)
    s[dim] = size
    return s


@strategy(aten.index_select.default, algorithms=[LABEL_MOVE, LABEL_PICK])
def _index_select_rule(schema: OpSchema) -> list[Row]:
    x, index = schema.tensor_specs
    dim = schema.dim("dim", ndim=x.ndim)
    rows = [row(Shard(d), [Shard(d), R]) for d in range(x.ndim) if d != dim]
    if index.ndim and index.shape[0] > 1:
        rows.append(row(Shard(dim), [R, Shard(0)]))  # each rank selects its part of the index
    if x.ndim:
        rows.append(
            row(
                Shard(dim),
                [Shard(dim), R],
                _index_select_move,
                comm=(("all_to_all", _shard_bytes(x)),),
                label=LABEL_MOVE,
            )
        )
        if x.dtype != torch.bool:
            rows.append(row(P, [Shard(dim), R], _index_select_pick, label=LABEL_PICK))
    return rows + [row(p, [p, R]) for p in _partials(schema)]


def _index_add_algorithm(
    ctx, x: torch.Tensor, dim, index: torch.Tensor, source: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    """Along a sharded dim: add only the rows whose target this rank owns."""
    spec = ctx.in_specs[0]
    dim = dim % max(x.ndim, 1)
    owned, local = _owned(spec, dim, index)
    keep = owned.nonzero().flatten()
    return ctx.func(x, dim, local[keep], source.index_select(dim, keep), *args, **kwargs)


@strategy(aten.index_add.default, aten.index_add_.default, algorithms=[LABEL_OWNER])
def _index_add_rule(schema: OpSchema) -> list[Row]:
    x, index, source = schema.tensor_specs
    dim = schema.dim("dim", ndim=x.ndim)
    rows = [row(Shard(d), [Shard(d), R, Shard(d)]) for d in range(x.ndim) if d != dim and source.ndim == x.ndim]
    if x.ndim:
        rows.append(row(Shard(dim), [Shard(dim), R, R], _index_add_algorithm, label=LABEL_OWNER))
        if x.dtype != torch.bool and source.ndim == x.ndim and index.shape[0] > 1:
            rows.append(
                row(P, [P, Shard(0), Shard(dim)], label="each rank adds its part of the index into a pending sum")
            )
    if x.dtype != torch.bool:
        rows.append(row(P, [P, R, P]))
    return rows


class _IndexSelectFunction(torch.autograd.Function):
    """index_select on a DTensor whose backward adds into fresh zeros out of place.

    torch's own backward runs `grad.new_zeros(size).index_add_(...)`: an in-place op keeps
    the replicated zeros' layout, so it would gather a sharded gradient. The out-of-place
    index_add lets the zeros take the gradient's layout for free.
    """

    @staticmethod
    def forward(ctx, x, dim: int, index):
        ctx.shape, ctx.dim, ctx.index = tuple(x.shape), dim, index
        return aten.index_select.default(x, dim, index)

    @staticmethod
    def backward(ctx, grad):
        zeros = grad.new_zeros(ctx.shape)
        return aten.index_add.default(zeros, ctx.dim, ctx.index, grad), None, None


def _index_select_call(input, dim, index, *, out=None): ...  # noqa: E704  (torch's form)


@torch_level(
    torch.index_select,
    torch.Tensor.index_select,
    signature=CallSignature(_index_select_call, aliases={"self": "input"}),
    apply=_IndexSelectFunction.apply,
)
def _parse_index_select(b: dict, *_) -> tuple | None:
    """(x, dim, index) for a differentiable index_select by an int dim; None: torch's path."""
    x, dim = b["input"], b["dim"]
    if (
        b["out"] is not None
        or not isinstance(dim, int)
        or not needs_grad(x)
        or not (x.is_floating_point() or x.is_complex())
    ):
        return None
    return x, normalize_dim(dim, x.ndim, "index_select") if x.ndim else 0, b["index"]


# ------------------------------------------------------------------ scatter family (gather lives in losses.py)


def _scatter_owner_algorithm(ctx, x: torch.Tensor, dim, index: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
    """Along a sharded dim: apply only the entries whose target this rank owns.

    The others are sent to a scratch slot appended along dim and dropped after torch's
    own kernel ran, so every variant (value, src, reduce, scatter_reduce) keeps torch's
    semantics on the owned entries.
    """
    spec = ctx.in_specs[0]
    dim = dim % max(x.ndim, 1)
    owned, local = _owned(spec, dim, index)
    widened = torch.cat([x, x.new_zeros(_replace(x.shape, dim, 1))], dim)
    redirected = torch.where(owned, local, torch.full_like(local, x.shape[dim]))
    out = ctx.func(widened, dim, redirected, *rest, **kwargs)
    kept = out.narrow(dim, 0, x.shape[dim])
    if ctx.schema.is_inplace():
        return x.copy_(kept)
    return kept.contiguous()


@strategy(
    aten.scatter.value, aten.scatter.src, aten.scatter.reduce, aten.scatter.value_reduce, algorithms=[LABEL_OWNER]
)
@strategy(
    aten.scatter_.value, aten.scatter_.src, aten.scatter_.reduce, aten.scatter_.value_reduce, algorithms=[LABEL_OWNER]
)
@strategy(
    aten.scatter_add.default,
    aten.scatter_add_.default,
    aten.scatter_reduce.two,
    aten.scatter_reduce_.two,
    algorithms=[LABEL_OWNER],
)
def _scatter_rule(schema: OpSchema) -> list[Row]:
    specs = schema.tensor_specs
    x, index = specs[0], specs[1]
    n = len(specs)
    dim = schema.dim("dim", ndim=x.ndim)
    rows = [
        row(Shard(d), [Shard(d)] * n)
        for d in range(x.ndim)
        if d != dim and index.ndim == x.ndim and all(s.shape[d] == x.shape[d] for s in specs)
    ]
    if x.ndim and index.ndim:
        rows.append(row(Shard(dim), [Shard(dim)] + [R] * (n - 1), _scatter_owner_algorithm, label=LABEL_OWNER))
    base = schema.op._schema.name.split("::")[-1].rstrip("_")
    if base == "scatter_add" and x.dtype != torch.bool:
        if index.ndim and index.shape[dim] > 1 and specs[2].shape[dim] == index.shape[dim]:
            rows.append(
                row(P, [P, Shard(dim), Shard(dim)], label="each rank adds its part of the index into a pending sum")
            )
        rows.append(row(P, [P, R, P]))
    return rows


# ------------------------------------------------------------------ advanced indexing: index.Tensor, index_put


def _index_layout(ndim: int, indices: Sequence[Any]) -> tuple[list[int], int, int, dict[int, int]]:
    """(indexed dims, where the broadcast index dims start in the output, their count, {kept dim: output dim})."""
    indexed = [d for d, t in enumerate(indices) if t is not None]
    b = max((t.ndim for t in indices if t is not None), default=0)
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1)) if indexed else True
    start = indexed[0] if adjacent and indexed else 0
    kept = [d for d in range(ndim) if d not in indexed]
    out: dict[int, int] = {}
    for d in kept:
        out[d] = d if d < start else d - len(indexed) + b
    if not adjacent:
        out = {d: b + i for i, d in enumerate(kept)}
    return indexed, start, b, out


def _index_tensors(schema: OpSchema) -> list[Any]:
    return list(schema.arg("indices"))


def _index_pick_algorithm(ctx, x: torch.Tensor, indices, *args, **kwargs) -> torch.Tensor:
    """One index tensor along a sharded dim: pick what this rank owns, zeros elsewhere -> P(sum)."""
    spec = ctx.in_specs[0]
    (d,) = [k for k, t in enumerate(indices) if t is not None]
    owned, local = _owned(spec, d, indices[d])
    moved = list(indices)
    moved[d] = local
    if x.shape[d] == 0:
        shape = list(ctx.out_specs[0].local_shape())
        return x.new_zeros(shape)
    picked = aten.index.Tensor(x, moved)
    _, start, b, _ = _index_layout(x.ndim, indices)
    shape = [1] * picked.ndim
    shape[start : start + b] = list(owned.shape)
    return torch.where(owned.view(shape), picked, torch.zeros((), dtype=x.dtype, device=x.device))


@strategy(aten.index.Tensor, algorithms=[LABEL_PICK])
def _index_rule(schema: OpSchema) -> list[Row]:
    x = schema.self_spec
    indices = _index_tensors(schema)
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return []  # a mask: the output size depends on the data (replicate)
    idx_specs = [t for t in indices if t is not None]
    n = len(idx_specs)
    indexed, start, b, kept = _index_layout(x.ndim, indices)
    rows = [row(Shard(o), [Shard(d)] + [R] * n) for d, o in kept.items()]
    same = idx_specs and all(t.shape == idx_specs[0].shape for t in idx_specs)
    if same:
        rows += [row(Shard(start + k), [R] + [Shard(k)] * n) for k in range(b) if idx_specs[0].shape[k] > 1]
    if n == 1 and x.dtype != torch.bool:
        rows.append(row(P, [Shard(indexed[0]), R], _index_pick_algorithm, label=LABEL_PICK))
    return rows + [row(p, [p] + [R] * n) for p in _partials(schema)]


def _values_dim(values: TensorSpec, out_dim: int, out_ndim: int) -> int | None:
    k = out_dim - (out_ndim - values.ndim)
    return k if k >= 0 else None


def _index_put_owner_algorithm(ctx, x: torch.Tensor, indices, values: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """One index tensor along a sharded dim: apply the entries whose target row this rank owns."""
    spec = ctx.in_specs[0]
    (d,) = [k for k, t in enumerate(indices) if t is not None]
    owned, local = _owned(spec, d, indices[d])
    _, start, b, kept = _index_layout(x.ndim, indices)
    result_shape = list(x.shape[:start]) + list(indices[d].shape) + list(x.shape[start + 1 :])
    full_values = values.expand(result_shape) if values.ndim else values.expand(result_shape)
    keep = owned.nonzero(as_tuple=True)
    moved = list(indices)
    moved[d] = local[keep]
    sel = (slice(None),) * start + keep
    picked = full_values[sel]
    return ctx.func(x, moved, picked, *args, **kwargs)


@strategy(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default, algorithms=[LABEL_OWNER])
def _index_put_rule(schema: OpSchema) -> list[Row]:
    x = schema.self_spec
    indices = _index_tensors(schema)
    values = schema.tensor_specs[-1]
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return []
    idx_specs = [t for t in indices if t is not None]
    n = len(idx_specs)
    indexed, start, b, kept = _index_layout(x.ndim, indices)
    out_ndim = x.ndim - len(indexed) + b
    out_shape = [0] * out_ndim
    for d, o in kept.items():
        out_shape[o] = x.shape[d]
    rows = []
    for d, o in kept.items():
        k = _values_dim(values, o, out_ndim)
        v = Shard(k) if k is not None and values.shape[k] == x.shape[d] else R
        rows.append(row(Shard(d), [Shard(d)] + [R] * n + [v]))
    if n == 1 and x.ndim:
        rows.append(
            row(Shard(indexed[0]), [Shard(indexed[0])] + [R] * n + [R], _index_put_owner_algorithm, label=LABEL_OWNER)
        )
    accumulate = bool(schema.arg("accumulate", False))
    if accumulate and x.dtype != torch.bool:
        same = idx_specs and all(t.shape == idx_specs[0].shape for t in idx_specs)
        if same and kept == {d: d if d < start else d - len(indexed) + b for d in kept}:
            for k in range(b):
                vk = _values_dim(values, start + k, out_ndim)
                if idx_specs[0].shape[k] > 1 and vk is not None and values.shape[vk] == idx_specs[0].shape[k]:
                    rows.append(
                        row(
                            P,
                            [P] + [Shard(k)] * n + [Shard(vk)],
                            label="each rank adds its part of the index into a pending sum",
                        )
                    )
        rows.append(row(P, [P] + [R] * n + [P]))
    return rows


# ------------------------------------------------------------------ select / slice / narrow along the sharded dim
# select, slice and narrow: views.py's rows (every other dim keeps its shard), then the moves along `dim`.


def _select_pick(ctx, x: torch.Tensor, dim, index, *args, **kwargs) -> torch.Tensor:
    """select along the sharded dim: the rank that holds the index returns it, the others zeros -> P(sum)."""
    spec = ctx.in_specs[0]
    dim = dim % x.ndim
    n = spec.shape[dim]
    held = _positions(n, dim, spec.placements, spec.mesh, spec.mesh.get_coordinate())
    at = (held == index % n).nonzero().flatten()
    if at.numel():
        return x.select(dim, int(at[0]))
    return x.new_zeros(ctx.out_specs[0].local_shape())


@strategy(aten.select.int, algorithms=[LABEL_PICK])
def _select_rule(schema: OpSchema) -> list[Row]:
    rows = keep_other_dims_rule(schema)
    x = schema.self_spec
    if not x.ndim or x.dtype == torch.bool:
        return rows
    return rows + [row(P, Shard(schema.dim("dim")), _select_pick, label=LABEL_PICK)]


def _slice_move(ctx, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """slice/narrow along the sharded dim: the kept rows move to the owners of the output's shards."""
    spec, out_spec = ctx.in_specs[0], ctx.out_specs[0]
    dim, start, step = _slice_args(ctx.schema)
    n_out = out_spec.shape[dim]
    return reindex_along(
        x, spec.mesh, dim, _axis(spec, dim), _axis(out_spec, dim), lambda: start + step * torch.arange(n_out)
    )


def _slice_args(schema: OpSchema) -> tuple[int, int, int]:
    """(dim, first kept index, step) of slice.Tensor / narrow, normalised."""
    spec = schema.self_spec
    dim = schema.dim("dim")
    n = spec.shape[dim]
    if schema.op is aten.narrow.default:
        start = schema.arg("start")
        return dim, start + n if start < 0 else start, 1
    start, _ = _clamp_slice(schema.arg("start"), schema.arg("end"), n)
    return dim, start, schema.arg("step", 1) or 1


COPYING_VIEW_ALGORITHMS.update((_select_pick, _slice_move))  # new tensors: writes through them miss the input


@strategy(aten.slice.Tensor, aten.narrow.default, algorithms=[LABEL_MOVE])
def _slice_rule(schema: OpSchema) -> list[Row]:
    rows = keep_other_dims_rule(schema)
    x = schema.self_spec
    if not x.ndim or isinstance(schema.arg("start"), torch.Tensor):
        return rows
    dim = schema.dim("dim")
    return rows + [row(Shard(dim), Shard(dim), _slice_move, comm=(("all_to_all", _shard_bytes(x)),), label=LABEL_MOVE)]
