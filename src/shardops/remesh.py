"""Copy between DTensors on different meshes over the same ranks (`dst.copy_(src)`,
`module.load_state_dict` from a model laid out on another mesh or plan).

Both layouts are known on every rank, so every rank computes, for each pair (source
rank, destination rank), which global indices travel: the intersection of what the
source holds and what the destination needs, per tensor dim. Where several source
ranks hold the same block (Replicate mesh dims), the destination reads its own copy
if it has one, else one holder chosen by a fixed rule (so the senders share the load).
One all_to_all over the ranks moves the pieces; a pending (Partial) source is resolved
on its own mesh first.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .comm.base import Group
from .errors import ShardingError
from .placements import dim_positions, without_partials
from .tensor import CROSS_MESH_COPY
from .wrapping import local_of, relabel, shard_in, spec_of


def _positions(spec: Any, rank: int, placements: Sequence[Any]) -> list[range | list[int]]:
    coord = spec.mesh.coordinate_of(rank)
    return [dim_positions(n, d, spec.mesh.shape, coord, placements) for d, n in enumerate(spec.shape)]


def _common(a: range | list[int], b: range | list[int]) -> tuple[list[int] | range, list[int] | range, list[int] | range]:
    """Global indices in both, and their local indices within a and within b."""
    if isinstance(a, range) and isinstance(b, range):
        lo, hi = max(a.start, b.start), min(a.stop, b.stop)
        if hi <= lo:
            return range(0), range(0), range(0)
        return range(lo, hi), range(lo - a.start, hi - a.start), range(lo - b.start, hi - b.start)
    where_a = {g: i for i, g in enumerate(a)}
    where_b = {g: i for i, g in enumerate(b)}
    both = [g for g in a if g in where_b]
    return both, [where_a[g] for g in both], [where_b[g] for g in both]


def _take(t: torch.Tensor, dim: int, idx: range | list[int]) -> torch.Tensor:
    if isinstance(idx, range):
        return t.narrow(dim, idx.start, len(idx))
    return t.index_select(dim, torch.tensor(idx, dtype=torch.long, device=t.device))


def _put(dst: torch.Tensor, idx: Sequence[range | list[int]], piece: torch.Tensor) -> None:
    view = dst
    lists: list[tuple[int, list[int]]] = []
    for d, i in enumerate(idx):
        if isinstance(i, range):
            view = view.narrow(d, i.start, len(i))
        else:
            lists.append((d, i))
    if not lists:
        view.copy_(piece)
        return
    index = []
    for d in range(view.ndim):
        found = dict(lists).get(d)
        shape = [1] * view.ndim
        shape[d] = -1
        ix = torch.tensor(found, dtype=torch.long) if found is not None else torch.arange(view.shape[d])
        index.append(ix.reshape(shape))
    view.index_put_(tuple(index), piece.to(view.dtype))


def _holder(src_spec: Any, src_pl: Sequence[Any], dst_rank: int, ranks: Sequence[int]) -> dict[tuple, int]:
    """For each source block (coordinates on the sharding mesh dims), the source rank that sends it to `dst_rank`."""
    blocks: dict[tuple, list[int]] = {}
    for r in ranks:
        coord = src_spec.mesh.coordinate_of(r)
        blocks.setdefault(tuple(c for c, p in zip(coord, src_pl) if p.is_shard()), []).append(r)
    return {b: (dst_rank if dst_rank in holders else holders[ranks.index(dst_rank) % len(holders)]) for b, holders in blocks.items()}


def copy_across_meshes(dst: Any, src: Any) -> Any:
    """`dst.copy_(src)` with `src` on another mesh over the same ranks (in place; returns dst)."""
    dspec, sspec = spec_of(dst), spec_of(src)
    ranks = sorted(dspec.mesh.mesh.flatten().tolist())
    if ranks != sorted(sspec.mesh.mesh.flatten().tolist()):
        raise ShardingError(
            f"aten.copy_: the operands live on meshes over different ranks ({dspec.mesh} and {sspec.mesh}); "
            "a copy across meshes needs both over the same ranks"
        )
    if tuple(dspec.shape) != tuple(sspec.shape):
        raise ShardingError(f"aten.copy_: across meshes the shapes must match (destination {list(dspec.shape)}, source {list(sspec.shape)})")
    src_pl = without_partials(sspec.placements)
    src_local = shard_in(src, src_pl)  # a pending source resolves on its own mesh
    if any(p.is_partial() for p in dspec.placements):
        relabel(dst, dspec.with_placements(without_partials(dspec.placements)))  # it will hold the value itself
        dspec = spec_of(dst)
    comm = dspec.mesh.comm
    me = comm.rank
    group = Group(tuple(ranks))
    mine_src = _positions(sspec, me, src_pl)
    mine_dst = _positions(dspec, me, dspec.placements)
    my_block = tuple(c for c, p in zip(sspec.mesh.coordinate_of(me), src_pl) if p.is_shard())
    sends, recv_shapes, recv_places = [], [], []
    for r in ranks:
        # what I send to r: my source block, if r reads that block from me
        if _holder(sspec, src_pl, r, ranks)[my_block] == me:
            common = [_common(s, d) for s, d in zip(mine_src, _positions(dspec, r, dspec.placements))]
            piece = src_local
            for d, (_, in_src, _) in enumerate(common):
                piece = _take(piece, d, in_src)
            sends.append(piece.contiguous() if src_local.ndim else src_local.reshape(()))
        else:
            sends.append(src_local.new_empty((0,)))
        # what I receive from r
        coord_r = sspec.mesh.coordinate_of(r)
        block_r = tuple(c for c, p in zip(coord_r, src_pl) if p.is_shard())
        if _holder(sspec, src_pl, me, ranks)[block_r] == r:
            common = [_common(s, d) for s, d in zip(_positions(sspec, r, src_pl), mine_dst)]
            recv_shapes.append(tuple(len(c[0]) for c in common))
            recv_places.append([c[2] for c in common])
        else:
            recv_shapes.append((0,))
            recv_places.append(None)
    received = comm.all_to_all(sends, group, recv_shapes)
    local = local_of(dst)
    for piece, places in zip(received, recv_places):
        if places is not None and piece.numel():
            _put(local, places, piece)
        elif places is not None and local.ndim == 0:
            local.copy_(piece)
    return dst


CROSS_MESH_COPY.append(copy_across_meshes)
