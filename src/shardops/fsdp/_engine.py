"""The one private torch API data parallelism needs: a callback at the end of the current backward.

PRIVATE TORCH API (torch 2.x, known for 2.4-2.13): `Variable._execution_engine.queue_callback`
runs a function once the autograd engine has finished the running backward pass. FSDP2 and DDP
use it to make sure every gradient reduction was issued before `backward()` returns. Kept here
alone so that the seam package (shardops/_torch) can take it over.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import ShardingError


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run `fn` when the backward pass that is running now ends (call from inside a backward hook)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):
        raise ShardingError(
            f"shardops.fsdp: this torch ({torch.__version__}) has no autograd engine callback "
            "(torch.autograd.Variable._execution_engine.queue_callback); fully_shard/replicate need it"
        )
    engine.queue_callback(fn)
