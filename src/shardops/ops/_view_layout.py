"""Exact layout of a view: which placements a reshaped tensor has, without moving data.

A view pairs runs of input dims with runs of output dims of the same element count
(`view_groups`). Inside a run that merges dims [a0, ..., ak] into one dim m, a rank
that holds positions L0 x ... x Lk of the inputs holds their row-major products in
m. Mesh dims nest left to right, so a mesh dim sharding input dim aj cuts every
rank's current list of aj: in the merged dim that cut is

    Shard(m)                   when the dims before aj hold one position (P == 1)
    StridedShard(m, P)         P = the positions held of the dims before aj, equal on every rank

and it is exact only when each chunk of aj times the suffix S (the positions held of
the dims after aj) is the chunk of (aj x S) - i.e. chunk boundaries fall on whole
rows of the suffix, for every rank (uneven and empty shards included). A split is
the inverse: an output layout whose merge gives the input's layout.

Only lengths are tracked, never element positions, so the check is cheap on any
shape and mesh: the set of per-rank length tuples reached after each mesh dim.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from ..placements import Placement, Shard, StridedShard, chunk_size_and_offset


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input and output dims whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi: list[int] = []
        gj: list[int] = []
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


def resolve_size(src: Sequence[int], size: Sequence[int]) -> list[int]:
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = math.prod(src) // known if known else 0
    return size


def merged_placements(
    sizes: Sequence[int], cuts: Sequence[tuple[int, int, Placement]], mesh_shape: Sequence[int]
) -> list[tuple[int, int]] | None:
    """Merge dims of `sizes` into one: each cut (mesh dim, index into sizes, placement) in mesh order
    becomes a (mesh dim, split factor) of the merged dim (1 = plain Shard); None where not exact."""
    states = {tuple(sizes)}
    out = []
    for mesh_dim, j, p in cuts:
        n = mesh_shape[mesh_dim]
        prefixes = {math.prod(st[:j]) for st in states}
        if len(prefixes) != 1:
            return None  # ranks hold different numbers of leading rows: no single split factor
        prefix = prefixes.pop()
        pieces = p.split_factor if isinstance(p, StridedShard) else 1
        if prefix == 0:
            return None
        nxt = set()
        for st in states:
            length, suffix = st[j], math.prod(st[j + 1 :])
            if length % pieces:
                return None
            piece = length // pieces
            for t in range(n):
                size, off = chunk_size_and_offset(piece, n, t)
                merged_size, merged_off = chunk_size_and_offset(piece * suffix, n, t)
                if merged_size != size * suffix or merged_off != off * suffix:
                    return None
                nxt.add(st[:j] + (size * pieces,) + st[j + 1 :])
        states = nxt
        out.append((mesh_dim, prefix * pieces))
    return out


def _as_placement(dim: int, split_factor: int) -> Placement:
    return Shard(dim) if split_factor == 1 else StridedShard(dim, split_factor)


def view_layout(
    src: Sequence[int], dst: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[Placement, ...] | None:
    """The placements of `view(src -> dst)` for an input laid out as `placements`, or None
    where some shard does not map exactly (then the input must move first)."""
    out = list(placements)
    for gi, gj in view_groups(src, dst):
        cuts = [(i, p) for i, p in enumerate(placements) if isinstance(p, (Shard, StridedShard)) and p.dim in gi]
        for i, p in [(i, p) for i, p in cuts if src[p.dim] == 1]:
            paired = _paired_size_one_dim(p.dim, gi, gj, src, dst)
            if paired is None or isinstance(p, StridedShard):
                return None
            out[i] = Shard(paired)  # the first rank holds the one row, the others none, before and after
        cuts = [(i, p) for i, p in cuts if src[p.dim] != 1]
        if not cuts:
            continue
        real_in = [d for d in gi if src[d] != 1]
        real_out = [d for d in gj if dst[d] != 1]
        if any(p.dim not in real_in for _, p in cuts) or not real_out:
            return None
        if len(real_in) == 1 and len(real_out) == 1:
            for i, p in cuts:
                out[i] = (
                    StridedShard(real_out[0], p.split_factor) if isinstance(p, StridedShard) else Shard(real_out[0])
                )
        elif len(real_out) == 1:
            merged = merged_placements(
                [src[d] for d in real_in], [(i, real_in.index(p.dim), p) for i, p in cuts], mesh_shape
            )
            if merged is None:
                return None
            for i, sf in merged:
                out[i] = _as_placement(real_out[0], sf)
        elif len(real_in) == 1:
            split = _split(real_in[0], [dst[d] for d in real_out], cuts, mesh_shape)
            if split is None:
                return None
            for (i, _), j in zip(cuts, split):
                out[i] = Shard(real_out[j])
        else:
            return None
    return tuple(out)


def _paired_size_one_dim(
    d: int, gi: Sequence[int], gj: Sequence[int], src: Sequence[int], dst: Sequence[int]
) -> int | None:
    """The size-1 output dim a size-1 input dim stays (counted among the group's leading, or trailing,
    size-1 dims on both sides); None where it is folded into a real dim."""
    k = gi.index(d)
    if all(src[e] == 1 for e in gi[: k + 1]) and k < len(gj) and all(dst[e] == 1 for e in gj[: k + 1]):
        return gj[k]
    k_end = len(gi) - k
    if all(src[e] == 1 for e in gi[k:]) and k_end <= len(gj) and all(dst[e] == 1 for e in gj[len(gj) - k_end :]):
        return gj[len(gj) - k_end]
    return None


def _split(in_dim: int, sizes: Sequence[int], cuts, mesh_shape) -> tuple[int, ...] | None:
    """Which output dim each cut lands on: the assignment whose merge gives the input's layout."""
    want = [(i, p.split_factor if isinstance(p, StridedShard) else 1) for i, p in cuts]
    for choice in itertools.product(range(len(sizes)), repeat=len(cuts)):
        merged = merged_placements(sizes, [(i, j, Shard(0)) for (i, _), j in zip(cuts, choice)], mesh_shape)
        if merged == want:
            return choice
    return None
