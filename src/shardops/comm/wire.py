"""The wire buffer of a reduce_scatter, shared by the eager (comm/torch_dist) and traced (comm/traceable) paths."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack_padded(chunks: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    """The chunks as one flat buffer, chunk i in row order[i], each zero-padded to the largest:
    the wire of a reduce_scatter (eager and traced, native or exchanged).

    Chunks that already are the heads of the rows of one (n, width) buffer, in wire order (what
    fully_shard packs its gradients into), are that buffer: no copy; the padding travels as it is
    (a reduce_scatter's receiver cuts it off unread). Equal shapes (the common, even case) are
    stacked: one copy, even when the chunks are strided slices of one tensor (`reshape(-1)` of a
    slice would copy it once more before the cat).
    """
    packed = _packed_already(chunks, order)
    if packed is not None:
        return packed
    rows: list = [None] * len(chunks)
    for i, c in enumerate(chunks):
        rows[order[i]] = c
    if len({c.shape for c in chunks}) == 1:
        return torch.stack(rows).view(-1)
    width = max(c.numel() for c in chunks)
    return torch.cat(
        [
            c.reshape(-1) if c.numel() == width else torch.cat([c.reshape(-1), c.new_zeros(width - c.numel())])
            for c in rows
        ]
    )


def _packed_already(chunks: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor | None:
    """The flat buffer whose row order[i] starts with chunks[i], when one (n, width) storage holds them so."""
    first = chunks[0]
    if any(type(c) is not torch.Tensor or not c.is_contiguous() for c in chunks):
        return None
    storage = first.untyped_storage()
    n, itemsize = len(chunks), first.element_size()
    if storage.nbytes() % (n * itemsize):
        return None
    width = storage.nbytes() // (n * itemsize)
    for i, c in enumerate(chunks):
        if c.dtype != first.dtype or c.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        if c.storage_offset() != order[i] * width or c.numel() > width:
            return None
    return first.new_empty(0).set_(storage, 0, (n * width,), (1,))
