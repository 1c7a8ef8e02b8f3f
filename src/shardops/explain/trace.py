"""Tracing a call on META tensors: the aten ops torch dispatches to (after its own decompositions).

No data is allocated beyond metadata, and no world of ranks is needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._torch.dispatch import TorchDispatchMode
from ..dispatch import registry
from ..errors import ShardingError
from ..spec import TensorSpec

_WARM = {"done": False, "seconds": 0.0}


class Recorder(TorchDispatchMode):
    """Records every aten op (after torch's own decompositions), running it on meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []
        self.decomposed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        decomposition = registry.DECOMPOSITIONS.get(func)
        if decomposition is not None:  # the runtime rewrites it into other ops: plan those
            self.decomposed.append(str(func))
            with self:
                return decomposition(*args, **kwargs)
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


class Intercepts(TorchFunctionMode):
    """Notes torch-level callables that DTensor hands to registry.TORCH_FUNCTIONS."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            hit = func in registry.TORCH_FUNCTIONS
        except TypeError:  # unhashable callable
            hit = False
        if hit and func not in self.seen:
            self.seen.append(func)
        return func(*args, **(kwargs or {}))


def warm_up() -> float:
    """torch's first meta-kernel call imports dynamo (seconds); pay it once, and say how long it took."""
    if not _WARM["done"]:
        t0 = time.perf_counter()
        x = torch.empty(2, 3, device="meta")
        (x.exp() + x).sum(1)
        _WARM["seconds"] = time.perf_counter() - t0
        _WARM["done"] = True
        return _WARM["seconds"]
    return 0.0


def meta_tensor(spec: TensorSpec) -> torch.Tensor:
    return torch.empty_strided(spec.shape, spec.meta.stride, dtype=spec.dtype, device="meta")


_ACTIVE: list[Recorder] = []  # the recorder of the call being traced (explain.moe adds its routing step to it)


def active_recorder() -> Recorder | None:
    return _ACTIVE[-1] if _ACTIVE else None


def trace(fn: Callable[[], Any]) -> tuple[Recorder, Intercepts]:
    rec, intercepts = Recorder(), Intercepts()
    _ACTIVE.append(rec)
    try:
        with torch.no_grad(), intercepts, rec:
            fn()
    except ShardingError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. an op without a meta kernel, or .item()
        raise ShardingError(
            f"explain: torch cannot trace this call on meta tensors: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from None
    finally:
        _ACTIVE.pop()
    return rec, intercepts
