"""Data parallelism as torch writes it: `fully_shard` (FSDP2) and `replicate` (composable DDP)
on shardops DTensors. Only parameters are distributed; activations stay what the user's code
makes them (docs/fsdp.md)."""

from .api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .fully_shard import FSDPModule, UnshardHandle, fully_shard
from .replicate import replicate

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "replicate",
]
