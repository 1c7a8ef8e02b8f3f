"""DeviceMesh: an n-d array of global ranks, and the groups along its dims."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch

from . import _torch
from .comm.base import Communicator, Group
from .errors import ShardingError
from .world import current_comm


class DeviceMesh:
    """Ranks laid out as an n-d array. Mirrors torch's DeviceMesh where users touch it."""

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        mesh_dim_names: Sequence[str] | None = None,
        *,
        _torch_mesh: Any = None,
    ) -> None:
        _torch.install()  # every DTensor has a mesh: torch's hooks are in place before the first one
        ranks = torch.as_tensor(mesh, dtype=torch.int64)
        if ranks.ndim == 0:
            ranks = ranks.reshape(1)
        self.device_type = device_type
        self._ranks = ranks
        self.mesh_dim_names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        if self.mesh_dim_names is not None and len(self.mesh_dim_names) != ranks.ndim:
            raise ShardingError(
                f"DeviceMesh: {len(self.mesh_dim_names)} names {self.mesh_dim_names} for a {ranks.ndim}-d mesh"
            )
        self._torch_mesh = _torch_mesh
        self.shape: tuple[int, ...] = tuple(ranks.shape)
        self.ndim = ranks.ndim
        self._flat = tuple(ranks.flatten().tolist())
        # Identity as one string, not a tuple of ints: compiled code that compares meshes (a style's
        # hook checking an input's mesh) reads it as a constant. Dynamo makes an int attribute symbolic
        # once the same code has seen two values of it (two rank threads' sub-meshes, or two meshes),
        # and a comparison of symbolic ints is no constant: the trace failed.
        self._key = repr((device_type, self.shape, self._flat, self.mesh_dim_names))
        self._groups: dict[tuple[int, tuple[int, ...]], Group] = {}
        # The mesh this one was sliced from by name (torch's root mesh): fully_shard composes a
        # dp sub-mesh with the tp sub-mesh of a parameter's layout on it.
        self.root_mesh: DeviceMesh | None = None

    # -- identity
    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __reduce__(self) -> tuple:
        # its description only: an unpickled mesh attaches to the world it is used in (checkpoint/pickling)
        return (rebuild_mesh, (self.device_type, self._ranks.tolist(), self.mesh_dim_names))

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self._ranks.tolist()}{names})"

    # -- `with mesh:` (torch's DeviceMesh is a context manager): the current mesh of this rank
    def __enter__(self) -> DeviceMesh:
        _mesh_stack().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _mesh_stack().pop()

    # -- torch-compatible queries
    @property
    def mesh(self) -> torch.Tensor:
        return self._ranks

    def size(self, mesh_dim: int | None = None) -> int:
        return math.prod(self.shape) if mesh_dim is None else self.shape[mesh_dim]

    def get_rank(self) -> int:
        return self.comm.rank

    def own_coordinate(self) -> list[int]:
        """This rank's coordinate, for code that runs only on the mesh's ranks (ShardingError on any other)."""
        coord = self.get_coordinate()
        if coord is None:
            raise ShardingError(f"rank {self.get_rank()} is not part of {self}")
        return coord

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        dim = 0 if mesh_dim is None else self._dim_index(mesh_dim)
        return self.own_coordinate()[dim]

    def get_coordinate(self) -> list[int] | None:
        return self.coordinate_of(self.get_rank())

    def coordinate_of(self, rank: int) -> list[int] | None:
        try:
            flat = self._flat.index(rank)
        except ValueError:
            return None
        return list(_unravel(flat, self.shape))

    @property
    def comm(self) -> Communicator:
        return current_comm()

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def _dim_index(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if not self.mesh_dim_names or dim not in self.mesh_dim_names:
                raise ShardingError(f"mesh has no dim named {dim!r}; its dims are {self.mesh_dim_names}")
            return self.mesh_dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise ShardingError(f"mesh dim {dim} out of range for a {self.ndim}-d mesh")
        return dim % self.ndim

    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh over the named dims that contains the calling rank."""
        names = (names,) if isinstance(names, str) else tuple(names)
        dims = [self._dim_index(n) for n in names]
        coord = self.get_coordinate()
        if coord is None:
            raise ShardingError(f"rank {self.get_rank()} is not part of {self}")
        index = tuple(slice(None) if d in dims else coord[d] for d in range(self.ndim))
        sub = self._ranks[index].permute(*_order(dims)) if len(dims) > 1 else self._ranks[index]
        torch_sub = None
        # torch slices only in mesh-dim order; other orders get member-made groups from the communicator
        if self._torch_mesh is not None and list(dims) == sorted(dims):
            torch_sub = self._torch_mesh[names if len(names) > 1 else names[0]]
        sub_mesh = DeviceMesh(self.device_type, sub, names, _torch_mesh=torch_sub)
        sub_mesh.root_mesh = self.root_mesh or self
        return sub_mesh

    # -- groups
    def group(self, mesh_dims: int | Sequence[int]) -> Group:
        """The ranks along `mesh_dims` (row-major over them) that contain the calling rank."""
        dims = (mesh_dims,) if isinstance(mesh_dims, int) else tuple(mesh_dims)
        rank = self.get_rank()
        cache_key = (rank, dims)
        group = self._groups.get(cache_key)
        if group is None:
            coord = self.coordinate_of(rank)
            if coord is None:
                raise ShardingError(f"rank {rank} is not part of {self}; only its ranks may run ops on its tensors")
            # plain ints, no tensor ops: groups are also made while torch.compile traces (under fake tensors)
            members = []
            for along in itertools.product(*(range(self.shape[d]) for d in dims)):  # row-major over dims as given
                c = list(coord)
                for d, v in zip(dims, along):
                    c[d] = v
                members.append(self._flat[_ravel(c, self.shape)])
            group = Group(tuple(members), (self, dims))
            self._groups[cache_key] = group
        return group

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """torch's `get_group`: the torch ProcessGroup of `mesh_dim` under torch.distributed; in the threads
        world the shardops Group of that dim (both are what shardops.pipelining takes as a group)."""
        if mesh_dim is None and self.ndim != 1:
            raise ShardingError(
                f"get_group: a {self.ndim}-d mesh has one group per dim; pass mesh_dim (an index or one of "
                f"{self.mesh_dim_names})"
            )
        dim = 0 if mesh_dim is None else self._dim_index(mesh_dim)
        from .world import in_threads_world

        return self.group(dim) if in_threads_world() else self.torch_mesh.get_group(dim)

    @cached_property
    def torch_mesh(self) -> Any:
        """torch's DeviceMesh for these ranks (torch.distributed world only)."""
        if self._torch_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh as TorchMesh

            self._torch_mesh = TorchMesh(self.device_type, self._ranks, mesh_dim_names=self.mesh_dim_names)
        return self._torch_mesh

    @classmethod
    def from_torch(cls, torch_mesh: Any) -> DeviceMesh:
        return cls(torch_mesh.device_type, torch_mesh.mesh, torch_mesh.mesh_dim_names, _torch_mesh=torch_mesh)


_current = threading.local()  # a rank is a thread in the threads world: each rank has its own stack


def _mesh_stack() -> list[DeviceMesh]:
    if not hasattr(_current, "stack"):
        _current.stack = []
    return _current.stack


def current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with `with mesh:` on this rank, or None."""
    stack = _mesh_stack()
    return stack[-1] if stack else None


def rebuild_mesh(device_type: str, ranks: Any, mesh_dim_names: Sequence[str] | None) -> DeviceMesh:
    """Unpickle a DeviceMesh (a torch.load safe global: checks what it is given)."""
    if not isinstance(device_type, str) or not isinstance(ranks, (list, int)):
        raise ShardingError(f"torch.load: not a shardops DeviceMesh record ({device_type!r}, {ranks!r})")
    return DeviceMesh(device_type, ranks, mesh_dim_names)


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    coord = []
    for s in reversed(shape):
        coord.append(flat % s)
        flat //= s
    return tuple(reversed(coord))


def _ravel(coord: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for c, s in zip(coord, shape):
        flat = flat * s + c
    return flat


def _order(dims: Sequence[int]) -> list[int]:
    """Permutation that puts the kept (sliced) dims of a sub-array in the order asked."""
    kept = sorted(dims)
    return [kept.index(d) for d in dims]


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None
) -> DeviceMesh:
    """A mesh over every rank of the current world, laid out row-major in `mesh_shape`."""
    mesh_shape = tuple(int(s) for s in mesh_shape)
    comm = current_comm()
    if math.prod(mesh_shape) != comm.world_size:
        raise ShardingError(
            f"init_device_mesh: mesh shape {mesh_shape} has {math.prod(mesh_shape)} ranks but the world has "
            f"{comm.world_size}; make the product of the mesh shape equal the world size."
        )
    if mesh_dim_names is not None and len(mesh_dim_names) != len(mesh_shape):
        raise ShardingError(f"init_device_mesh: {len(mesh_dim_names)} names for a {len(mesh_shape)}-d mesh")
    ranks = torch.arange(comm.world_size).reshape(mesh_shape)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names)
    from .world import in_threads_world

    if not in_threads_world():
        _ = mesh.torch_mesh  # create torch's process groups now, collectively on every rank
    return mesh
