"""Module-level parallelism: torch.distributed.tensor.parallel's API on shardops DTensors.

    from shardops.parallel import parallelize_module, ColwiseParallel, RowwiseParallel, ...

ports a torchtitan-style plan by changing its import (torch's placements are accepted too).
Data parallelism is torch's composable API: `shardops.fsdp.fully_shard` / `replicate`.
"""

from .api import parallelize_module
from .conv_style import ChannelParallel, InputChannelParallel, OutputChannelParallel
from .distribute import distribute_module
from .expert import ExpertParallel
from .loss import loss_parallel
from .style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ChannelParallel",
    "ColwiseParallel",
    "ExpertParallel",
    "InputChannelParallel",
    "OutputChannelParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "distribute_module",
    "loss_parallel",
    "parallelize_module",
]
from .transformers import from_transformers  # noqa: E402 - after the styles it builds on

__all__ += ["from_transformers"]
