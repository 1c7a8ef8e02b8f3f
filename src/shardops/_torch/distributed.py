"""torch.distributed's private names: DTensor's private placements for interop, and the torch side's replicate.

torch's DTensor has two placements it keeps private, with no public twin, that shardops' layouts
map to one for one; both are known for torch 2.13, 2.14 and 2.15. They are looked up on first use
(importing torch.distributed.tensor is not free, and only interop needs them); a torch without one
raises TorchInternalMissing naming the hook there.

- `strided_shard_class()`: `torch.distributed.tensor.placement_types._StridedShard`, a shard whose
  pieces were split `split_factor` times before sharding (our StridedShard).
- `norm_partial_class()`: `torch.distributed.tensor._ops._math_ops._NormPartial`, a pending p-norm
  reduction (our NormPartial).
- `torch_fsdp_replicate()`: `torch.distributed._composable.replicate_with_fsdp.replicate`, what the
  training comparison's torch side (training/torch_side.py) data-parallelizes with.
- `default_store()`: `torch.distributed.distributed_c10d._get_default_store()`, the key-value store every
  rank reaches; a pipeline step that fails on one rank leaves a flag there that its peers' waits poll.
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


TORCH_REPLICATE = Hook(
    "distributed.replicate_with_fsdp",
    "the training comparison's torch side: torch's FSDP-based replicate (its DDP-based one does not average "
    "tensor-parallel gradients)",
)


@functools.cache
def torch_fsdp_replicate() -> Any:
    """torch's `replicate` built on FSDP2 (known for torch 2.13, 2.14 and 2.15; no public path yet)."""
    return internal(TORCH_REPLICATE, "torch.distributed._composable.replicate_with_fsdp.replicate")


DEFAULT_STORE = Hook(
    "distributed.default_store",
    "a failed pipeline step's flag, which the peers' point-to-point waits poll so that they raise at once",
)


def default_store() -> Any:
    """The default process group's store (no public accessor in torch 2.13 to 2.15)."""
    return internal(DEFAULT_STORE, "torch.distributed.distributed_c10d._get_default_store")()
