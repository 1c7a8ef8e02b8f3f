"""A DTensor's local shard as boxes of the global tensor: what torch.distributed.checkpoint stores.

DCP describes every saved piece as a box (offsets and sizes in the global tensor). A
`Shard` shard is one box; a `StridedShard` shard is several (a rank holds one run of
each split piece), so the hooks report one box per run of consecutive global indices,
per dim, and the box list is their product. Empty shards have no box: they hold
nothing to write and need nothing read.

These functions back the DTensor hooks DCP's planner calls (`__create_write_items__`,
`__create_chunk_list__`, `__get_tensor_shard__`, see tensor.py).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ShardingError
from ..placements import dim_positions, without_partials
from ..world import current_comm, in_threads_world
from ..wrapping import local_of, relayout, spec_of

_coordinated = threading.local()  # set while shardops.checkpoint's own save plans, on this rank thread


@contextmanager
def coordinated_save() -> Any:
    """Marks a save whose ranks shardops coordinates (see `check_torch_save_can_coordinate`)."""
    _coordinated.active = True
    try:
        yield
    finally:
        _coordinated.active = False


def check_torch_save_can_coordinate(fqn: str) -> None:
    """torch's `dcp.save` inside `so.run` sees no process group: every rank thread acts as a lone
    rank 0 and they overwrite each other's files. Raise on every rank before anything is written."""
    if getattr(_coordinated, "active", False) or not in_threads_world() or current_comm().world_size == 1:
        return
    raise ShardingError(
        f"torch.distributed.checkpoint.save of {fqn!r} inside so.run: torch's DCP coordinates ranks through a process "
        f"group, which the threads world ({current_comm().world_size} rank threads) does not have, so the ranks would "
        "overwrite each other's files; use shardops.checkpoint.save(state, path) (the same DCP files, readable by "
        "torch's dcp.load), or run under torchrun"
    )


@dataclass(frozen=True)
class Box:
    """One piece of a local shard: where it sits in the global tensor and in the local one."""

    offsets: tuple[int, ...]  # in the global tensor
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]  # in this rank's local tensor

    def narrow(self, local: torch.Tensor) -> torch.Tensor:
        """The view of `local` this box covers."""
        view = local
        for d, (start, size) in enumerate(zip(self.local_offsets, self.sizes)):
            if start != 0 or size != local.shape[d]:
                view = view.narrow(d, start, size)
        return view


def runs(positions: range | Sequence[int]) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of each run of consecutive global positions."""
    if isinstance(positions, range) and positions.step == 1:
        return [(positions.start, 0, len(positions))] if len(positions) else []
    out: list[tuple[int, int, int]] = []
    for local, g in enumerate(positions):
        if out and out[-1][0] + out[-1][2] == g:
            start, lstart, n = out[-1]
            out[-1] = (start, lstart, n + 1)
        else:
            out.append((g, local, 1))
    return out


def local_boxes(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> list[Box]:
    """The boxes of the shard at `coordinate` (none for an empty shard; one for a 0-d tensor)."""
    per_dim = [runs(dim_positions(n, d, mesh_shape, coordinate, placements)) for d, n in enumerate(shape)]
    return [
        Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo), tuple(r[1] for r in combo))
        for combo in itertools.product(*per_dim)
    ]


def boxes_of(dt: Any) -> list[Box]:
    spec = spec_of(dt)
    coord = spec.mesh.get_coordinate()
    if coord is None:
        return []  # not on this tensor's mesh: nothing to write or read here (as torch skips it)
    return local_boxes(spec.shape, spec.mesh.shape, coord, spec.placements)


def resolve_pending(dt: Any, what: str) -> None:
    """A pending (Partial) DTensor becomes Replicate in place before it is saved or loaded.

    Its value is unchanged: the pending reduction runs once (a collective over the
    partial mesh dims, which every rank of the mesh reaches as DCP's planner visits
    the same keys in the same order on every rank).
    """
    spec = spec_of(dt)
    target = without_partials(spec.placements)
    if target == spec.placements:
        return
    if spec.mesh.get_coordinate() is None:
        raise ShardingError(f"{what}: a pending (Partial) tensor off this rank's mesh cannot be resolved here")
    relayout(dt, target)


def create_write_items(dt: Any, fqn: str) -> list[Any]:
    """DCP write items for this rank's boxes (replicated boxes share an index: DCP keeps one)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    check_torch_save_can_coordinate(fqn)
    resolve_pending(dt, f"checkpoint save of {fqn!r}")
    local = local_of(dt)
    properties = TensorProperties.create_from_tensor(local)
    size = torch.Size(spec_of(dt).shape)
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(b.offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)), properties=properties, size=size
            ),
        )
        for b in boxes_of(dt)
    ]


def create_chunk_list(dt: Any) -> list[Any]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    resolve_pending(dt, "checkpoint load")
    return [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in boxes_of(dt)]


def get_tensor_shard(dt: Any, index: Any) -> torch.Tensor:
    """The view of this rank's local tensor that the box at `index.offset` covers (written to on load)."""
    boxes = boxes_of(dt)
    if index.index is not None and index.index < len(boxes) and boxes[index.index].offsets == tuple(index.offset or ()):
        return boxes[index.index].narrow(local_of(dt))
    for b in boxes:
        if b.offsets == tuple(index.offset or ()):
            return b.narrow(local_of(dt))
    raise ShardingError(
        f"checkpoint: {index.fqn!r} has no box at offsets {tuple(index.offset or ())} on rank "
        f"{spec_of(dt).mesh.get_rank()} (its boxes: {[b.offsets for b in boxes]}, layout {spec_of(dt)!r})"
    )
