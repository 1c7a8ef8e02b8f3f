"""Checkpoints in torch's own formats (pickling and torch.distributed.checkpoint).

- `torch.save` / `torch.load` of DTensors and state dicts holding them: `pickling`.
- The tensor-subclass hooks DCP's planner calls (on `DTensor`, backed by `chunks`), so
  `torch.distributed.checkpoint.save/load` work on shardops state dicts under torchrun.
- `load_safetensors(model, files)`: transformers weights, each rank reading its own slices.
- `save(state, path)` / `load(state, path)`: DCP's format in either world, atomic saves,
  ranged reads, checked loads, stateful objects (`api`); `RandomState` for resuming.

`save`/`load` import torch.distributed.checkpoint on first use (it is slow to import).
"""

from __future__ import annotations

from typing import Any

from ..tensor import DTensor
from .chunks import create_chunk_list, create_write_items, get_tensor_shard
from .pickling import reduce_dtensor, register_safe_globals
from .random_state import RandomState

# torch's persistence protocols, installed on DTensor here (this package reads DTensors through
# the seam, so tensor.py cannot import it): pickling as torch's DTensor pickles (this rank's
# shard and layout), and the tensor-subclass hooks torch.distributed.checkpoint's planner calls.
# (mypy: these are installed on the class on purpose, so each assignment says so)
DTensor.__reduce_ex__ = lambda self, proto: reduce_dtensor(self)  # type: ignore[method-assign]
DTensor.__create_write_items__ = lambda self, fqn, object: create_write_items(self, fqn)  # type: ignore[attr-defined]
DTensor.__create_chunk_list__ = create_chunk_list  # type: ignore[attr-defined]
DTensor.__get_tensor_shard__ = get_tensor_shard  # type: ignore[attr-defined]
register_safe_globals(DTensor)

__all__ = ["RandomState", "load", "load_safetensors", "save"]


def save(state: Any, path: Any) -> None:
    """Save `state` (names -> tensors, state dicts, values or stateful objects) to directory `path`."""
    from .api import save as _save

    _save(state, path)


def load(state: Any, path: Any, **kwargs: Any) -> None:
    """Load the checkpoint at `path` into `state` in place (see `shardops.checkpoint.api.load`)."""
    from .api import load as _load

    _load(state, path, **kwargs)


def load_safetensors(target: Any, source: Any, **kwargs: Any) -> Any:
    """Load safetensors files into a parallelized model, each rank reading only its slices
    (see `shardops.checkpoint.safetensors_load`)."""
    from .safetensors_load import load_safetensors as _load

    return _load(target, source, **kwargs)
