"""The one seam between shardops and torch's internals and the torch functions it replaces.

One module per torch subsystem (`random`: the default generator, torch.manual_seed & co.,
nn.init, the dispatch-mode stack; `compile`: dynamo, AOTAutograd, fake tensors, effect tokens,
functional collectives; `autograd`: the engine's end-of-backward callback). Each names its hooks
with the torch versions they are known for, and checks for the internals they need when
installed: a missing one raises `TorchInternalMissing` naming the hook and the running torch,
never a silent fallback.

Modules that only read torch's internals change nothing and install nothing (`dispatch`: operator
types, the torch-function and dispatch switches, wrapper subclasses; `pytree`: nested containers;
`distributed`: torch DTensor's private placements; `serialization`: the records torch.save writes).
They bind each internal once, through `internal()`, at import or first use, so a torch without it
fails there with the same TorchInternalMissing; the hot paths then use a plain module-level name.
Outside this package, src/shardops names no private torch API (tests/test_compile_seam.py).

Importing shardops changes nothing in torch. `install()` puts every hook in place, once per
process; shardops calls it where torch must behave as shardops promises: `so.run`, and
every `DeviceMesh` (so `init_device_mesh`, a mesh from torch's, and any DTensor, which has one).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any

import torch

# Every subsystem module, installed in this order by install(); one line each.
SUBSYSTEMS = (
    "random",
    "compile",
    "autograd",
)

_installed = False
_lock = threading.Lock()


class TorchInternalMissing(RuntimeError):
    """This torch lacks an internal a shardops hook needs."""


@dataclass(frozen=True)
class Hook:
    """A change shardops makes to torch: its name, what it does, and the torch versions it is known for."""

    name: str
    purpose: str
    known_for: tuple[str, ...] = ("2.13", "2.14", "2.15")


def require(hook: Hook, owner: Any, attribute: str, owner_name: str) -> Any:
    """`owner.attribute`, or a loud TorchInternalMissing naming the hook, the internal and this torch."""
    try:
        return getattr(owner, attribute)
    except AttributeError:
        raise TorchInternalMissing(
            f"shardops hook {hook.name!r} ({hook.purpose}) needs {owner_name}.{attribute}, which torch "
            f"{torch.__version__} does not have; the hook is known for torch {', '.join(hook.known_for)}. "
            "Install one of those torch versions, or report this torch version to shardops."
        ) from None


def internal(hook: Hook, dotted: str) -> Any:
    """The object torch calls `dotted` ("torch._C.DisableTorchFunctionSubclass", "torch.utils._pytree.tree_map"),
    imported as far as a module goes and read attribute by attribute after; a TorchInternalMissing
    naming the hook and the running torch when any part of it is missing."""
    parts = dotted.split(".")
    owner: Any = None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            owner = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    if owner is None:
        raise TorchInternalMissing(
            f"shardops hook {hook.name!r} ({hook.purpose}) needs {dotted}: no part of it imports"
        )
    for j in range(i, len(parts)):
        owner = require(hook, owner, parts[j], ".".join(parts[:j]))
    return owner


def install() -> None:
    """Put every hook of every subsystem in place; idempotent and thread-safe.

    A hook whose internal is missing raises (TorchInternalMissing) and install() stays undone,
    so the next call raises again rather than running with half of shardops' guarantees.
    """
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        for name in SUBSYSTEMS:
            importlib.import_module(f"{__name__}.{name}").install()
        _installed = True


def installed() -> bool:
    return _installed
