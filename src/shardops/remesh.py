"""Copy between DTensors on different meshes (`dst.copy_(src)`, `module.load_state_dict` from a
model laid out on another mesh or plan, or on a sub-mesh: (4,) into `mesh["tp"]` of (2, 2)).

Every rank computes, for each pair (source rank, destination rank), which global indices
travel: the intersection of what the source holds and what the destination needs, per
tensor dim. Where several source ranks hold the same block (Replicate mesh dims, or
several copies of the source on sub-meshes), the destination reads its own copy if it has
one, else one holder chosen by a fixed rule (so the senders share the load). One
all_to_all moves the pieces; a pending (Partial) source is resolved on its own mesh first.

When both meshes span the same ranks, every rank knows both layouts and the exchange runs
over those ranks. Otherwise a rank cannot know the others' meshes (rank 2's `mesh["tp"]` is
not rank 0's), so the ranks of the world first gather each rank's two layouts (a small
object exchange) and the pieces move in one all_to_all over the world: every rank of the
world must take part, as in `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .comm.base import Group
from .errors import ShardingError
from .placements import dim_positions, without_partials
from .tensor import CROSS_MESH_COPY
from .wrapping import local_of, relabel, shard_in, spec_of


@dataclass(frozen=True)
class Layout:
    """A mesh (shape and ranks, row-major) and placements: a rank's view of one operand."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[Any, ...]

    @classmethod
    def of(cls, spec: Any, placements: Sequence[Any]) -> Layout:
        return cls(tuple(spec.mesh.shape), tuple(spec.mesh.mesh.flatten().tolist()), tuple(placements))

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        if rank not in self.ranks:
            return None
        flat, coord = self.ranks.index(rank), []
        for n in reversed(self.shape):
            coord.append(flat % n)
            flat //= n
        return tuple(reversed(coord))

    def positions(self, shape: Sequence[int], rank: int) -> list[range | list[int]] | None:
        """The global indices, per tensor dim, that `rank` holds (None off this mesh)."""
        coord = self.coordinate(rank)
        if coord is None:
            return None
        return [dim_positions(n, d, self.shape, coord, self.placements) for d, n in enumerate(shape)]

    def block(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinates on the sharding mesh dims: ranks with the same block hold the same data."""
        coord = self.coordinate(rank)
        assert coord is not None, f"rank {rank} is off the mesh"  # callers ask only for ranks that hold a block
        return tuple(c for c, p in zip(coord, self.placements) if p.is_shard())

    @cached_property
    def holders(self) -> dict[tuple[int, ...], list[int]]:
        """The ranks holding each block (several along Replicate mesh dims)."""
        out: dict[tuple[int, ...], list[int]] = {}
        for r in self.ranks:
            out.setdefault(self.block(r), []).append(r)
        return out

    def holder(self, block: tuple[int, ...], reader: int) -> int:
        """The rank of this mesh that sends `block` to `reader`: the reader itself if it holds it."""
        holders = self.holders[block]
        return reader if reader in holders else holders[reader % len(holders)]


def _common(
    a: range | list[int], b: range | list[int]
) -> tuple[list[int] | range, list[int] | range, list[int] | range]:
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


def _sources(layouts: dict[int, tuple[Layout, Layout]]) -> dict[int, Layout]:
    """The copy of the source each rank reads from: its own if it holds one, else one by a fixed rule."""
    copies = sorted({src for src, _ in layouts.values()}, key=repr)  # each one a whole copy of the source
    return {r: own if own.coordinate(r) is not None else copies[r % len(copies)] for r, (own, _) in layouts.items()}


def _gather_layouts(src: Layout, dst: Layout, shape: tuple[int, ...], comm: Any) -> dict[int, tuple[Layout, Layout]]:
    """Every world rank's (source, destination) layouts; raises on every rank if their shapes disagree."""
    from .checkpoint.exchange import all_gather_object

    gathered = all_gather_object((src, dst, shape))
    shapes = {tuple(g[2]) for g in gathered}
    if len(shapes) > 1:
        raise ShardingError(
            "aten.copy_ across meshes over different ranks: the ranks of the world copy tensors of different shapes "
            f"{sorted(shapes)} at the same step; every rank of the world must copy the same tensor (load_state_dict on "
            "every rank)"
        )
    return {r: (g[0], g[1]) for r, g in enumerate(gathered)}


def copy_across_meshes(dst: Any, src: Any) -> Any:
    """`dst.copy_(src)` with `src` on another mesh (in place; returns dst)."""
    dspec, sspec = spec_of(dst), spec_of(src)
    if tuple(dspec.shape) != tuple(sspec.shape):
        raise ShardingError(
            f"aten.copy_: across meshes the shapes must match (destination {list(dspec.shape)}, source "
            f"{list(sspec.shape)})"
        )
    src_pl = without_partials(sspec.placements)
    src_local = shard_in(src, src_pl)  # a pending source resolves on its own mesh
    if any(p.is_partial() for p in dspec.placements):
        relabel(dst, dspec.with_placements(without_partials(dspec.placements)))  # it will hold the value itself
        dspec = spec_of(dst)
    comm = dspec.mesh.comm
    src_layout, dst_layout = Layout.of(sspec, src_pl), Layout.of(dspec, dspec.placements)
    shape = tuple(dspec.shape)
    if sorted(src_layout.ranks) == sorted(dst_layout.ranks):
        ranks = sorted(dst_layout.ranks)
        layouts = {r: (src_layout, dst_layout) for r in ranks}  # every rank here has the same two meshes
    else:
        ranks = list(range(comm.world_size))
        layouts = _gather_layouts(src_layout, dst_layout, shape, comm)
    received, places = _exchange(comm, ranks, layouts, shape, src_local)
    local = local_of(dst)
    for piece, where in zip(received, places):
        if where is not None and piece.numel():
            _put(local, where, piece)
        elif where is not None and local.ndim == 0:
            local.copy_(piece)
    return dst


def _exchange(
    comm: Any,
    ranks: list[int],
    layouts: dict[int, tuple[Layout, Layout]],
    shape: tuple[int, ...],
    src_local: torch.Tensor,
) -> tuple[list[torch.Tensor], list[Any]]:
    """One all_to_all over `ranks`: each destination gets every index it needs from one holder."""
    me = comm.rank
    my_src = layouts[me][0]
    mine_src = my_src.positions(shape, me)
    mine_dst = layouts[me][1].positions(shape, me)
    sources = _sources(layouts)
    my_source = sources[me] if mine_dst is not None else None
    sends: list[torch.Tensor] = []
    recv_shapes: list[tuple[int, ...]] = []
    recv_places: list[Any] = []
    for r in ranks:
        # what I send to r: the part of my source block r needs, if r reads that block from me
        needs = layouts[r][1].positions(shape, r)
        if (
            mine_src is not None
            and needs is not None
            and sources[r] == my_src
            and my_src.holder(my_src.block(me), r) == me
        ):
            piece = src_local
            for d, (_, in_src, _) in enumerate(_common(s, n) for s, n in zip(mine_src, needs)):
                piece = _take(piece, d, in_src)
            sends.append(piece.contiguous() if src_local.ndim else src_local.reshape(()))
        else:
            sends.append(src_local.new_empty((0,)))
        # what I receive from r
        holds = layouts[r][0].positions(shape, r)
        if (
            my_source is not None
            and mine_dst is not None
            and holds is not None
            and layouts[r][0] == my_source
            and my_source.holder(my_source.block(r), me) == r
        ):
            common = [_common(h, n) for h, n in zip(holds, mine_dst)]
            recv_shapes.append(tuple(len(c[0]) for c in common))
            recv_places.append([c[2] for c in common])
        else:
            recv_shapes.append((0,))
            recv_places.append(None)
    return comm.all_to_all(sends, Group(tuple(ranks)), recv_shapes), recv_places


CROSS_MESH_COPY.append(copy_across_meshes)
