"""The communicator protocol, byte/round counters and CommDebugMode.

Every collective of shardops goes through `Communicator`'s public methods, which
check arguments, count, and call the world's `_impl` methods. Counting lives here
once so that both worlds report the same figures:

    all_gather      this rank's own shard
    all_reduce      the whole input
    reduce_scatter  the whole input (all chunks)
    all_to_all      the chunks sent to other ranks
    broadcast       the tensor, on the source rank only

A round is one collective call; one call that carries several tensors is one round.

Wire bytes (`CommDebugMode.get_wire_bytes()`) are what this rank hands the
transport for the same calls, padding included. c10d's single-tensor all_gather
and reduce_scatter need equal sizes, so on uneven shards shardops pads there:

    all_gather      the largest member's shard (this rank's shard, zero-padded)
    reduce_scatter  group size x the largest chunk (also where it is an all_to_all:
                    gloo, and the dtype/op pairs no backend reduces, e.g. int16)
    others          as the logical figure

The threads world moves Python objects and pads nothing; it reports the same
wire figure the torch.distributed world hands gloo, so both worlds (and a
comparison with torch DTensor, which pads the same way) read one number.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ShardingError
from ..placements import REDUCE_OPS, reduce_values
from .counting import CommDebugMode, natively_reducible, record, record_p2p  # noqa: F401  (re-exported: the protocol's public names)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


@dataclass(frozen=True)
class Group:
    """The ranks along some mesh dims that contain the calling rank, in mesh order.

    `key` identifies the group to the world's backend (mesh id + mesh dims).
    """

    ranks: tuple[int, ...]
    key: tuple = ()

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class P2POp:
    """One point-to-point op of `Communicator.batch_isend_irecv` (torch.distributed.P2POp).

    `op`: "isend" or "irecv" (torch's `dist.isend`/`dist.irecv` are taken too); `peer`: the
    other rank's global rank; `group`: the group both belong to (default: the whole world).
    An irecv fills `tensor` in place once its work is waited for.
    """

    op: Any
    tensor: torch.Tensor
    peer: int
    group: Group | None = None
    tag: int = 0  # sends and recvs match by (group, src, dst, tag), in order

    @property
    def kind(self) -> str:
        name = self.op if isinstance(self.op, str) else getattr(self.op, "__name__", str(self.op))
        if "send" in name:
            return "send"
        if "recv" in name:
            return "recv"
        raise ShardingError(f"P2POp: op {self.op!r} is neither isend nor irecv")


class P2PWork:
    """A started point-to-point op: `wait()` returns once it is done (an irecv's tensor is then filled)."""

    def __init__(self, wait: Callable[[], None] | None = None) -> None:
        self._wait = wait
        self._done = wait is None

    def wait(self) -> bool:
        if not self._done:
            self._done = True
            self._wait()  # type: ignore[misc]
        return True

    def is_completed(self) -> bool:
        return self._done


class CollectiveWork:
    """A started collective (`Communicator.all_reduce_async`, `all_gather_async`,
    `reduce_scatter_async`): `wait()` returns what the synchronous call returns, the same object
    every time it is called. `release()` frees the buffers the result lives in, once the caller
    is done with it (a world whose backend thread may hold the last reference to them names them
    in `buffers`; the threads world shares them between ranks and names none)."""

    def __init__(self, wait: Callable[[], Any], buffers: Sequence[torch.Tensor] = ()) -> None:
        self._wait: Callable[[], Any] | None = wait
        self._result: Any = None
        self._buffers = list(buffers)

    @classmethod
    def done(cls, result: Any) -> CollectiveWork:
        work = cls(lambda: result)
        work.wait()
        return work

    def wait(self) -> Any:
        if self._wait is not None:
            self._result, self._wait = self._wait(), None
        return self._result

    def is_completed(self) -> bool:
        return self._wait is None

    def release(self) -> None:
        """Wait, then free the result's buffers now, on this thread; the result is unusable after."""
        self.wait()
        self._result = None
        free_storages(self._buffers)
        self._buffers.clear()


def free_storages(tensors: Sequence[torch.Tensor | None]) -> None:
    """Free the storage behind each tensor now (resized to 0 bytes; each storage once). For a
    collective's buffers in the torch.distributed world: the backend's thread holds them until it
    drops its work, so their memory would go back whenever that thread lets go (and a profiler
    not watching that thread reads it as held to the end)."""
    seen = set()
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            storage.resize_(0)


# ------------------------------------------------------------------ protocol


class Communicator:
    """Collectives over a `Group`. Subclasses implement the `_impl` methods.

    Uneven sizes are first-class: callers pass the shapes every member holds
    (the layout math knows them), so no extra round is spent exchanging sizes.
    """

    rank: int
    world_size: int

    # -- public, counted
    def all_reduce(self, t: torch.Tensor, op: str, group: Group) -> torch.Tensor:
        _check_op(op)
        if group.size == 1:
            return t
        if type(t) is not torch.Tensor and _traced(t):
            return _traceable().all_reduce(self, t, op, group)
        record("all_reduce", nbytes(t))
        return self._all_reduce(t.contiguous(), op, group)

    def all_reduce_async(self, t: torch.Tensor, op: str, group: Group) -> CollectiveWork:
        """Start `all_reduce(t, op, group)` and return at once; the work's `wait()` returns its
        result. `t` is handed over, as to torch's `all_reduce(async_op=True)`: a world may reduce
        into it (torch.distributed does), so neither read nor write it before `wait()`. Counted
        when started. Members start their async collectives in the same order, as any
        collectives. A world without asynchronous collectives (threads) completes it here."""
        _check_op(op)
        if group.size == 1 or (type(t) is not torch.Tensor and _traced(t)):
            return CollectiveWork.done(self.all_reduce(t, op, group))
        record("all_reduce", nbytes(t))
        return self._all_reduce_async(t.contiguous(), op, group)

    def all_gather(
        self, t: torch.Tensor, group: Group, shapes: Sequence[Sequence[int]] | None = None
    ) -> list[torch.Tensor]:
        """Every member's tensor, in group order. `shapes`: each member's shape (default: all like `t`)."""
        shapes = self._gather_shapes(t, group, shapes)
        if group.size == 1:
            return [t]
        if type(t) is not torch.Tensor and _traced(t):
            return _traceable().all_gather(self, t, group, shapes)
        record("all_gather", nbytes(t), self._all_gather_wire_bytes(t, shapes))
        return self._all_gather(t.contiguous(), group, shapes)

    def all_gather_async(
        self, t: torch.Tensor, group: Group, shapes: Sequence[Sequence[int]] | None = None
    ) -> CollectiveWork:
        """Start `all_gather(t, group, shapes)`; the work's `wait()` returns the list (as all_reduce_async).
        `t` is handed over: the work's `release()` frees it with the result's buffers."""
        shapes = self._gather_shapes(t, group, shapes)
        if group.size == 1 or (type(t) is not torch.Tensor and _traced(t)):
            return CollectiveWork.done(self.all_gather(t, group, shapes))
        record("all_gather", nbytes(t), self._all_gather_wire_bytes(t, shapes))
        return self._all_gather_async(t.contiguous(), group, shapes)

    def reduce_scatter_async(self, chunks: Sequence[torch.Tensor], op: str, group: Group) -> CollectiveWork:
        """Start `reduce_scatter(chunks, op, group)`; the work's `wait()` returns its result (a new
        tensor). The chunks are handed over (as all_reduce_async's input): a world may free their
        storage once the collective has sent them, so neither read nor write them after this call."""
        self._check_chunks(chunks, op, group)
        if group.size == 1 or (type(chunks[0]) is not torch.Tensor and _traced(chunks[0])):
            return CollectiveWork.done(self.reduce_scatter(chunks, op, group))
        record("reduce_scatter", sum(nbytes(c) for c in chunks), self._reduce_scatter_wire_bytes(chunks, op))
        return self._reduce_scatter_async([c.contiguous() for c in chunks], op, group)

    def _gather_shapes(
        self, t: torch.Tensor, group: Group, shapes: Sequence[Sequence[int]] | None
    ) -> list[tuple[int, ...]]:
        if shapes is None:
            shapes = [tuple(t.shape)] * group.size
        out = [tuple(s) for s in shapes]
        if out[group.index(self.rank)] != tuple(t.shape):
            raise ShardingError(
                f"all_gather: this rank holds shape {tuple(t.shape)} but the plan says {out[group.index(self.rank)]}"
            )
        return out

    def reduce_scatter(self, chunks: Sequence[torch.Tensor], op: str, group: Group) -> torch.Tensor:
        """chunks[i] goes to member i; returns the op-reduction of every member's chunk for this rank."""
        self._check_chunks(chunks, op, group)
        if group.size == 1:
            return chunks[0]
        if type(chunks[0]) is not torch.Tensor and _traced(chunks[0]):
            return _traceable().reduce_scatter(self, chunks, op, group)
        record("reduce_scatter", sum(nbytes(c) for c in chunks), self._reduce_scatter_wire_bytes(chunks, op))
        return self._reduce_scatter([c.contiguous() for c in chunks], op, group)

    @staticmethod
    def _check_chunks(chunks: Sequence[torch.Tensor], op: str, group: Group) -> None:
        _check_op(op)
        if len(chunks) != group.size:
            raise ShardingError(f"reduce_scatter: {len(chunks)} chunks for a group of {group.size}")

    def all_to_all(
        self, chunks: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """chunks[i] goes to member i; returns what each member sent here, in group order."""
        if len(chunks) != group.size:
            raise ShardingError(f"all_to_all: {len(chunks)} chunks for a group of {group.size}")
        me = group.index(self.rank)
        if group.size == 1:
            return [chunks[0]]
        if type(chunks[0]) is not torch.Tensor and _traced(chunks[0]):
            return _traceable().all_to_all(self, chunks, group, recv_shapes)
        record("all_to_all", sum(nbytes(c) for i, c in enumerate(chunks) if i != me))
        return self._all_to_all([c.contiguous() for c in chunks], group, [tuple(s) for s in recv_shapes])

    def broadcast(self, t: torch.Tensor, src_index: int, group: Group) -> torch.Tensor:
        """The tensor of member `src_index`; every member passes a tensor of the same shape."""
        if group.size == 1:
            return t
        if type(t) is not torch.Tensor and _traced(t):
            return _traceable().broadcast(self, t, src_index, group)
        record("broadcast", nbytes(t) if group.index(self.rank) == src_index else 0)
        return self._broadcast(t.contiguous(), src_index, group)

    def barrier(self, group: Group) -> None:
        if group.size > 1:
            self._barrier(group)

    # -- point to point (counted: "send" with the bytes sent, "recv" with none; see counting.record_p2p)
    def world_group(self) -> Group:
        return Group(tuple(range(self.world_size)))

    def send(self, t: torch.Tensor, dst: int, group: Group | None = None) -> None:
        """Send `t` to global rank `dst`; returns once `t` may be reused."""
        for work in self.batch_isend_irecv([P2POp("isend", t, dst, group)]):
            work.wait()

    def isend(self, t: torch.Tensor, dst: int, group: Group | None = None) -> P2PWork:
        """Start sending `t` to `dst`; do not modify `t` before the work is waited for."""
        return self.batch_isend_irecv([P2POp("isend", t, dst, group)])[0]

    def recv(
        self,
        t_or_shape: torch.Tensor | Sequence[int],
        src: int,
        group: Group | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """What global rank `src` sends here: into the given tensor, or a new one of the given shape and `dtype`."""
        buf = t_or_shape if isinstance(t_or_shape, torch.Tensor) else torch.empty(tuple(t_or_shape), dtype=dtype)
        for work in self.batch_isend_irecv([P2POp("irecv", buf, src, group)]):
            work.wait()
        return buf

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[P2PWork]:
        """Start every op at once (a rank may send to and receive from a peer in one batch without
        deadlock); one work per op, in order. Counted as one round."""
        for p2p in ops:
            self._check_p2p(p2p)
        record_p2p([(p2p.kind, nbytes(p2p.tensor) if p2p.kind == "send" else 0) for p2p in ops])
        if not ops:
            return []
        return self._batch_isend_irecv(list(ops))

    def _check_p2p(self, p2p: P2POp) -> None:
        kind, t = p2p.kind, p2p.tensor
        if not isinstance(t, torch.Tensor) or hasattr(t, "placements"):
            raise ShardingError(
                f"{kind}: takes a plain torch.Tensor, got {type(t).__name__}; send a DTensor's to_local() "
                "and its layout, and rebuild it on the peer with from_local"
            )
        group = p2p.group if p2p.group is not None else self.world_group()
        if self.rank not in group.ranks:
            raise ShardingError(f"{kind}: rank {self.rank} is not a member of the group {list(group.ranks)}")
        if not isinstance(p2p.peer, int) or p2p.peer not in group.ranks:
            raise ShardingError(f"{kind}: peer {p2p.peer!r} is not a rank of the group {list(group.ranks)}")
        if p2p.peer == self.rank:
            raise ShardingError(
                f"{kind}: rank {self.rank} cannot {kind} to or from itself; hand the tensor over locally"
            )
        if kind == "recv" and not t.is_contiguous():
            raise ShardingError(
                f"recv: the receiving tensor must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})"
            )

    def _batch_isend_irecv(self, ops: list[P2POp]) -> list[P2PWork]:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- wire bytes (see the module docstring); a world that pads otherwise overrides these
    def _all_gather_wire_bytes(self, t: torch.Tensor, shapes: Sequence[tuple]) -> int:
        return max(math.prod(s) for s in shapes) * t.element_size()

    def _reduce_scatter_wire_bytes(self, chunks: Sequence[torch.Tensor], op: str) -> int:
        return len(chunks) * max(c.numel() for c in chunks) * chunks[0].element_size()

    # -- world-specific
    def _all_reduce(self, t, op, group):  # pragma: no cover - abstract
        raise NotImplementedError

    def _all_reduce_async(self, t: torch.Tensor, op: str, group: Group) -> CollectiveWork:
        return CollectiveWork.done(self._all_reduce(t, op, group))

    def _all_gather_async(self, t: torch.Tensor, group: Group, shapes: Sequence[tuple]) -> CollectiveWork:
        return CollectiveWork.done(self._all_gather(t, group, shapes))

    def _all_gather(self, t, group, shapes):  # pragma: no cover - abstract
        raise NotImplementedError

    def _reduce_scatter(self, chunks, op, group):  # pragma: no cover - abstract
        raise NotImplementedError

    def _reduce_scatter_async(self, chunks: Sequence[torch.Tensor], op: str, group: Group) -> CollectiveWork:
        return CollectiveWork.done(self._reduce_scatter(chunks, op, group))

    def exchanges_reduce_scatter(self, group: Group, device: torch.device) -> bool:
        """Whether a reduce_scatter over `group` is an all_to_all and a local reduction (a gloo group: torch_dist)."""
        return False

    def functional_group(self, group: Group, kind: str = "all_reduce") -> tuple[str, tuple[int, ...]] | None:
        """(torch process group name, torch group rank of each shardops member) where torch's functional
        collective `kind` can carry `group` in a compiled graph; None where it cannot (no torch process
        group, or a backend without that collective)."""
        return None

    def _all_to_all(self, chunks, group, recv_shapes):  # pragma: no cover - abstract
        raise NotImplementedError

    def _broadcast(self, t, src_index, group):  # pragma: no cover - abstract
        raise NotImplementedError

    def _barrier(self, group):  # pragma: no cover - abstract
        raise NotImplementedError


def _traced(t: torch.Tensor) -> bool:
    """A fake tensor: torch.compile is tracing, the collective goes into the graph (comm/traceable)."""
    return _traceable().is_traced_tensor(t)


def _traceable():
    from . import traceable  # torch's compile machinery: imported on the first traced collective only

    return traceable


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ShardingError(f"unknown reduce op {op!r}; use one of {REDUCE_OPS}")


reduce_stack = reduce_values  # the meaning of each op lives with the placements (placements.Partial)
