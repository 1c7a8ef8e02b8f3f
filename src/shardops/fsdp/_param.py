"""One parameter under `fully_shard`: its sharded DTensor and its unsharded tensor.

The sharded DTensor is what the module holds between forwards, what `parameters()`,
`state_dict()` and the optimizer see: sharded over the data mesh's shard dim (Shard(0) by
default), replicated over its replicate dim (HSDP), composed with the parameter's tensor-parallel
layout when it already is a DTensor on a tp sub-mesh of the same root mesh (StridedShard where
the tp plan shards the same dim after dp in mesh order, as torch lays FSDP+TP out).

The unsharded tensor is what forward and backward compute with: a plain leaf parameter (pure
FSDP) or a leaf DTensor on the tp sub-mesh in the tp layout (2-D), so activations stay what the
user's code makes them. Its storage is allocated when the unit gathers and freed (resized to
zero) when it reshards; autograd's saved references to it see the data again when it is
re-gathered for backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate, Shard, StridedShard
from ..spec import TensorMeta, TensorSpec
from ..tensor import DTensor
from ..wrapping import local_of, shard_in, spec_of, wrap

SHARDED_MARK = "_shardops_fsdp_sharded"  # set on the sharded parameters fully_shard makes


@dataclass(frozen=True)
class DataMesh:
    """fully_shard's mesh: 1-D (shard) or 2-D (replicate, shard) for HSDP."""

    mesh: DeviceMesh

    @property
    def shard_group(self):
        return self.mesh.group(self.mesh.ndim - 1)

    @property
    def replicate_group(self):
        return self.mesh.group(0) if self.mesh.ndim == 2 else None

    @property
    def shard_size(self) -> int:
        return self.mesh.shape[-1]

    @property
    def shard_rank(self) -> int:
        return self.mesh.own_coordinate()[-1]

    @property
    def size(self) -> int:
        return self.mesh.size()

    def placements(self, shard: Placement) -> tuple[Placement, ...]:
        return (Replicate(),) * (self.mesh.ndim - 1) + (shard,)


def chunk_slice(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk `index` of `n` rows cut in `parts` as torch.chunk cuts them."""
    size = math.ceil(n / parts) if n else 0
    start = min(index * size, n)
    return start, min(n, start + size) - start


class FSDPParam:
    """A parameter's two forms and the moves between them (the unit issues the collectives)."""

    def __init__(
        self,
        param: nn.Parameter,
        occurrences: list[tuple[nn.Module, str]],
        data: DataMesh,
        shard_dim: int,
        param_dtype: torch.dtype | None,
    ) -> None:
        if param.ndim == 0:
            raise ShardingError(
                f"fully_shard: a 0-d parameter ({occurrences[0][1]} of {type(occurrences[0][0]).__name__}) cannot be "
                "sharded on a dim; pass it in ignored_params, or make it 1-d"
            )
        if getattr(param, SHARDED_MARK, False):
            raise ShardingError(
                f"fully_shard: {occurrences[0][1]} of {type(occurrences[0][0]).__name__} is already sharded by another "
                "unit (a parameter shared between units, e.g. tied weights): put the modules that share it in one unit"
            )
        self.occurrences = occurrences
        self.data = data
        self.requires_grad = param.requires_grad
        self.orig_dtype = param.dtype
        self.dtype = param_dtype or param.dtype  # unsharded (compute) dtype
        self.global_shape = tuple(param.shape)
        self.tp_spec: TensorSpec | None = spec_of(param) if isinstance(param, DTensor) else None
        full = (local_of(param) if isinstance(param, DTensor) else param).detach()
        if not -full.ndim <= shard_dim < full.ndim:
            raise ShardingError(
                f"fully_shard: Shard({shard_dim}) for a parameter of shape {tuple(param.shape)}; use a dim in "
                f"[{-full.ndim}, {full.ndim})"
            )
        self.shard_dim = shard_dim % full.ndim
        self.unsharded_shape = tuple(full.shape)
        rows = self.unsharded_shape[self.shard_dim]
        self.member_slices = [chunk_slice(rows, data.shard_size, r) for r in range(data.shard_size)]
        rest = math.prod(self.unsharded_shape) // rows if rows else 0
        self.member_numels = [length * rest for _, length in self.member_slices]
        start, length = self.member_slices[data.shard_rank]
        local = full.narrow(self.shard_dim, start, length).clone(memory_format=torch.contiguous_format)
        # a DTensor that is also an nn.Parameter: no one type says both
        self.sharded: Any = nn.Parameter(wrap(local, self._sharded_spec(param)), requires_grad=param.requires_grad)
        for t in (self.sharded, param):  # the original too: a module outside this unit may still hold it (tied weights)
            setattr(t, SHARDED_MARK, True)
        self.unsharded: nn.Parameter | None = None
        self._buffer: torch.Tensor | None = None
        self.accumulated: torch.Tensor | None = None  # unsynced micro-batches' gradient (reduce dtype)

    # -- layouts
    def _sharded_spec(self, param: nn.Parameter) -> TensorSpec:
        meta = TensorMeta(self.global_shape, _contiguous_stride(self.global_shape), self.orig_dtype)
        if self.tp_spec is None:
            spec = TensorSpec(self.data.mesh, self.data.placements(Shard(self.shard_dim)), meta)
        else:
            spec = _composed_spec(self.data, self.tp_spec, self.shard_dim, meta)
        local_shape = spec.local_shape()
        if tuple(local_shape) != self.local_shard_shape:
            raise ShardingError(
                f"fully_shard: internal error: layout {spec!r} gives this rank {local_shape}, FSDP's shard is "
                f"{self.local_shard_shape}"
            )
        return spec

    @property
    def local_shard_shape(self) -> tuple[int, ...]:
        shape = list(self.unsharded_shape)
        shape[self.shard_dim] = self.member_slices[self.data.shard_rank][1]
        return tuple(shape)

    def refresh_sharded(self) -> None:
        """A module's parameter replaced while sharded (load_state_dict(assign=True)) is the new shard."""
        module, name = self.occurrences[0]
        current = module._parameters.get(name)
        if isinstance(current, DTensor) and current is not self.sharded and spec_of(current) == spec_of(self.sharded):
            self.sharded = current

    def gather_input(self) -> torch.Tensor:
        """This rank's shard as the all_gather sends it: flat, in the compute dtype."""
        return local_of(self.sharded).detach().reshape(-1).to(self.dtype)

    # -- the unsharded tensor
    def alloc(self) -> torch.Tensor:
        """The unsharded storage, allocated (made once, then resized back after each free)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.unsharded_shape, dtype=self.dtype, device=local_of(self.sharded).device)
            self.unsharded = self._make_unsharded(self._buffer)
        storage = self._buffer.untyped_storage()
        need = self._buffer.numel() * self._buffer.element_size()
        if storage.nbytes() != need:
            storage.resize_(need)
        # `.data`: a write autograd's version counters do not see (saved references expect the re-gathered data)
        return self._buffer.data

    def _make_unsharded(self, buffer: torch.Tensor) -> nn.Parameter:
        if self.tp_spec is None:
            return nn.Parameter(buffer, requires_grad=self.requires_grad)
        spec = self.tp_spec
        meta = TensorMeta(spec.shape, spec.meta.stride, self.dtype)
        return nn.Parameter(
            wrap(buffer, TensorSpec(spec.mesh, spec.placements, meta)), requires_grad=self.requires_grad
        )

    def write_member(self, buffer: torch.Tensor, member: int, piece: torch.Tensor) -> None:
        start, length = self.member_slices[member]
        shape = list(self.unsharded_shape)
        shape[self.shard_dim] = length
        buffer.narrow(self.shard_dim, start, length).copy_(piece.view(shape))

    def free(self) -> None:
        if self._buffer is not None:
            self._buffer.untyped_storage().resize_(0)

    def swap_in(self, unsharded: bool) -> None:
        param = self.unsharded if unsharded else self.sharded
        for module, name in self.occurrences:
            module._parameters[name] = param

    # -- gradients
    def take_unsharded_grad(self, reduce_dtype: torch.dtype) -> torch.Tensor | None:
        """The unsharded gradient (this rank's, local to the tp layout) plus unsynced accumulation; cleared."""
        g = self.unsharded.grad if self.unsharded is not None else None
        if self.unsharded is not None and g is not None:
            self.unsharded.grad = None
            if isinstance(g, DTensor):
                assert self.tp_spec is not None  # a DTensor gradient: the parameter was one
                g = shard_in(g, self.tp_spec.placements)
            g = g.to(reduce_dtype)
        if self.accumulated is not None:
            g = self.accumulated if g is None else g + self.accumulated
            self.accumulated = None
        return g

    def accumulate(self, reduce_dtype: torch.dtype) -> None:
        g = self.take_unsharded_grad(reduce_dtype)
        self.accumulated = g

    def grad_chunk(self, grad: torch.Tensor, member: int) -> torch.Tensor:
        start, length = self.member_slices[member]
        return grad.narrow(self.shard_dim, start, length).reshape(-1)

    def set_sharded_grad(self, flat: torch.Tensor) -> None:
        local = flat.view(self.local_shard_shape).to(self.orig_dtype)
        sharded = self.sharded
        if sharded.grad is None:
            sharded.grad = wrap(local.contiguous(), spec_of(sharded))
        else:
            local_of(sharded.grad).add_(local)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _sliced_from(root: DeviceMesh, sub: DeviceMesh) -> bool:
    """Whether `sub` is `root`'s sub-mesh over its named dims. Asked of the meshes themselves, not of
    `sub.root_mesh`: a DTensor's mesh may be an equal mesh object made before (a cached decision's
    output spec), which does not know the root it was sliced from."""
    names = sub.mesh_dim_names
    if not names or not set(names) <= set(root.mesh_dim_names or ()):
        return False
    return root[names if len(names) > 1 else names[0]] == sub


def _composed_spec(data: DataMesh, tp: TensorSpec, shard_dim: int, meta: TensorMeta) -> TensorSpec:
    """The layout over the data mesh's dims and the tp mesh's dims together (2-D FSDP + TP)."""
    dp_mesh, tp_mesh = data.mesh, tp.mesh
    root = dp_mesh.root_mesh
    if root is None or not root.mesh_dim_names or not _sliced_from(root, tp_mesh):
        raise ShardingError(
            f"fully_shard: a parameter is a DTensor on {tp_mesh} but the data mesh is {dp_mesh}; slice both from one "
            "mesh by name (mesh = init_device_mesh(..., mesh_dim_names=('dp', 'tp')); parallelize_module(m, "
            "mesh['tp'], plan); fully_shard(m, mesh=mesh['dp']))"
        )
    dp_names, tp_names = dp_mesh.mesh_dim_names or (), tp_mesh.mesh_dim_names or ()  # (named: sliced from root)
    if set(dp_names) & set(tp_names):
        raise ShardingError(f"fully_shard: the data mesh {dp_names} and the parameter's mesh {tp_names} share dims")
    for p in tp.placements:
        if not (isinstance(p, Replicate) or type(p) is Shard):
            raise ShardingError(
                f"fully_shard: a tensor-parallel parameter laid out as {tp!r}; only Shard and Replicate tp layouts "
                "compose with FSDP"
            )
    names = [n for n in root.mesh_dim_names if n in dp_names or n in tp_names]
    order = {n: i for i, n in enumerate(names)}
    placements: list[Placement] = []
    shard_name = dp_names[-1]
    for n in names:
        if n in tp_names:
            placements.append(tp.placements[tp_names.index(n)])
        elif n != shard_name:
            placements.append(Replicate())
        else:
            # tp dims after dp that shard the same dim were cut first (FSDP chunks the tp shard): strided
            later = [
                tp_mesh.shape[i]
                for i, p in enumerate(tp.placements)
                if p.is_shard(shard_dim) and order[tp_names[i]] > order[n]
            ]
            split = math.prod(later)
            placements.append(StridedShard(shard_dim, split) if split > 1 else Shard(shard_dim))
    mesh = root[tuple(names)] if len(names) > 1 else root[names[0]]
    return TensorSpec(mesh, tuple(placements), meta)
