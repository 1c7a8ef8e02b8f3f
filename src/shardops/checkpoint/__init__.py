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
from .pickling import register_safe_globals
from .random_state import RandomState

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
