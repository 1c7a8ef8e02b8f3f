"""torch.utils._pytree, as shardops uses it: flattening nested containers of tensors and rebuilding them.

torch has no public pytree module (torch 2.13, 2.14 and 2.15 keep it private, as
torch.utils._pytree, and dynamo traces through it). Each function is bound once, at import, so
callers pay no extra call; the hook is known for torch 2.13, 2.14 and 2.15, and a torch without one
fails the import with TorchInternalMissing naming it. Registering constants with pytree is a
compile hook (compile.py), not here.

- `tree_flatten(tree) -> (leaves, spec)` and `tree_unflatten(leaves, spec)`: a nested structure to
  its leaves and back.
- `tree_leaves(tree)`: the leaves only.
- `tree_map(fn, tree)`: the same structure with fn applied to each leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import Hook, internal

PYTREE = Hook("pytree", "flatten and rebuild nested op arguments, outputs and state")

tree_flatten: Callable[..., tuple[list[Any], Any]] = internal(PYTREE, "torch.utils._pytree.tree_flatten")
tree_unflatten: Callable[[list[Any], Any], Any] = internal(PYTREE, "torch.utils._pytree.tree_unflatten")
tree_leaves: Callable[..., list[Any]] = internal(PYTREE, "torch.utils._pytree.tree_leaves")
tree_map: Callable[..., Any] = internal(PYTREE, "torch.utils._pytree.tree_map")
