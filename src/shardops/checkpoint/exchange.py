"""Python objects between ranks over shardops' own communicator, in either world.

DCP's coordination (gather the local plans, scatter the global plan, gather the
write results) needs object collectives; torch's come from a process group, which the
threads world does not have. These ride on `Communicator.all_gather` / `broadcast`
as pickled bytes (two rounds: the sizes, then the bytes), so the same checkpoint code
runs inside `so.run` and under torchrun.

A step that fails on one rank must not leave the others waiting: `agree` runs a step on
every rank, exchanges each rank's outcome, and raises the first failure on all of them.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from ..comm.base import Communicator, Group
from ..errors import ShardingError
from ..world import current_comm


class RankFailed(ShardingError):
    """Raised on every rank when one rank's checkpoint step failed (the message names it)."""


def world() -> tuple[Communicator, Group]:
    comm = current_comm()
    return comm, Group(tuple(range(comm.world_size)))


def _to_bytes(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def all_gather_object(obj: Any) -> list[Any]:
    comm, group = world()
    mine = _to_bytes(obj)
    sizes = comm.all_gather(torch.tensor([mine.numel()], dtype=torch.int64), group)
    shapes = [(int(s),) for s in sizes]
    return [pickle.loads(t.numpy().tobytes()) for t in comm.all_gather(mine, group, shapes)]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    comm, group = world()
    mine = _to_bytes(obj) if comm.rank == src else torch.empty(0, dtype=torch.uint8)
    size = comm.broadcast(torch.tensor([mine.numel()], dtype=torch.int64), src, group)
    if comm.rank != src:
        mine = torch.empty(int(size), dtype=torch.uint8)
    return pickle.loads(comm.broadcast(mine, src, group).numpy().tobytes())


def _outcome(step: Callable[[], Any]) -> tuple[Any, str | None, BaseException | None]:
    try:
        return step(), None, None
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        return None, f"{type(e).__name__}: {e}", e


def agree(what: str, step: Callable[[], Any]) -> list[Any]:
    """Run `step` on every rank and gather the results; if any rank failed, every rank raises."""
    result, error, exc = _outcome(step)
    gathered = all_gather_object((result, error))
    failures = [(rank, err) for rank, (_, err) in enumerate(gathered) if err is not None]
    if failures:
        rank, err = failures[0]
        if exc is not None and rank == current_comm().rank:
            raise exc  # this rank's own error, with its traceback and type
        raise RankFailed(f"{what} failed on rank {rank}: {err}")
    return [r for r, _ in gathered]


def agree_local(what: str, step: Callable[[], Any]) -> Any:
    """`agree`, returning this rank's own result only (the others' are not sent: a flag is)."""
    result, error, exc = _outcome(step)
    gathered = all_gather_object(error)
    failures = [(rank, err) for rank, err in enumerate(gathered) if err is not None]
    if failures:
        rank, err = failures[0]
        if exc is not None and rank == current_comm().rank:
            raise exc
        raise RankFailed(f"{what} failed on rank {rank}: {err}")
    return result


__all__ = ["RankFailed", "agree", "agree_local", "all_gather_object", "broadcast_object"]
