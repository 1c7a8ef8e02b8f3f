"""torch.distributed.tensor.experimental's names that shardops offers."""

from .dispatch.mixed import implicit_replication

__all__ = ["implicit_replication"]
