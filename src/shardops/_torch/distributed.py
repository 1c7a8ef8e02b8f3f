"""torch.distributed.tensor's private placements, for the conversions to and from torch's DTensor (interop).

torch's DTensor has two placements it keeps private, with no public twin, that shardops' layouts
map to one for one; both are known for torch 2.13, 2.14 and 2.15. They are looked up on first use
(importing torch.distributed.tensor is not free, and only interop needs them); a torch without one
raises TorchInternalMissing naming the hook there.

- `strided_shard_class()`: `torch.distributed.tensor.placement_types._StridedShard`, a shard whose
  pieces were split `split_factor` times before sharding (our StridedShard).
- `norm_partial_class()`: `torch.distributed.tensor._ops._math_ops._NormPartial`, a pending p-norm
  reduction (our NormPartial).
"""

from __future__ import annotations

import functools
from typing import Any

from . import Hook, internal

PLACEMENTS = Hook("distributed.placements", "convert StridedShard and NormPartial to and from torch's DTensor")


@functools.cache
def strided_shard_class() -> type[Any]:
    return internal(PLACEMENTS, "torch.distributed.tensor.placement_types._StridedShard")


@functools.cache
def norm_partial_class() -> type:
    return internal(PLACEMENTS, "torch.distributed.tensor._ops._math_ops._NormPartial")
