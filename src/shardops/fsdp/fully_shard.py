"""`fully_shard`: torch 2.13's FSDP2 API on shardops DTensors (see docs/fsdp.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh, current_mesh, init_device_mesh
from ..placements import Shard
from ..world import current_comm
from ._param import DataMesh, FSDPParam
from ._presharded import divide_gradient, sharded_over
from ._state import install_hooks, post_backward, unit_of
from ._unit import FSDPUnit
from .api import MixedPrecisionPolicy, OffloadPolicy

_FSDP_CLASSES: dict[type, type] = {}


class FSDPModule:
    """The methods a module gains under fully_shard (its class becomes FSDP<Cls>)."""

    def __new__(cls, *args: Any, **kwargs: Any):
        # constructing an FSDP<Cls> (e.g. nn.Sequential slicing itself) makes a plain Cls, as torch does
        orig = cls.__mro__[2]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _unit(self) -> FSDPUnit:
        unit = unit_of(self)
        assert unit is not None  # fully_shard gave this module its unit
        return unit

    def _units(self, recurse: bool) -> list[FSDPUnit]:
        # a mixin: FSDP<Cls> is an nn.Module too
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        units: list[FSDPUnit] = []
        for m in modules:
            unit = unit_of(m)
            if unit is not None and unit not in units:
                units.append(unit)
        return units

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its sharded DTensors again."""
        self._unit().reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the parameters (one all_gather). async_op: started now, finished by the handle's
        wait() (or by the module's forward)."""
        unit = self._unit()
        if not async_op:
            unit.unshard()
            return None
        unit.start_unshard()
        return UnshardHandle(unit)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        for unit in self._units(True):
            unit.is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps the unsharded gradients (accumulated, in reduce_dtype) and sends
        nothing; the next synced backward reduces their sum."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_forward = bool(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """The reduced gradient sum is divided by `factor` instead of the data-parallel size."""
        self._unit().divide_factor = float(factor)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """These modules' gathers start once this module's own is done, before its forward computes."""
        _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")
        self._unit().forward_prefetch = list(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """These modules' gathers start at this module's pre-backward, while its backward computes
        (none by default: see docs/fsdp.md on memory)."""
        _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")
        self._unit().backward_prefetch = list(modules)

    def reset_iter_state(self) -> None:
        for unit in self._units(True):
            if unit.pending_backward:
                post_backward(unit)


class UnshardHandle:
    """What `unshard(async_op=True)` returns: wait() finishes the gather (the parameters are then unsharded)."""

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.unshard()


def _check_fsdp_modules(modules: Iterable[Any], what: str) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ShardingError(
                f"{what}: {type(m).__name__} is not a fully_shard module; apply fully_shard to it first"
            )


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
    """Shard `module`'s parameters (those no earlier fully_shard call on a submodule took) over
    `mesh` as one unit: gathered in one all_gather before its forward, reduce-scattered in one
    collective during backward. Call it bottom-up (blocks, then the root). Returns the module,
    whose class is now FSDP<Cls>. Parameters already sharded over `mesh` (expert parallelism's
    experts) stay as they are, their gradients only divided (_presharded)."""
    modules = tuple(module) if isinstance(module, list) else (module,)
    if not modules:
        raise ShardingError("fully_shard: an empty list of modules")
    if dp_mesh_dims is not None:
        raise ShardingError(
            "fully_shard: dp_mesh_dims is not supported yet; pass the data mesh (mesh=mesh['dp'], or "
            "mesh[('dp_replicate', 'dp_shard')] for HSDP)"
        )
    data = DataMesh(_data_mesh(mesh))
    if data.mesh.ndim not in (1, 2):
        raise ShardingError(
            f"fully_shard: the mesh must be 1-D (FSDP) or 2-D (replicate, shard: HSDP), got {data.mesh}"
        )
    for m in modules:
        if unit_of(m) is not None:
            raise ShardingError(f"fully_shard: {type(m).__name__} is already fully sharded")
    raf = _reshard_after_forward(reshard_after_forward, data)
    ignored = set(map(id, ignored_params or ()))
    presharded = [
        p for p, _ in _own_params(modules, ignored).values() if sharded_over(p, data.mesh)
    ]  # experts over ep = dp
    params = _collect_params(modules, data, shard_placement_fn, mp_policy, ignored | set(map(id, presharded)))
    unit = FSDPUnit(modules, params, data, mp_policy, raf)
    for expert in presharded:
        divide_gradient(expert, lambda: unit.divide_factor if unit.divide_factor is not None else float(data.size))
    for p in params:
        p.swap_in(unsharded=False)
    for m in modules:
        install_hooks(m, unit)
        m.__class__ = _fsdp_class(type(m))
    return list(modules) if isinstance(module, list) else module


def _data_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(
                "fully_shard: mesh must be a shardops DeviceMesh (so.init_device_mesh / DeviceMesh.from_torch), got "
                f"{type(mesh).__name__}"
            )
        return mesh
    entered = current_mesh()
    if entered is not None:
        return entered
    comm = current_comm()
    key = ("fsdp default mesh", comm.world_size)
    cached = getattr(comm, "_shardops_default_mesh", None)
    if cached is None or cached[0] != key:
        cached = (key, init_device_mesh("cpu", (comm.world_size,)))
        comm._shardops_default_mesh = cached  # type: ignore[attr-defined]  # a cache kept on the communicator
    return cached[1]


def _reshard_after_forward(value: bool | int | None, data: DataMesh) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value == data.shard_size:
            return True
        if value == 1:
            return False
        raise ShardingError(
            f"fully_shard: reshard_after_forward={value} (resharding to a smaller world) is not supported; "
            f"use True, False, or the shard size {data.shard_size}"
        )
    raise ShardingError(f"fully_shard: reshard_after_forward must be a bool, an int or None, got {value!r}")


def _collect_params(
    modules, data: DataMesh, shard_placement_fn, mp: MixedPrecisionPolicy, ignored: set[int]
) -> list[FSDPParam]:
    """The modules' parameters no nested unit manages, each with every (module, name) it appears under."""
    out = []
    for p, occurrences in _own_params(modules, ignored).values():
        shard_dim = 0
        if shard_placement_fn is not None:
            placement = shard_placement_fn(p)
            if placement is not None:
                if type(placement) is not Shard:
                    raise ShardingError(
                        f"fully_shard: shard_placement_fn must return Shard(dim) or None, got {placement!r}"
                    )
                shard_dim = placement.dim
        out.append(FSDPParam(p, occurrences, data, shard_dim, mp.param_dtype))
    return out


def _own_params(modules, ignored: set[int]) -> dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """The parameters this call takes (no nested unit's, none ignored), each once, with every
    (module, name) it appears under."""
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for root in modules:
        for sub in _unmanaged_modules(root):
            for name, p in sub._parameters.items():
                if p is not None and id(p) not in ignored:
                    found.setdefault(id(p), (p, []))[1].append((sub, name))
    return found


def _unmanaged_modules(root: nn.Module) -> list[nn.Module]:
    """`root` and its submodules, without the subtrees an earlier fully_shard call took."""
    out, stack = [], [root]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in reversed(list(m.children())) if unit_of(c) is None)
    return out


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def unit_of_any(module: nn.Module) -> bool:
    """Whether fully_shard manages `module` or a submodule of it."""
    return any(unit_of(m) is not None for m in module.modules())
