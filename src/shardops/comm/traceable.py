"""torch.compile support: shardops collectives as traceable ops, and what tracing may and may not do.

Under torch.compile, dynamo and AOTAutograd run shardops' dispatch on fake local
tensors: the planner decides on metadata as in eager, and every collective it
issues reaches `Communicator`'s public methods with a fake tensor. There it is
routed here and recorded as one op of the `shardops::` library instead of being
run. The compiled graph calls that op at run time, and its real implementation
calls the calling thread's communicator: the same counted collective as in eager
(CommDebugMode sees the same calls and bytes), in either world (threads or
torch.distributed), with the same uneven-size and group-order handling.

A group travels in the graph as (mesh id, mesh dims), never as ranks: the ranks
of "the group along mesh dim 1" depend on the calling rank, and in the threads
world every rank thread runs the same compiled code.

Rank-specific facts read while tracing (this rank's coordinate: shard offsets,
uneven local sizes, which chunk a reduce_scatter returns) are baked into the graph.
The DTensor's flatten metadata carries the coordinate, so dynamo guards on it and
each rank of a threads world gets its own compiled entry (see tensor.py).

Threads world and dynamo's compile lock: dynamo compiles one frame at a time per
process. A rank that already runs compiled code may wait in a collective for a
rank that is still queued to compile. While any compile of this process is in
progress, a threads-world collective does not time out; its timeout counts from
the end of the last compile (`compile_quiet_since`).

What this module needs of torch's private compile internals (dynamo's marks and callbacks, the
tracing context, fake tensors, effect tokens, functional collectives) it gets through
shardops/_torch/compile.py, the seam; it registers its hooks there, and `_torch.install()`
installs them (not at import).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .._torch import compile as seam
from ..errors import ShardingError
from ..placements import reduce_values
from .counting import natively_reducible, record
from .wire import pack_padded

# ------------------------------------------------------------------ is this tensor being traced?


tracing = seam.tracing  # inside torch.compile's tracing on this thread (dynamo or AOTAutograd)
compiling = seam.compiling  # torch.compile compiles on this thread: nothing may communicate


def metadata_only(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Zeros of `shape` (a real tensor, never uninitialised memory), for a reader that keeps only
    metadata (dynamo's fake copy of a graph input, its guards)."""
    return seam.real_zeros(shape, like)


def refuse_while_tracing(what: str, why: str) -> None:
    """Raise at compile time for something a compiled graph would get silently wrong."""
    if tracing():
        raise ShardingError(
            f"torch.compile: {what} cannot be compiled: {why}. Run it outside the compiled region "
            "(torch.compiler.disable)."
        )


class untraced:
    """Plain tensor math on metadata while tracing: routing maps computed from shapes and placements.

    Under torch.compile the ops of a sharded algorithm run on fake tensors, and so would the small
    index tensors it builds from metadata (which rows move where): a `nonzero` or a size read of one
    is then data-dependent and breaks the graph. Inside, tensors are real again and nothing is
    recorded; what the graph needs of them goes in as constants (`graph_constant`). Eager: no-op.
    """

    def __enter__(self) -> untraced:
        self._modes = None
        if tracing():
            self._modes = seam.without_modes()
            self._modes.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._modes is not None:
            self._modes.__exit__(*exc)


def graph_constant(values: Sequence[int] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Indices planned under `untraced` as an int64 tensor beside `like`: Python ints while tracing
    (a constant of the graph), a plain tensor in eager (no round trip through Python)."""
    if isinstance(values, torch.Tensor):
        return values.to(like.device)
    return torch.tensor(values, dtype=torch.long, device=like.device)


def is_traced_tensor(t: torch.Tensor) -> bool:
    """A fake (or functionalized fake) tensor: we are tracing, not running. Eager tensors are never fake."""
    return seam.is_fake(t)


# ------------------------------------------------------------------ meshes by id

_MESH_IDS: dict[tuple, int] = {}
_MESHES: dict[int, Any] = {}  # DeviceMesh objects (mesh.py sits above comm)
_NEXT_MESH_ID = itertools.count()
_lock = threading.Lock()


def mesh_id(mesh) -> int:
    """A small int naming `mesh` (equal meshes share it: every rank thread builds its own equal mesh)."""
    with _lock:
        i = _MESH_IDS.get(mesh._key)
        if i is None:
            i = _MESH_IDS[mesh._key] = next(_NEXT_MESH_ID)
        if i not in _MESHES or (getattr(_MESHES[i], "_torch_mesh", None) is None and mesh._torch_mesh is not None):
            _MESHES[i] = mesh  # prefer a mesh that knows its torch DeviceMesh (its groups are torch's own)
        return i


def _group(mid: int, dims: Sequence[int]):
    return _MESHES[mid].group(tuple(dims))


def _group_key(group) -> tuple[int, list[int]]:
    if not group.key:
        raise ShardingError(
            f"torch.compile: a collective over ranks {list(group.ranks)} has no mesh; only mesh groups can be traced"
        )
    mesh, dims = group.key
    return mesh_id(mesh), list(dims)


def _comm(mid: int):
    return _MESHES[mid].comm  # this rank's communicator (in the threads world: this rank thread's)


def _fresh(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """A custom op's output may not alias its inputs (nor another output)."""
    return (
        out.clone() if any(out.untyped_storage().data_ptr() == i.untyped_storage().data_ptr() for i in inputs) else out
    )


def _flat(shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    ndim = len(shapes[0]) if shapes else 0
    return [int(s) for shape in shapes for s in shape], ndim


def _unflat(flat: Sequence[int], ndim: int, n: int) -> list[tuple[int, ...]]:
    if ndim == 0:
        return [()] * n
    return [tuple(flat[i : i + ndim]) for i in range(0, len(flat), ndim)]


# ------------------------------------------------------------------ the ops


@torch.library.custom_op("shardops::all_reduce", mutates_args=())
def _all_reduce(t: torch.Tensor, op: str, mesh: int, dims: list[int]) -> torch.Tensor:
    return _fresh(_comm(mesh).all_reduce(t, op, _group(mesh, dims)), [t])


@_all_reduce.register_fake
def _(t, op, mesh, dims):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@torch.library.custom_op("shardops::all_gather", mutates_args=())
def _all_gather(t: torch.Tensor, mesh: int, dims: list[int], shapes: list[int], ndim: int) -> list[torch.Tensor]:
    group = _group(mesh, dims)
    outs = _comm(mesh).all_gather(t, group, _unflat(shapes, ndim, group.size))
    return [o.clone() for o in outs]  # pieces may be views of one buffer or of the input


@_all_gather.register_fake
def _(t, mesh, dims, shapes, ndim):
    n = len(shapes) // ndim if ndim else _group(mesh, dims).size
    return [t.new_empty(s) for s in _unflat(shapes, ndim, n)]


@torch.library.custom_op("shardops::reduce_scatter", mutates_args=())
def _reduce_scatter(chunks: list[torch.Tensor], op: str, mesh: int, dims: list[int]) -> torch.Tensor:
    return _fresh(_comm(mesh).reduce_scatter(chunks, op, _group(mesh, dims)), chunks)


@_reduce_scatter.register_fake
def _(chunks, op, mesh, dims):
    group = _group(mesh, dims)
    mine = chunks[group.index(_comm(mesh).rank)]  # rank-specific: the coordinate guard keeps it right (module doc)
    return mine.new_empty(mine.shape)


@torch.library.custom_op("shardops::all_to_all", mutates_args=())
def _all_to_all(
    chunks: list[torch.Tensor], mesh: int, dims: list[int], recv_shapes: list[int], ndim: int
) -> list[torch.Tensor]:
    group = _group(mesh, dims)
    outs = _comm(mesh).all_to_all(chunks, group, _unflat(recv_shapes, ndim, group.size))
    return [o.clone() for o in outs]


@_all_to_all.register_fake
def _(chunks, mesh, dims, recv_shapes, ndim):
    return [chunks[0].new_empty(s) for s in _unflat(recv_shapes, ndim, len(chunks))]


@torch.library.custom_op("shardops::broadcast", mutates_args=())
def _broadcast(t: torch.Tensor, src_index: int, mesh: int, dims: list[int]) -> torch.Tensor:
    return _fresh(_comm(mesh).broadcast(t, src_index, _group(mesh, dims)), [t])


@_broadcast.register_fake
def _(t, src_index, mesh, dims):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------ torch.distributed: torch's functional collectives
#
# Under torch.distributed a traced collective is one of torch's functional collectives
# (`_c10d_functional`: all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
# all_to_all_single, each followed by its wait_tensor). They are C++ ops that inductor knows:
# no Python runs per call, and inductor may move a wait past independent compute. Each one is
# followed by `shardops::count`, which records the call's bytes where eager records them (a
# CommDebugMode counts a compiled step as it counts an eager one); it runs no collective.
# What the functional collectives cannot express the way eager does it (bool, complex and
# non-native reductions, which eager ships as bytes or reduces locally; broadcast; an old gloo
# without reduce_scatter) stays a shardops:: custom op, which runs the eager code.


# A plain library kernel, not a torch.library.custom_op: it is called once per collective of
# every compiled step, and custom_op's Python autograd wrapper costs ~10x the call itself.
_COUNT_LIB = torch.library.Library("shardops", "FRAGMENT")
_COUNT_LIB.define("count(Tensor t, str kind, int num_bytes, int wire_bytes) -> ()")


def _count(t: torch.Tensor, kind: str, num_bytes: int, wire_bytes: int) -> None:
    record(kind, num_bytes, wire_bytes)


_COUNT_LIB.impl("count", _count, "CompositeExplicitAutograd")


@torch.library.register_fake("shardops::count")
def _(t, kind, num_bytes, wire_bytes):
    return None


def _keep_in_order() -> None:
    """The `shardops::` collectives and `shardops::count` are ordered effects (torch's effect tokens).

    A collective is a meeting of every rank of its group, so each rank must run every one of
    them, in program order, whatever its own graph makes of it. As pure ops they were not: a
    rank whose algorithm does not read a collective's result (the first shard of a sharded
    cumsum needs no prefix) had it removed as dead code, and the other ranks waited in it, or
    met that rank's next collective of the same shape with the wrong data; a rank could also
    have two identical ones merged, or independent ones reordered. `shardops::count` returns
    nothing and must run once per collective: as an effect AOTAutograd keeps it in the graph
    that issues its collective (a forward count never moves into the backward, where it would
    make the partitioner run the forward's collective again just to feed it) and inductor
    neither drops nor reorders it. (Under torch.distributed the count reads the output of
    torch's functional collective, which keeps that collective too.)
    """
    seam.keep_in_order(
        f"shardops::{op}" for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "count")
    )


_keep_in_order()
_FUNCTIONAL_OPS = {
    "sum": "sum",
    "avg": "sum",
    "max": "max",
    "min": "min",
    "product": "product",
}  # avg: a sum, divided after (as eager)


def _functional(comm, group, kind: str, dtype: torch.dtype, op: str | None = None):
    """(group name, torch group ranks by shardops index) when torch's functional collective `kind`
    does what eager does; else None."""
    if dtype == torch.bool or dtype.is_complex or (op is not None and not natively_reducible(dtype, op)):
        return None
    return comm.functional_group(group, kind)  # None outside torch.distributed


def _finish_avg(t: torch.Tensor, op: str, n: int) -> torch.Tensor:
    if op != "avg":
        return t
    return t / n if t.is_floating_point() else t // n


def _in_pg_order(items: list, pg_index: Sequence[int]) -> list:
    out = [None] * len(items)
    for i, item in enumerate(items):
        out[pg_index[i]] = item
    return out


def _functional_all_reduce(t: torch.Tensor, op: str, group, name: str) -> torch.Tensor:
    out = seam.functional_all_reduce(t.contiguous(), _FUNCTIONAL_OPS[op], name)
    torch.ops.shardops.count(out, "all_reduce", t.numel() * t.element_size(), t.numel() * t.element_size())
    return _finish_avg(out, op, group.size)


def _functional_all_gather(comm, t: torch.Tensor, group, shapes, name: str, pg_index) -> list[torch.Tensor]:
    numels = [math.prod(s) for s in shapes]
    width = max(numels)
    flat = t.reshape(-1)
    if flat.numel() < width:  # uneven: every member pads to the largest (the eager wire format)
        flat = torch.cat([flat, flat.new_zeros(width - flat.numel())])
    out = seam.functional_all_gather(flat.contiguous(), group.size, name)
    torch.ops.shardops.count(out, "all_gather", t.numel() * t.element_size(), comm._all_gather_wire_bytes(t, shapes))
    rows = out.view(group.size, width)
    return [rows[pg_index[i], : numels[i]].reshape(shapes[i]) for i in range(group.size)]


def _functional_reduce_scatter(
    comm, chunks: Sequence[torch.Tensor], op: str, group, name: str, pg_index
) -> torch.Tensor:
    wire = pack_padded(chunks, pg_index)
    n = group.size
    if comm.exchanges_reduce_scatter(group, wire.device):  # gloo: an all_to_all and a local reduction (torch_dist)
        width = wire.numel() // n
        rows = seam.functional_all_to_all(wire, [width] * n, [width] * n, name).view(n, width)
        out = reduce_values([rows[pg_index[i]] for i in range(n)], "sum" if op == "avg" else op)
    else:
        out = seam.functional_reduce_scatter(wire, _FUNCTIONAL_OPS[op], n, name)
    num_bytes = sum(c.numel() * c.element_size() for c in chunks)
    torch.ops.shardops.count(out, "reduce_scatter", num_bytes, comm._reduce_scatter_wire_bytes(chunks, op))
    mine = chunks[group.index(comm.rank)]  # rank-specific: the coordinate guard keeps it right (module doc)
    return _finish_avg(out[: mine.numel()].reshape(mine.shape), op, n)


def _functional_all_to_all(
    comm, chunks: Sequence[torch.Tensor], group, recv_shapes, name: str, pg_index
) -> list[torch.Tensor]:
    me = group.index(comm.rank)
    send = (
        pack_padded(chunks, pg_index)
        if len({c.shape for c in chunks}) == 1
        else torch.cat(_in_pg_order([c.reshape(-1) for c in chunks], pg_index))
    )
    recv_numels = [math.prod(s) for s in recv_shapes]
    out = seam.functional_all_to_all(
        send, _in_pg_order(recv_numels, pg_index), _in_pg_order([c.numel() for c in chunks], pg_index), name
    )
    num_bytes = sum(c.numel() * c.element_size() for i, c in enumerate(chunks) if i != me)
    torch.ops.shardops.count(out, "all_to_all", num_bytes, num_bytes)
    pieces = list(torch.split(out, _in_pg_order(recv_numels, pg_index)))
    return [pieces[pg_index[i]].reshape(recv_shapes[i]) for i in range(group.size)]


# ------------------------------------------------------------------ what Communicator calls while tracing


def all_reduce(comm, t: torch.Tensor, op: str, group) -> torch.Tensor:
    functional = _functional(comm, group, "all_reduce", t.dtype, op)
    if functional is not None:
        return _functional_all_reduce(t, op, group, functional[0])
    mid, dims = _group_key(group)
    return torch.ops.shardops.all_reduce(t, op, mid, dims)


def all_gather(comm, t: torch.Tensor, group, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    functional = _functional(comm, group, "all_gather", t.dtype)
    if functional is not None:
        return _functional_all_gather(comm, t, group, [tuple(s) for s in shapes], *functional)
    mid, dims = _group_key(group)
    flat, ndim = _flat(shapes)
    return list(torch.ops.shardops.all_gather(t, mid, dims, flat, ndim))


def reduce_scatter(comm, chunks: Sequence[torch.Tensor], op: str, group) -> torch.Tensor:
    dtypes = {c.dtype for c in chunks}
    functional = _functional(comm, group, "reduce_scatter", chunks[0].dtype, op) if len(dtypes) == 1 else None
    if functional is not None:
        return _functional_reduce_scatter(comm, chunks, op, group, *functional)
    mid, dims = _group_key(group)
    return torch.ops.shardops.reduce_scatter(list(chunks), op, mid, dims)


def all_to_all(comm, chunks: Sequence[torch.Tensor], group, recv_shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    dtypes = {c.dtype for c in chunks}
    functional = _functional(comm, group, "all_to_all", chunks[0].dtype) if len(dtypes) == 1 else None
    if functional is not None:
        return _functional_all_to_all(comm, chunks, group, [tuple(s) for s in recv_shapes], *functional)
    mid, dims = _group_key(group)
    flat, ndim = _flat(recv_shapes)
    return list(torch.ops.shardops.all_to_all(list(chunks), mid, dims, flat, ndim))


def broadcast(comm, t: torch.Tensor, src_index: int, group) -> torch.Tensor:
    mid, dims = _group_key(group)
    return torch.ops.shardops.broadcast(t, src_index, mid, dims)


def barrier(group) -> None:
    raise ShardingError("torch.compile: a barrier cannot be traced (it returns nothing the graph could keep)")


# ------------------------------------------------------------------ compiles in progress (threads-world timeouts)

_compiles = {"active": 0, "quiet_since": 0.0}
_compiles_lock = threading.Lock()


def compiles_in_progress() -> bool:
    return _compiles["active"] > 0


def compile_quiet_since() -> float:
    """time.monotonic() when the last compile of this process ended (0: none yet)."""
    return _compiles["quiet_since"]


def _on_start(*_a) -> None:
    with _compiles_lock:
        _compiles["active"] += 1


def _on_end(*_a) -> None:
    with _compiles_lock:
        _compiles["active"] = max(0, _compiles["active"] - 1)
        _compiles["quiet_since"] = time.monotonic()


seam.watch_compiles(_on_start, _on_end)  # installed with dynamo's marks (_torch.install)


# ------------------------------------------------------------------ threads world: a recompile budget per rank
#
# The rank threads share dynamo's code cache, and each rank needs its own entry per compiled frame
# (its coordinate is guarded: module doc). Under torchrun every process has dynamo's limits to
# itself; in a threads world of n ranks each rank thread's limits are scaled by n, so a rank is
# not sent back to eager because the other ranks filled the cache (a 10-rank world: ranks 8 and
# 9 ran eager), and a frame that recompiles too often still hits the limit as in a process.
# Dynamo's config values are per thread (context variables); a rank thread runs in a copy of its
# caller's context (world.run), so the scaled value is the caller's, and it ends with the thread.

_rank_thread = threading.local()


def enter_rank_thread(world_size: int) -> None:
    """Called first in each rank thread of a threads world (world.run)."""
    _rank_thread.unscaled = world_size if world_size > 1 else 0
    seam.keep_watching()  # a dynamo reset since the last world dropped the compile watch


def scale_limits_in_rank_thread() -> None:
    """Once per rank thread, when dynamo first looks at one of its DTensors.

    Called from DTensor.__tensor_flatten__: dynamo's guards flatten a DTensor input to compare its
    metadata with a cache entry's, in the calling rank thread, before deciding to compile again
    and checking the limit; a frame with no DTensor is never compiled once per rank.
    """
    ranks = getattr(_rank_thread, "unscaled", 0)
    if ranks:
        _rank_thread.unscaled = 0
        seam.scale_recompile_limits(ranks)  # this thread's context only


# ------------------------------------------------------------------ dynamo: what it must not trace into


def trace_opaque(fn):
    """Mark `fn` (a DTensor constructor or unwrapper) as dynamo's `nonstrict_trace`, without importing dynamo.

    Dynamo cannot trace `_make_wrapper_subclass`; these functions make or unwrap DTensors, so dynamo
    records each call as a node and AOTAutograd runs it on fake tensors (where it traces fine).
    Called from eager code after a graph break, the function runs as it is, never compiled as a frame.
    """
    return seam.trace_opaque(fn)


def eager_only(fn):
    """Dynamo never compiles `fn`, nor any frame it calls, as a frame of its own.

    After a graph break the rest of a compiled function runs eagerly, with dynamo's frame hook on:
    every Python frame it enters (our __torch_dispatch__, a sharded algorithm) would be compiled on
    its own and break again at each data-dependent check. Tracing enters dispatch through the
    DTensor's flatten protocol instead, which this does not touch.
    """
    return seam.eager_only(fn)


def on_graph_entry(wanted, enter) -> None:
    """Run `enter(inputs)` as each compiled graph with an example input where `wanted` holds is called."""
    seam.on_graph_entry(wanted, enter)


def setup(mesh: type, placements: Sequence[type], specs: Sequence[type]) -> None:
    """Called once when shardops is imported, registering (not installing: _torch.install does) how
    compiled code holds shardops' metadata: meshes and placements are compile-time constants (dynamo
    guards them by equality; placements are small frozen dataclasses of ints and strings, often made
    inside the compiled code, so pytree nodes whose fields are constants of the call site), and
    a DTensor's metadata read in compiled code (`dt.device_mesh`, `dt.placements`) is a plain
    Python object, guarded through the DTensor's CompileMeta."""
    seam.pytree_constants([mesh], placements)
    seam.hold_as_constants([mesh, *specs, *placements])
