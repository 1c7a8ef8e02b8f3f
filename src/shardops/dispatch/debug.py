"""SHARDOPS_DEBUG=1: check across ranks that every dispatch agrees.

Each rank must pick the same candidate and plans (ranks that disagree would issue
different collectives and deadlock or compute garbage), and a plain torch.Tensor
operand taken as Replicate (a one-element tensor, or any inside
`implicit_replication()`: dispatch/mixed.py) must really be equal on every rank. The check is one
uncounted all_gather of a few int64 checksums over the whole mesh, so it never
changes what CommDebugMode reports.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ShardingError


def _crc(data: bytes) -> int:
    return zlib.crc32(data) & 0x7FFFFFFF


def decision_checksum(decision: Any) -> int:
    c = decision.candidate
    # Global shapes and dtypes too: ranks that disagree on them (from_local with uneven locals and no
    # shape=) pick the same plan but move differently sized pieces.
    metas = repr([(s.shape, s.dtype, s.placements) for s in decision.in_specs])
    text = (
        repr(decision.func)
        + (c.describe() if c is not None else "fallback")
        + repr([p.steps for p in decision.plans])
        + metas
    )
    return _crc(text.encode())


def tensor_checksum(t: torch.Tensor) -> int:
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return _crc(bytes(raw.tolist()))  # no numpy dependency; debug mode only


def check_agreement(decision: Any, plain: Sequence[tuple[int, torch.Tensor]]) -> None:
    """`plain`: (operand index, tensor) of each plain torch.Tensor operand, taken as Replicate."""
    mesh = decision.in_specs[0].mesh
    sums = [decision_checksum(decision)] + [tensor_checksum(t) for _, t in plain]
    mine = torch.tensor(sums, dtype=torch.int64)
    group = mesh.group(tuple(range(mesh.ndim)))
    comm = mesh.comm
    if group.size == 1:
        return
    everyone = comm._all_gather(mine, group, [tuple(mine.shape)] * group.size)  # uncounted on purpose
    for rank, theirs in zip(group.ranks, everyone):
        if theirs[0] != mine[0]:
            raise ShardingError(
                f"{decision.func}: ranks chose different strategies (rank {comm.rank}: "
                f"{decision.candidate.describe() if decision.candidate else 'fallback'}; rank {rank} differs). "
                "Every rank must see the same shapes, placements, arguments and link model."
            )
        for j, (k, _) in enumerate(plain, start=1):
            if theirs[j] != mine[j]:
                raise ShardingError(
                    f"{decision.func}: plain tensor operand #{k} is taken as Replicate but differs between rank "
                    f"{comm.rank} and rank {rank}; make it a DTensor with DTensor.from_local(t, mesh, placements) "
                    "(this rank's piece) or so.distribute_tensor, or make it equal on every rank."
                )
