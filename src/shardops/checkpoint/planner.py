"""The load planner of `shardops.checkpoint.load`: torch's default planner, checked.

torch's `DefaultLoadPlanner` copies with a silent dtype cast, and reads nothing for a
box the checkpoint does not cover. Here every key of the destination is checked
against the checkpoint first (presence, kind, global shape, dtype: the first mismatch
is named with both sides), and after planning every element this rank holds must be
the target of a read: anything not loaded is an error, never an initial value left
in place.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from ..errors import ShardingError


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner + the key/shape/dtype checks and the coverage check (see module doc)."""

    def create_local_plan(self) -> LoadPlan:
        self._check_keys()
        plan = super().create_local_plan()
        self._check_coverage(plan)
        return plan

    def _check_keys(self) -> None:
        assert self.metadata is not None  # set_up_planner gave it
        saved = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if md is None:
                if self.allow_partial_load:
                    continue
                near = sorted(saved)[:5]
                raise ShardingError(
                    f"checkpoint load: key {fqn!r} is not in the checkpoint (it holds {len(saved)} keys, e.g. {near}); "
                    "pass the state it was saved with"
                )
            if isinstance(obj, torch.Tensor):
                if isinstance(md, BytesStorageMetadata):
                    raise ShardingError(
                        f"checkpoint load: key {fqn!r} is a tensor here ({_describe(obj)}) but a Python object in the "
                        "checkpoint"
                    )
                if tuple(md.size) != tuple(obj.shape) or md.properties.dtype != obj.dtype:
                    raise ShardingError(
                        f"checkpoint load: key {fqn!r} mismatches: checkpoint "
                        f"{str(md.properties.dtype).replace('torch.', '')}{list(md.size)}, destination {_describe(obj)}"
                    )
            elif isinstance(md, TensorStorageMetadata):
                raise ShardingError(
                    f"checkpoint load: key {fqn!r} is {type(obj).__name__} here but a tensor {list(md.size)} in the "
                    "checkpoint"
                )

    def _check_coverage(self, plan: LoadPlan) -> None:
        loaded: dict[str, int] = {}
        for item in plan.items:
            loaded[item.dest_index.fqn] = loaded.get(item.dest_index.fqn, 0) + math.prod(item.lengths)
        assert self.metadata is not None  # set_up_planner gave it
        for fqn, obj in self.state_dict.items():
            if not isinstance(obj, torch.Tensor) or fqn not in self.metadata.state_dict_metadata:
                continue
            chunks = obj.__create_chunk_list__() if hasattr(obj, "__create_chunk_list__") else None
            needed = sum(math.prod(c.sizes) for c in chunks) if chunks is not None else obj.numel()
            if loaded.get(fqn, 0) != needed:
                raise ShardingError(
                    f"checkpoint load: key {fqn!r}: the checkpoint covers {loaded.get(fqn, 0)} of the {needed} "
                    "elements this rank holds; the checkpoint is incomplete (a rank's shards were never written)"
                )


def _describe(t: Any) -> str:
    layout = f":{','.join(map(repr, t.placements))}" if hasattr(t, "placements") else ""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}{layout}"
