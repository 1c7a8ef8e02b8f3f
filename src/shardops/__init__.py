"""shardops: sharded tensor math on PyTorch."""

from . import (
    checkpoint,
    fsdp,
    parallel,
    pipelining,
    remesh,  # noqa: F401 - installs copy_ and load_state_dict across meshes
)
from . import ops as _ops  # noqa: F401  (registers strategies)
from .autoparallel import autoparallel  # the function; the package stays importable by its full name
from .comm.base import CommDebugMode
from .cost import Link, set_links
from .dispatch.core import FallbackWarning, allow_replicate, set_debug, set_strict
from .errors import CollectiveError, ShardingError
from .explain import explain
from .fsdp import fully_shard, replicate  # torch.distributed.fsdp.fully_shard, composable replicate
from .interop import from_torch, to_torch
from .interop import rank_random as _rank_random  # noqa: F401 - gives so.run's rank threads their own random state
from .mesh import DeviceMesh, init_device_mesh
from .parallel import distribute_module
from .placements import NormPartial, Partial, Placement, Replicate, Shard, StridedShard
from .tensor import DTensor, distribute_tensor, from_local
from .world import run

__all__ = [
    "CollectiveError",
    "CommDebugMode",
    "allow_replicate",
    "checkpoint",
    "DTensor",
    "DeviceMesh",
    "FallbackWarning",
    "Link",
    "NormPartial",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "ShardingError",
    "StridedShard",
    "distribute_module",
    "distribute_tensor",
    "explain",
    "from_local",
    "from_torch",
    "init_device_mesh",
    "parallel",
    "pipelining",
    "run",
    "set_debug",
    "set_links",
    "set_strict",
    "to_torch",
]
__all__ += ["autoparallel", "fsdp", "fully_shard", "replicate"]
__version__ = "0.1.0"
