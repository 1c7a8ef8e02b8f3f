"""The seam between shardops and torch's private internals: every private torch API shardops
uses lives in this package, one module per torch subsystem.

Each hook names the torch versions it is known for and fails loudly (`TorchInternalsError`,
naming the hook and the running torch) when the internal it needs is not there. Hooks are
installed by `install()`, one explicit idempotent call made by `so.run`, `DeviceMesh` and the
first DTensor; `import shardops` alone changes nothing of torch.
"""
from __future__ import annotations

import threading

from . import compile

SUBSYSTEMS = (compile,)  # each has an idempotent install()
_installed = [False]
_lock = threading.Lock()


def install() -> None:
    """Install every subsystem's hooks, once per process (cheap after the first call)."""
    if _installed[0]:
        return
    with _lock:
        if _installed[0]:
            return
        for subsystem in SUBSYSTEMS:
            subsystem.install()
        _installed[0] = True


def installed() -> bool:
    return _installed[0]
