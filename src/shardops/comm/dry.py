"""The dry world: one rank of a world of any size, whose collectives move nothing.

Pricing a plan from metadata alone (so.autoparallel on meshes of thousands of ranks) runs
the very code a rank runs (styles, planner, autograd) on META local tensors, as one rank
of the world. Every collective goes through `Communicator`'s public methods, so it is
counted exactly as in the other worlds; the dry `_impl` methods then return tensors of
the shapes the other members would have sent, with no values. Values are never read:
the local tensors are meta, and a tensor that is not meta is refused (its result would
be made-up numbers).

`symmetric` stays True while every collective this rank joined had members of equal shares
(equal shapes gathered, scattered and exchanged; no broadcast from another member): then
every rank of the world issues the same collectives with the same bytes, and this one rank's
count is every rank's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ShardingError
from .base import Communicator, Group, P2POp, P2PWork


def _like(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=t.dtype, device="meta")


class DryCommunicator(Communicator):
    """Rank `rank` of a world of `world_size` ranks that exist only as metadata."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ShardingError(f"dry world: rank {rank} is not in a world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.symmetric = True

    def _note_shares(self, shapes) -> None:
        if len({tuple(s) for s in shapes}) > 1:
            self.symmetric = False

    def _check(self, kind: str, t: torch.Tensor) -> None:
        if not t.is_meta:
            raise ShardingError(
                f"dry world: {kind} of a {t.device} tensor; the dry world prices steps on meta tensors only "
                "(its collectives return no values)"
            )

    def _all_reduce(self, t, op, group: Group):
        self._check("all_reduce", t)
        return _like(t, t.shape)

    def _all_gather(self, t, group: Group, shapes):
        self._check("all_gather", t)
        self._note_shares(shapes)
        me = group.index(self.rank)
        return [t if i == me else _like(t, s) for i, s in enumerate(shapes)]

    def _reduce_scatter(self, chunks, op, group: Group):
        self._check("reduce_scatter", chunks[0])
        self._note_shares([c.shape for c in chunks])
        return _like(chunks[0], chunks[group.index(self.rank)].shape)

    def _all_to_all(self, chunks, group: Group, recv_shapes):
        self._check("all_to_all", chunks[0])
        self._note_shares([c.shape for c in chunks])
        self._note_shares(recv_shapes)
        me = group.index(self.rank)
        return [chunks[me] if i == me else _like(chunks[0], s) for i, s in enumerate(recv_shapes)]

    def _broadcast(self, t, src_index: int, group: Group):
        self._check("broadcast", t)
        if group.index(self.rank) != src_index:
            self.symmetric = False  # the source sends, this rank does not
        return _like(t, t.shape)

    def _barrier(self, group: Group) -> None:
        pass

    def _batch_isend_irecv(self, ops: list[P2POp]) -> list[P2PWork]:
        for p2p in ops:
            self._check(p2p.kind, p2p.tensor)
        self.symmetric = False  # point to point: other ranks send and receive other things
        return [P2PWork() for _ in ops]  # a meta recv buffer already has the shape it would receive
