"""The wire buffer of a reduce_scatter, shared by the eager (comm/torch_dist) and traced (comm/traceable) paths."""
from __future__ import annotations

from typing import Sequence

import torch


def pack_padded(chunks: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    """The chunks as one flat buffer, chunk i in row order[i], each zero-padded to the largest:
    the wire of a reduce_scatter (eager and traced, native or exchanged).

    Equal shapes (the common, even case) are stacked: one copy, even when the chunks are
    strided slices of one tensor (`reshape(-1)` of a slice would copy it once more before the cat).
    """
    rows: list = [None] * len(chunks)
    for i, c in enumerate(chunks):
        rows[order[i]] = c
    if len({c.shape for c in chunks}) == 1:
        return torch.stack(rows).view(-1)
    width = max(c.numel() for c in chunks)
    return torch.cat([c.reshape(-1) if c.numel() == width else torch.cat([c.reshape(-1), c.new_zeros(width - c.numel())]) for c in rows])
